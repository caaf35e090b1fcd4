"""bench/fleet/run.py on the CPU: the real operator against the API emulator scales real engine
processes of the tiny model from 1 to 2 and back under a ramp, with requests through the real
router; none fails, and the report has its fields."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.scripts import load_script

fleet = load_script("bench/fleet/run.py")


def test_fleet_scales_up_and_down_under_a_ramp_without_failures(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "fleet.json"
    rc = fleet.main(
        [
            *("--model", "tiny", "--min-replicas", "1", "--max-replicas", "2"),
            # A short scale-down window: without one, a lull inside the busy phase (a loaded CI
            # machine) scales down and up again.
            *("--target-queue-depth", "0.5", "--scale-down-window", "6"),
            *("--autoscale-interval", "1", "--phases", "10x6,10x0.5", "--policies", "prefix"),
            *("--turns", "3", "--system-words", "100", "--user-words", "20"),
            *("--reply-words", "20", "--max-tokens", "32", "--think-time", "0.5"),
            *("--settle", "20", "--log-dir", str(tmp_path), "--result-json", str(out)),
        ]
    )
    assert rc == 0
    (run,) = json.loads(out.read_text())["runs"]
    assert run["policy"] == "prefix" and run["requests"] > 20
    assert run["failed"] == 0, run["errors"]
    assert run["output_tokens"] == 32 * run["requests"] and run["output_tok_s"] > 0
    assert run["ttft_p90_ms"] >= run["ttft_p50_ms"] > 0 and run["latency_p90_ms"] > 0
    assert 0 < run["prefix_cache_hit_rate"] < 1
    assert set(run["router"]) >= {"spilled", "retries", "rejected"}
    up, down = run["scaling"]
    assert (up["from"], up["to"], down["from"], down["to"]) == (1, 2, 2, 1), run["scaling"]
    assert up["decision_delay_s"] >= 0 and up["engine_start_s"][0] > 0
    assert down["drained_s"][0] >= 5  # the preStop sleep, then the drain
    assert run["peak_replicas"] == 2
    # TTFT per phase of the ramp, each request in the phase it started in.
    assert [ph["phase"] for ph in run["phases"]] == ["10x6", "10x0.5"]
    assert sum(ph["requests"] for ph in run["phases"]) == run["requests"]
    assert all(ph["ttft_p90_ms"] > 0 for ph in run["phases"] if ph["requests"])
    # Each scale event names the signal of the decision that made it.
    assert up["signal"] in ("queueDepth", "kvCacheUsage", "forecast"), up
    assert down["signal"] in ("queueDepth", "kvCacheUsage", "idle"), down
    # Each scale decision the status reported, with the signal that made it.
    assert [d["decision"]["to"] for d in run["decisions"]][-2:] == [2, 1], run["decisions"]
    assert all(d["decision"].get("signal") for d in run["decisions"])
    # The operator learned the engines' start time from the pods the harness reports Ready.
    assert 0 < run["learned_engine_start_s"] <= max(up["engine_start_s"]) + 1.5
    assert 0 < run["replica_seconds"] < run["static_peak_replica_seconds"]
    assert "| prefix |" in capsys.readouterr().out


def test_phases_name_a_rate_sweep_and_refuse_nonsense() -> None:
    ns = fleet.parse_args(["--phases", "30x8;20x1,40x16", "--latency-target", "ttft:0.9:0.5"])
    assert ns.latency_target == ("ttft", 0.9, 0.5)
    assert fleet.inference_service(ns)["spec"]["autoscaling"]["scaleAhead"] is True
    off = fleet.parse_args(["--no-scale-ahead"])
    assert fleet.inference_service(off)["spec"]["autoscaling"]["scaleAhead"] is False
    assert fleet.inference_service(ns)["spec"]["autoscaling"]["latencyTarget"] == {
        "metric": "ttft", "quantile": 0.9, "targetSeconds": 0.5
    }  # fmt: skip
    assert [[(p.seconds, p.rate) for p in ph] for ph in ns.phases] == [
        [(30, 8)],
        [(20, 1), (40, 16)],
    ]
    for bad in (";", "30x8;30", "30x-1"):
        with pytest.raises(SystemExit):
            fleet.parse_args(["--phases", bad])
    for bad in ("p99:0.9:1", "ttft:1.5:1", "ttft:0.9", "ttft:0.9:0"):
        with pytest.raises(SystemExit):
            fleet.parse_args(["--latency-target", bad])


def test_engines_at_their_defaults_and_policies_routers_and_workloads_chosen() -> None:
    ns = fleet.parse_args([])
    assert ns.policies == ["round-robin", "session", "prefix", "precise"]
    assert (ns.workload, ns.max_tokens, ns.router_replicas) == ("chat", 64, [1])
    # Production settings: no batch bound unless the call gives one.
    assert "maxNumSeqs" not in fleet.inference_service(ns)["spec"]["engine"]
    bounded = fleet.parse_args(["--max-num-seqs", "64"])
    assert fleet.inference_service(bounded)["spec"]["engine"]["maxNumSeqs"] == 64
    tenants = fleet.parse_args(["--workload", "tenants", "--router-replicas", "1,3"])
    assert (tenants.max_tokens, tenants.router_replicas) == (24, [1, 3])
    workload = fleet.make(tenants, tenants.phases[0], [])
    assert len(workload.systems) == 128 and {len(s.users) for s in workload.sessions} == {1}
    # Approximate routers run as the operator deploys them; precise scoring needs a tokenizer.
    prefix, precise = (fleet.policy_router_args(p, ns) for p in ("prefix", "precise"))
    assert prefix == ["--prefix-scoring", "approximate"]
    assert precise[:3] == ["--prefix-scoring", "precise", "--tokenizer"]
    assert Path(precise[3]).is_dir()
    for bad in (
        ["--policies", "prefix,exact"],
        ["--router-replicas", "0"],
        ["--router-replicas", "1,17"],
        ["--router-replicas", "3,3"],
        ["--router-replicas", "three"],
        ["--workload", "tenants", "--tenants", "0"],
        ["--workload", "tenants", "--adapters", "2"],
        ["--model", "default", "--policies", "precise"],
    ):
        with pytest.raises(SystemExit):
            fleet.parse_args(bad)


def test_router_policies_spread_requests_over_the_replicas_in_turn() -> None:
    deployment = {"spec": {"template": {"spec": {"containers": [{"args": []}]}}}}
    f = fleet.Fleet(None, None, deployment, "m", {}, Path())
    routers = ["http://r0", "http://r1", "http://r2"]
    prefix = f.target("prefix", routers)
    assert [prefix(7)[0] for _ in range(4)] == [*routers, routers[0]]
    session = f.target("session", routers)
    assert [session(5) for _ in range(2)] == [
        (url, {"x-session-id": "session-5"}) for url in routers[:2]
    ]
