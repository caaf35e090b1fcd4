"""bench/fleet/plot.py draws the routing and ramp PNGs from harness results (JSON or the table the
harness printed), and refuses input it cannot plot."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.scripts import load_script

plot = load_script("bench/fleet/plot.py")

TABLE = """some log line
| load | policy | requests | failed | output tok/s | TTFT p50 ms | TTFT p90 ms | latency p90 ms | hit rate | spilled | retries | peak replicas | replica-s | static at peak |
|---|---|---|---|---|---|---|---|---|---|---|---|---|---|
| 40x8 | round-robin | 240 | 0 | 393 | 54 | 146 | 1105 | 65.9% |  |  | 2 | 122.3 | 122.3 |
| 40x8 | prefix | 240 | 0 | 394 | 49 | 126 | 1048 | 83.5% | 2 | 0 | 2 | 121.8 | 121.8 |
| 40x20 | prefix | 752 | 0 | 1,305 | 82 | 302 | 2122 | 80.7% | 24 | 0 | 2 | 115.2 | 115.2 |
"""  # noqa: E501


def _ramp_report() -> dict:
    samples = [[t * 0.5, 0.05 + t / 100, 1.0, t != 7] for t in range(40)]
    return {
        "phases": [[{"seconds": 5, "rate": 1}, {"seconds": 10, "rate": 6}]],
        "runs": [
            {"load": "5x1,10x6", "policy": "prefix", "requests": 40, "output_tok_s": 10.0,
             "ttft_p90_ms": 300.0, "ttft_slo_s": 1.0, "samples": samples,
             "replicas": [[0, 1, 1, 1], [6, 2, 1, 2], [9, 2, 2, 2]]},
            {"load": "20x3", "policy": "prefix", "requests": 60, "output_tok_s": 30.0,
             "ttft_p90_ms": 500.0, "ttft_slo_s": 1.0, "samples": samples,
             "replicas": [[0, 2, 2, 2]]},
        ],
    }  # fmt: skip


def test_reads_the_printed_table() -> None:
    runs = plot.read_table(TABLE)
    assert [
        (r["load"], r["policy"], r["output_tok_s"], r["ttft_p90_ms"], r["hit_rate"]) for r in runs
    ] == [
        ("40x8", "round-robin", 393, 146, pytest.approx(0.659)),
        ("40x8", "prefix", 394, 126, pytest.approx(0.835)),
        ("40x20", "prefix", 1305, 302, pytest.approx(0.807)),
    ]
    with pytest.raises(ValueError, match="no table"):
        plot.read_table("| policy | requests |\n| prefix | 3 |\n")


def test_draws_both_plots_from_tables_and_json(tmp_path: Path) -> None:
    (tmp_path / "sweep.txt").write_text(TABLE)
    (tmp_path / "ramp.json").write_text(json.dumps(_ramp_report()))
    out = tmp_path / "png"
    assert plot.main(["--out-dir", str(out), str(tmp_path / "sweep.txt"),
                      str(tmp_path / "ramp.json")]) == 0  # fmt: skip
    for name in ("routing.png", "ramp.png"):
        data = (out / name).read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) > 10_000


def test_results_from_before_rate_sweeps_take_the_reports_load(tmp_path: Path) -> None:
    report = {"phases": [{"seconds": 60, "rate": 16}],
              "runs": [{"policy": "prefix", "output_tok_s": 1.0, "ttft_p90_ms": 2.0}]}  # fmt: skip
    (tmp_path / "old.json").write_text(json.dumps(report))
    runs, _ = plot.read_runs(tmp_path / "old.json")
    assert runs[0]["load"] == "60x16"


def test_nothing_to_plot_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "empty.txt").write_text("no table here\n")
    with pytest.raises(SystemExit):
        plot.main(["--out-dir", str(tmp_path), str(tmp_path / "empty.txt")])


def test_the_hit_rate_counts_the_host_tiers_hits_with_the_devices(capsys) -> None:
    """vllm:prefix_cache_hits counts the device's hits alone: a run with a host KV tier
    (device 68.9%, host 12.2% of the prompt tokens, the H200's) hits 81.1%, in the table, the
    rate-at-SLO table and the plot; a result from before hit_rate was kept says the same."""
    fleet = load_script("bench/fleet/run.py")
    records = [fleet.Record(session=0, turn=0, start=0.0, ttft=0.1, latency=0.5, output_tokens=8,
                            prompt_tokens=100)]  # fmt: skip
    run = fleet.summarize("round-robin", records, 60.0, (689.0, 122.0), 1000.0, None,
                          [[0.0, 1, 1, 1]], [], 1.0)  # fmt: skip
    assert (run["hit_rate"], run["prefix_cache_hit_rate"]) == (0.811, 0.689)
    run |= {"load": "60x4", "phases": [], "samples": [[0.0, 0.1, 8, True]]}
    old = {k: v for k, v in run.items() if k != "hit_rate"}
    for r in (run, old):
        fleet.print_table([r])
        fleet.print_capacities(plot.capacities([r], 1.0), [r], 1.0)
        out = capsys.readouterr().out
        row = next(line for line in out.splitlines() if line.startswith("| 60x4 |"))
        assert row.split("|")[9].strip() == "81.1%", row
        assert "| 81.1% - 81.1% |" in out
        assert "hit rate 81.1%: 68.9% of prompt tokens found on the device, 12.2% copied " in out
        assert plot.hit_rate(r) == pytest.approx(0.811)
    assert [r["hit_rate"] for r in plot.read_table(out)] == [pytest.approx(0.811)]
