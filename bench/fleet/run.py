"""The fleet harness: the real operator, real engines and the real router, in one call.

The operator (``kvfleet-operator run``, a child process) reconciles an InferenceService in
kmock's Kubernetes API emulator (bench/fleet/cluster.py) through a kubeconfig; the pod runner
(bench/fleet/pods.py) turns its engine Deployment's replicas into ``kvfleet-engine`` processes
with the arguments the operator generated and reports their readiness into Pods and
EndpointSlices; the router (``kvfleet-router``, a child process, the arguments of the router
Deployment) watches those slices. The autoscaler's decisions therefore start and stop real
engines. A workload (bench/fleet/workload.py) runs once per policy, the same requests each time
(and, for a rate sweep, once per policy and load shape: ``--phases "60x8;60x16"`` measures both
rates on the same warm fleet, which saves the engines' start on GPUs):

* ``round-robin``: straight to the ready engines in turn (the baseline, no router);
* ``session``: through the router, each chat session's id in the session header;
* ``prefix``: through the router, keyed by the prompt's prefix (``--prefix-scoring
  approximate``: a hash of its first characters on a ring of the engines);
* ``precise``: through the router scoring each engine by the longest prefix of the prompt it
  holds, from the engines' KV events (``--prefix-scoring precise``).

Each router policy gets its own routers for each run, started as the operator's router
Deployment says (its arguments, plus ``--prefix-scoring``, for precise scoring the model's
tokenizer, and any ``--router-arg``): ``--router-replicas N`` of them, behind a client-side
round robin over them that stands for their Service; ``--router-replicas 1,3`` runs each router
policy with one and with three, on the same requests (its rows named ``precise x3``). The
engines run at their own defaults (the batch bound included: ``--max-num-seqs`` is passed only
when given), as in production.

Two workloads (the same requests for every policy of a call, seeded): ``--workload chat``,
multi-turn sessions sharing a few long system prompts, each turn sending the whole history;
``--workload tenants``, llm-d's benchmark shape: many tenants each with a long system prompt,
one short question a request and a short answer, tenants drawn by a Zipf or uniform popularity.
A rate sweep (``--phases "60x8;60x16;60x24"``) reports the rate each policy serves at the TTFT
SLO (its p90 TTFT crossing ``--ttft-slo``) and the ratio to round robin's.

CPU, the tiny random model, a ramp under the builtin autoscaler (1 to 2 replicas and back)::

    python bench/fleet/run.py --model tiny --min-replicas 1 --max-replicas 2 \\
        --target-queue-depth 1 --phases 15x6,15x0.5 --policies prefix --result-json out.json

GPUs, dummy weights (a tokenizer from bench/dummy_tokenizer.py), a fixed fleet of four::

    python bench/dummy_tokenizer.py bench/models/Llama-3.1-8B /tmp/llama8b
    python bench/fleet/run.py --model /tmp/llama8b --engine-arg=--load-format=dummy \\
        --gpus 0,1,2,3 --min-replicas 4 --max-replicas 4 --phases 120x8 \\
        --system-words 3000 --result-json llama8b-fleet.json

The tenant workload, a rate sweep, precise scoring through one router and through three::

    python bench/fleet/run.py --model /tmp/llama8b --engine-arg=--load-format=dummy \\
        --gpus 0,1,2,3 --min-replicas 4 --max-replicas 4 --workload tenants --tenants 128 \\
        --phases "60x20;60x40;60x60" --policies precise --router-replicas 1,3 \\
        --result-json tenants.json

LoRA adapters (``--adapters N``): N random rank-``--adapter-rank`` adapters of the model in
spec.adapters, each session talking to one of them with a Zipf popularity (``--adapter-zipf``),
``--max-loras`` of them in each engine's GPU slots. ``prefix`` then places each adapter's
requests as the router does (docs/routing.md#lora-adapters) against ``round-robin``, which
ignores where adapters are; the same requests each. On two to four GPUs::

    python bench/fleet/run.py --model /tmp/llama8b --engine-arg=--load-format=dummy \
        --gpus 0,1,2,3 --min-replicas 4 --max-replicas 4 --phases 120x8 \
        --adapters 32 --max-loras 4 --max-cpu-loras 16 --policies round-robin,prefix \
        --result-json llama8b-lora-fleet.json

Reported per policy (a table, and JSON with --result-json): output tok/s, TTFT and latency
p50/p90, TTFT SLO attainment, the rate at the SLO over a sweep (bench/fleet/capacity.py), the
engines' prefix-cache hit rate (the prompt tokens found on the device or copied back from the
host KV tier, vllm:prefix_cache_hits + vllm:external_prefix_cache_hits over
vllm:prefix_cache_queries deltas, gone engines counted as they were before their SIGTERM; with a
host tier, each tier's share too), the router's spill, retry and rejection counters summed
over its replicas, adapter loads into GPU slots per minute (with adapters), failed requests,
replicas over time, replica-seconds (GPU-seconds on GPUs) against static provisioning at the
peak, and each scale-up split into the operator's decision delay and the engine's start.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import aiohttp

# bench/ for its modules, and the repository root for the emulator the tests use too.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import device_name, free_port, git_commit, stop
from fleet.adapters import LoadCounter, gpu_adapters, write_random_adapter
from fleet.capacity import Capacity, capacities, hit_rate, series_name
from fleet.cluster import ISVCS, PODS, Emulator, call, emulated_cluster, resource_url
from fleet.pods import PodRunner, register_router
from fleet.scale_zero import measure as measure_from_zero
from fleet.scale_zero import print_table as print_from_zero
from fleet.workload import (
    Phase,
    Record,
    Target,
    Workload,
    make_tenant_workload,
    make_workload,
    parse_phases,
    percentiles_ms,
    run_workload,
)

logger = logging.getLogger("kvfleet.bench.fleet")

NAMESPACE = "fleet"
SERVICE = "bench"
POLICIES = ("round-robin", "session", "prefix", "precise")
# The router's --prefix-scoring of each router policy: precise scores engines from their KV
# events; approximate is the hash of the prompt's head on the ring (session keys ignore both).
PREFIX_SCORING = {"session": "approximate", "prefix": "approximate", "precise": "precise"}
WORKLOADS = ("chat", "tenants")
# Answer lengths: the chat's turns carry replies; a tenant's question gets a short answer.
MAX_TOKENS = {"chat": 64, "tenants": 24}
MAX_ROUTER_REPLICAS = 16
SCENARIOS = ("workload", "scale-from-zero")
# Device hits, prompt tokens looked up, and hits in the engines' host tier (--cpu-kv-cache).
PREFIX_COUNTERS = (
    "vllm:prefix_cache_hits_total",
    "vllm:prefix_cache_queries_total",
    "vllm:external_prefix_cache_hits_total",
)
ROUTER_COUNTERS = {
    "spilled": "kvfleet_router_spilled_total",
    "retries": "kvfleet_router_retries_total",
    "rejected": "kvfleet_router_rejected_requests_total",
    "upstream_errors": "kvfleet_router_upstream_errors_total",
    "hold_timeouts": "kvfleet_router_hold_timeouts_total",
}
SAMPLE_S = 0.5
RUN = "import sys; from kvfleet.{0}.main import main; sys.exit(main())"


def model_dir(ns: argparse.Namespace) -> str:
    """The model's source: a folder, or empty for the engine's default model."""
    from tests.support.tiny_model import tiny_model_path

    model: str = ns.model
    return {"tiny": str(tiny_model_path()), "default": ""}.get(model, model)


def inference_service(
    ns: argparse.Namespace, adapters: dict[str, Path] | None = None
) -> dict[str, Any]:
    """adapters: name -> folder, in spec.adapters."""
    source = model_dir(ns)
    engine: dict[str, Any] = {
        "extraArgs": ns.engine_arg,
        "shutdownTimeoutSeconds": ns.shutdown_timeout,
    }
    # Production settings: the engine's own batch bound unless the call names one.
    if ns.max_num_seqs is not None:
        engine["maxNumSeqs"] = ns.max_num_seqs
    if adapters:
        engine.update(maxLoras=ns.max_loras, maxCpuLoras=ns.max_cpu_loras,
                      maxLoraRank=ns.adapter_rank)  # fmt: skip
    if ns.max_model_len:
        engine["maxModelLen"] = ns.max_model_len
    if ns.cpu_kv_cache is not None:
        engine["cpuKvCacheBytes"] = ns.cpu_kv_cache
    isvc: dict[str, Any] = {
        "apiVersion": "kvfleet.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": SERVICE, "namespace": NAMESPACE},
        "spec": {
            "model": {"source": source},
            "engine": engine,
            "resources": {"gpus": 1 if ns.gpus else 0},
            "autoscaling": {
                "mode": "builtin",
                "minReplicas": ns.min_replicas,
                "maxReplicas": ns.max_replicas,
                "targetQueueDepth": ns.target_queue_depth,
                "scaleDownStabilizationSeconds": ns.scale_down_window,
                "scaleToZeroDelaySeconds": ns.scale_to_zero_delay,
                "scaleAhead": not ns.no_scale_ahead,
            },
            "routing": {"prefixLength": ns.prefix_length, "loadFactor": ns.load_factor},
            "adapters": [
                {"name": name, "source": str(path), "rank": ns.adapter_rank}
                for name, path in (adapters or {}).items()
            ],
        },
    }
    if ns.latency_target:
        metric, quantile, seconds = ns.latency_target
        isvc["spec"]["autoscaling"]["latencyTarget"] = {
            "metric": metric, "quantile": quantile, "targetSeconds": seconds
        }  # fmt: skip
    return isvc


# --------------------------------------------------------------------------------------------
# The fleet
# --------------------------------------------------------------------------------------------


class Fleet:
    def __init__(
        self,
        k: Emulator,
        runner: PodRunner,
        router_deployment: dict[str, Any],
        model: str,
        env: dict[str, str],
        work: Path,
    ) -> None:
        """router_deployment: the operator's, whose arguments the routers run with."""
        self.k, self.runner, self.model = k, runner, model
        self.router_deployment, self.env, self.work = router_deployment, env, work
        (container,) = router_deployment["spec"]["template"]["spec"]["containers"]
        self.router_args: list[str] = container["args"]

    def target(self, policy: str, routers: Sequence[str]) -> Target:
        """Where each request goes: the next ready engine (round robin), or the next of the
        routers, round robin over them as their Service spreads connections."""
        turn = itertools.count()
        if policy == "round-robin":

            def next_engine(_session: int) -> tuple[str, dict[str, str]]:
                urls = self.runner.ready_urls()
                return urls[next(turn) % len(urls)], {}

            return next_engine
        if policy == "session":
            return lambda session: (
                routers[next(turn) % len(routers)],
                {"x-session-id": f"session-{session}"},
            )
        return lambda _session: (routers[next(turn) % len(routers)], {})

    def status(self) -> dict[str, Any]:
        """The InferenceService's status as the API holds it now."""
        return (self.k.live(ISVCS, NAMESPACE, SERVICE) or {}).get("status") or {}

    @contextlib.asynccontextmanager
    async def routers(
        self, policy: str, replicas: int, ns: argparse.Namespace
    ) -> AsyncIterator[list[str]]:
        """``replicas`` router processes for one run of a router policy, each answering and
        registered as a Ready pod of the router Deployment (the operator scrapes its held
        requests, the signal that scales from zero) while it runs; none for round robin."""
        if policy == "round-robin":
            yield []
            return
        procs, urls, pods = [], [], []
        try:
            for i in range(replicas):
                port = free_port()
                args = _replace(
                    _replace(self.router_args, "--host", "127.0.0.1"), "--port", str(port)
                )
                with (self.work / f"router-{policy}-{replicas}.{i}.log").open("ab") as log:
                    procs.append(subprocess.Popen(
                        _command("router", *args, *policy_router_args(policy, ns), *ns.router_arg),
                        env=self.env, stdout=log, stderr=subprocess.STDOUT,
                    ))  # fmt: skip
                urls.append(f"http://127.0.0.1:{port}")
            await _eventually(lambda: all(map(_answers, urls)), f"the {policy} routers", 60, procs)
            for url in urls:
                port = int(url.rpartition(":")[2])
                pods.append(await register_router(self.k, NAMESPACE, self.router_deployment, port))
            yield urls
        finally:
            # The pods first: the operator must not scrape routers that are gone.
            for pod in pods:
                await call(self.k, "delete", resource_url(PODS, NAMESPACE, pod))
            stop(procs)

    async def router_counters(self, routers: Sequence[str]) -> dict[str, float]:
        """The router counters summed over the replicas."""
        sums = dict.fromkeys(ROUTER_COUNTERS, 0.0)
        names = {v: k for k, v in ROUTER_COUNTERS.items()}
        async with aiohttp.ClientSession() as http:
            for url in routers:
                async with http.get(f"{url}/metrics") as r:
                    for line in (await r.text()).splitlines():
                        sample, _, value = line.rpartition(" ")
                        if (name := names.get(sample.partition("{")[0])) is not None:
                            sums[name] += float(value)
        return sums


def policy_router_args(policy: str, ns: argparse.Namespace) -> list[str]:
    """What a router policy adds to the operator's router arguments: its prefix scoring, and
    for precise scoring the model's tokenizer, which it needs. The others run as the operator
    deploys the router today, without one (prefix keys of characters)."""
    args = ["--prefix-scoring", PREFIX_SCORING[policy]]
    return [*args, "--tokenizer", model_dir(ns)] if policy == "precise" else args


def _command(package: str, *args: str) -> list[str]:
    # Modules rather than the console scripts: the GPU machines put kvfleet on the path only.
    return [sys.executable, "-c", RUN.format(package), *args]


def _replace(args: list[str], flag: str, value: str) -> list[str]:
    out = list(args)
    out[out.index(flag) + 1] = value
    return out


async def _eventually(check: Any, what: str, timeout: float, procs: Sequence[Any] = ()) -> Any:
    deadline = time.monotonic() + timeout
    while not (result := check()):
        if dead := [p.args for p in procs if p.poll() is not None]:
            raise RuntimeError(f"exited while waiting for {what}: {dead[0][:3]}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout:g}s")
        await asyncio.sleep(0.1)
    return result


def write_adapters(ns: argparse.Namespace, work: Path) -> dict[str, Path]:
    """``--adapters`` random adapters of the model under ``work``, most popular first."""
    import torch

    dtype = torch.bfloat16 if ns.gpus else torch.float32
    return {
        f"adapter-{i:02d}": write_random_adapter(
            Path(model_dir(ns)), work / "adapters" / f"adapter-{i:02d}",
            rank=ns.adapter_rank, seed=i, dtype=dtype,
        )
        for i in range(ns.adapters)
    }  # fmt: skip


@contextlib.asynccontextmanager
async def fleet(
    ns: argparse.Namespace, work: Path, adapters: dict[str, Path] | None = None
) -> AsyncIterator[Fleet]:
    """The emulated cluster, the operator and the pod runner, the first engines ready."""
    kubeconfig = work / "kubeconfig"
    env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
    async with emulated_cluster(NAMESPACE, kubeconfig) as k:
        operator = subprocess.Popen(
            _command("operator", "run", "-n", NAMESPACE,
                     "--autoscale-interval", str(ns.autoscale_interval),
                     f"--health-address=127.0.0.1:{free_port()}",
                     f"--metrics-address=127.0.0.1:{free_port()}"),
            env=env, stdout=(work / "operator.log").open("ab"), stderr=subprocess.STDOUT,
        )  # fmt: skip
        procs = [operator]
        runner = PodRunner(k, NAMESPACE, SERVICE, work, ns.gpus.split(",") if ns.gpus else ())
        running = asyncio.create_task(runner.run())
        try:
            await call(k, "post", resource_url(ISVCS, NAMESPACE), inference_service(ns, adapters))
            router_deployment = await _eventually(
                lambda: k.live("apps/v1/deployments", NAMESPACE, f"{SERVICE}-router"),
                "the operator's router Deployment", 60, procs,
            )  # fmt: skip
            # A service of minReplicas 0 starts at one replica too (the operator's seed).
            await runner.wait_ready(ns.min_replicas or 1, ns.start_timeout)
            engine = k.live("apps/v1/deployments", NAMESPACE, f"{SERVICE}-engine")
            assert engine is not None
            (engine_container,) = [
                c for c in engine["spec"]["template"]["spec"]["containers"] if c["name"] == "engine"
            ]
            args = engine_container["args"]
            model = args[args.index("--served-model-name") + 1]
            yield Fleet(k, runner, router_deployment, model, env, work)
        finally:
            # The operator first: the engines going is no scale-down to act on.
            stop(procs)
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)


def _answers(url: str) -> bool:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"{url}/health", timeout=1) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


# --------------------------------------------------------------------------------------------
# One policy's run
# --------------------------------------------------------------------------------------------


async def sample_replicas(
    f: Fleet, t0: float, out: list[list[float]], decisions: list[dict[str, Any]]
) -> None:
    """Replicas every SAMPLE_S, and each new status.lastScaleDecision (which signal decided)."""
    url = resource_url(ISVCS, NAMESPACE, SERVICE)
    while True:
        desired = f.runner.desired or 0
        at = round(time.monotonic() - t0, 2)
        out.append([at, desired, len(f.runner.ready_urls()), f.runner.running()])
        with contextlib.suppress(Exception):  # a sample missed is no failure of the run
            decision = (await call(f.k, "get", url)).get("status", {}).get("lastScaleDecision")
            if decision and (not decisions or decisions[-1]["decision"] != decision):
                decisions.append({"at_s": at, "decision": decision})
        await asyncio.sleep(SAMPLE_S)


def scale_events(f: Fleet, workload: Workload, t0: float, t1: float) -> list[dict[str, Any]]:
    """Each change of the Deployment's replicas within [t0, t1]: for a scale-up, when its new
    pods were created and served, the decision delay since the last rise of the rate and the
    time from that rise to the new pods serving; for a
    scale-down, when the removed engines left and exited."""
    events = [e for e in f.runner.events if t0 <= e.t <= t1]
    out = []
    for e in (e for e in events if e.what == "replicas"):
        before, after = (int(x) if x != "None" else 0 for x in e.detail.split(" -> "))
        at = e.t - t0
        item: dict[str, Any] = {"at_s": round(at, 2), "from": before, "to": after}
        if after > before:
            created = [x for x in events if x.what == "created" and x.t >= e.t][: after - before]
            pods = [f.runner.pods[x.pod] for x in created]
            rises = [s for s, (a, b) in _phase_starts(workload) if b > a and s <= at]
            if rises:
                item["decision_delay_s"] = round(at - rises[-1], 2)
                # What a scale-up ahead of the trend shortens: the rise to the new capacity.
                item["serving_after_rise_s"] = [
                    round(p.ready - t0 - rises[-1], 2) if p.ready else None for p in pods
                ]
            item["engine_start_s"] = [
                round(p.ready - p.created, 2) if p.ready else None for p in pods
            ]
            item["serving_after_decision_s"] = [
                round(p.ready - e.t, 2) if p.ready else None for p in pods
            ]
        else:
            gone = [x for x in events if x.what == "terminating" and x.t >= e.t][: before - after]
            pods = [f.runner.pods[x.pod] for x in gone]
            item["drained_s"] = [round(p.exited - p.terminating, 2) if p.exited and
                                 p.terminating else None for p in pods]  # fmt: skip
        out.append(item)
    return out


def with_signals(
    scaling: list[dict[str, Any]], decisions: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Each scale event with the signal and reason of the status.lastScaleDecision that made it:
    the latest sampled decision of the same from -> to at or before the event (the reconciler
    applies a decision after its status write; sampled every SAMPLE_S)."""
    out = []
    for event in scaling:
        made = [
            d["decision"]
            for d in decisions
            if (d["decision"].get("from"), d["decision"].get("to")) == (event["from"], event["to"])
            and d["at_s"] <= event["at_s"] + SAMPLE_S
        ]
        if made:
            event = {**event, "signal": made[-1].get("signal"), "reason": made[-1].get("reason")}
        out.append(event)
    return out


def phase_ttfts(records: list[Record], workload: Workload, ttft_slo: float) -> list[dict[str, Any]]:
    """Per phase of the load (by each request's start): requests, failed, TTFT p50/p90 and the
    share within the SLO, so a ramp's low, rising and peak phases are compared apart."""
    out = []
    for i, phase in enumerate(workload.phases):
        mine = [r for r in records if workload.phase_at(r.start) == i]
        ttfts = [r.ttft for r in mine if r.error is None and r.ttft is not None]
        p50, p90 = percentiles_ms(ttfts, 50, 90)
        out.append({
            "phase": f"{phase.seconds:g}x{phase.rate:g}", "requests": len(mine),
            "failed": sum(r.error is not None for r in mine), "ttft_p50_ms": p50,
            "ttft_p90_ms": p90,
            "slo_attainment": sum(t <= ttft_slo for t in ttfts) / len(mine) if mine else None,
        })  # fmt: skip
    return out


def _phase_starts(workload: Workload) -> list[tuple[float, tuple[float, float]]]:
    """(start second, (previous rate, rate)) of each phase."""
    out, t, prev = [], 0.0, 0.0
    for p in workload.phases:
        out.append((t, (prev, p.rate)))
        t, prev = t + p.seconds, p.rate
    return out


async def sample_adapter_loads(f: Fleet, loads: LoadCounter) -> None:
    """The adapters in each ready engine's GPU slots every SAMPLE_S."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as http:
        while True:
            held = []
            for url in f.runner.ready_urls():
                with contextlib.suppress(aiohttp.ClientError, TimeoutError, OSError):
                    async with http.get(f"{url}/metrics") as r:
                        held.append((url, gpu_adapters(await r.text())))
            loads.sample(held)
            await asyncio.sleep(SAMPLE_S)


async def run_policy(
    f: Fleet, policy: str, replicas: int, workload: Workload, tag: str, ns: argparse.Namespace
) -> dict[str, Any]:
    """One run of ``policy``, through ``replicas`` routers (0 for round robin)."""
    async with f.routers(policy, replicas, ns) as routers:
        return {**await _run_policy(f, policy, routers, workload, tag, ns), "routers": replicas}


async def _run_policy(
    f: Fleet,
    policy: str,
    routers: list[str],
    workload: Workload,
    tag: str,
    ns: argparse.Namespace,
) -> dict[str, Any]:
    h0 = await f.runner.totals(PREFIX_COUNTERS)
    r0 = await f.router_counters(routers)
    replicas: list[list[float]] = []
    decisions: list[dict[str, Any]] = []
    loads = LoadCounter()
    t0 = time.monotonic()
    sampler = asyncio.create_task(sample_replicas(f, t0, replicas, decisions))
    load_sampler = asyncio.create_task(sample_adapter_loads(f, loads)) if ns.adapters else None
    records = await run_workload(workload, f.target(policy, routers), f.model, tag)
    t_end = time.monotonic()
    seconds = t_end - t0
    if load_sampler is not None:
        load_sampler.cancel()
        await asyncio.gather(load_sampler, return_exceptions=True)
    # The scale-down after the load, if the autoscaler makes one: its pods drain and exit.
    deadline = time.monotonic() + ns.settle
    while time.monotonic() < deadline and (
        f.runner.running() > max(ns.min_replicas, 1) or (f.runner.desired or 0) > ns.min_replicas
    ):
        await asyncio.sleep(SAMPLE_S)
    sampler.cancel()
    await asyncio.gather(sampler, return_exceptions=True)
    h1 = await f.runner.totals(PREFIX_COUNTERS)
    r1 = await f.router_counters(routers)
    hits, queries, host_hits = (h1[n] - h0[n] for n in PREFIX_COUNTERS)
    summary = summarize(policy, records, seconds, (hits, host_hits), queries,
                        {k: int(r1[k] - r0[k]) for k in r0} if routers else None,
                        replicas, scale_events(f, workload, t0, time.monotonic()),
                        ns.ttft_slo)  # fmt: skip
    summary["scaling"] = with_signals(summary["scaling"], decisions)
    status = (await call(f.k, "get", resource_url(ISVCS, NAMESPACE, SERVICE))).get("status", {})
    learned = (status.get("autoscaling") or {}).get("engineStartSeconds")
    adapter_loads = (
        {"adapter_loads": loads.loads, "adapter_loads_per_min": loads.loads * 60 / seconds}
        if ns.adapters
        else {}
    )
    return {**summary, **adapter_loads, "phases": phase_ttfts(records, workload, ns.ttft_slo),
            "decisions": decisions, "learned_engine_start_s": learned}  # fmt: skip


def summarize(
    policy: str,
    records: list[Record],
    seconds: float,
    hits: tuple[float, float],
    queries: float,
    router: dict[str, int] | None,
    replicas: list[list[float]],
    scaling: list[dict[str, Any]],
    ttft_slo: float,
) -> dict[str, Any]:
    ok = [r for r in records if r.error is None]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    latencies = [r.latency for r in ok if r.latency is not None]
    output = sum(r.output_tokens for r in ok)
    # Replica-seconds within the load: each sample's engines held until the next sample.
    ends = [min(s[0], seconds) for s in replicas[1:]] + [seconds]
    replica_s = sum(max(0.0, end - s[0]) * s[3] for s, end in zip(replicas, ends, strict=True))
    peak = max((s[3] for s in replicas), default=0)
    ttft_p50, ttft_p90 = percentiles_ms(ttfts, 50, 90)
    lat_p50, lat_p90 = percentiles_ms(latencies, 50, 90)
    return {
        "policy": policy,
        "requests": len(records),
        "failed": len(records) - len(ok),
        "errors": sorted({r.error for r in records if r.error})[:5],
        "seconds": round(seconds, 2),
        "prompt_tokens": sum(r.prompt_tokens for r in ok),
        "output_tokens": output,
        "output_tok_s": output / seconds if seconds else 0.0,
        "ttft_p50_ms": ttft_p50,
        "ttft_p90_ms": ttft_p90,
        "latency_p50_ms": lat_p50,
        "latency_p90_ms": lat_p90,
        "ttft_slo_s": ttft_slo,
        "slo_attainment": sum(t <= ttft_slo for t in ttfts) / len(records) if records else None,
        # Of the prompt tokens, those found in either tier; those found on the device, and
        # those copied back from host memory (the engines' host tier).
        "hit_rate": sum(hits) / queries if queries else None,
        "prefix_cache_hit_rate": hits[0] / queries if queries else None,
        "host_cache_hit_rate": hits[1] / queries if queries else None,
        "router": router,
        "replicas": replicas,  # [seconds, desired, ready, running]
        "peak_replicas": peak,
        "replica_seconds": round(replica_s, 1),
        "static_peak_replica_seconds": round(peak * seconds, 1),
        "scaling": scaling,
        "samples": [[round(r.start, 3), r.ttft, r.latency, r.error is None] for r in records],
    }


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------


def _latency_target(value: str) -> tuple[str, float, float]:
    metric, _, rest = value.partition(":")
    quantile, _, seconds = rest.partition(":")
    try:
        q, t = float(quantile), float(seconds)
    except ValueError:
        q = t = -1.0
    if metric not in ("ttft", "queueTime") or not 0 < q < 1 or t <= 0:
        raise argparse.ArgumentTypeError(
            f"METRIC:QUANTILE:SECONDS with METRIC ttft or queueTime, 0 < QUANTILE < 1, "
            f"SECONDS > 0: got {value!r}"
        )
    return metric, q, t


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    d = " (default: %(default)s)"
    p.add_argument(
        "--model",
        default="tiny",
        help="tiny (the tiny random model), default (SmolLM2), or an absolute path "
        "(a bench/models config with a tokenizer, for --load-format dummy)" + d,
    )
    p.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        help="an extra kvfleet-engine serve argument (spec.engine.extraArgs)",
    )
    p.add_argument(
        "--router-arg",
        action="append",
        default=[],
        help="an extra kvfleet-router argument, after the operator's (for comparisons such as "
        "--engine-load-interval=0)",
    )
    p.add_argument(
        "--router-replicas",
        default="1",
        help="router processes of each router policy's run, behind a client-side round robin "
        "(their Service); several, comma-separated (1,3), run each router policy once with "
        "each count, on the same requests" + d,
    )
    p.add_argument(
        "--gpus", default="", help="comma-separated GPU ids, one per replica; none: CPU engines"
    )
    p.add_argument(
        "--max-num-seqs",
        type=int,
        help="spec.engine.maxNumSeqs; not given: the engines run at their own default, as in "
        "production",
    )
    p.add_argument("--max-model-len", type=int, default=0, help="0: the model's")
    p.add_argument(
        "--shutdown-timeout", type=int, default=30, help="seconds an engine drains on SIGTERM" + d
    )
    p.add_argument("--min-replicas", type=int, default=1)
    p.add_argument("--max-replicas", type=int, default=1)
    p.add_argument("--target-queue-depth", type=float, default=4.0)
    p.add_argument(
        "--scale-down-window", type=int, default=300, help="scaleDownStabilizationSeconds" + d
    )
    p.add_argument(
        "--scale-to-zero-delay",
        type=int,
        default=600,
        help="scaleToZeroDelaySeconds: idle seconds before --min-replicas 0 scales to zero" + d,
    )
    p.add_argument(
        "--latency-target",
        type=_latency_target,
        help="METRIC:QUANTILE:SECONDS, e.g. ttft:0.9:0.5: spec.autoscaling.latencyTarget",
    )
    p.add_argument(
        "--no-scale-ahead",
        action="store_true",
        help="spec.autoscaling.scaleAhead false: no scale-up ahead of the trend by the learned "
        "engine start time (for comparisons)",
    )
    p.add_argument("--autoscale-interval", type=float, default=2.0, help="the operator's" + d)
    p.add_argument("--prefix-length", type=int, default=256, help="the router's" + d)
    p.add_argument("--load-factor", type=float, default=1.25, help="the router's" + d)
    p.add_argument(
        "--scenario",
        choices=SCENARIOS,
        default="workload",
        help="workload: the --phases load under each policy; scale-from-zero: one request at a "
        "time to a service idle at zero (--min-replicas 0), --repeats times" + d,
    )
    p.add_argument(
        "--repeats", type=int, default=3, help="scale-from-zero trials, at zero before each" + d
    )
    p.add_argument(
        "--policies",
        default=",".join(POLICIES),
        help="comma-separated, of "
        f"{', '.join(POLICIES)}; run in this order, the same requests each" + d,
    )
    p.add_argument(
        "--phases",
        default="60x2",
        help="SECONDSxREQUESTS_PER_S,...: a fixed rate (60x2) or a ramp (30x1,60x8,30x1); "
        "several separated by ';' (60x8;60x16) are measured one after another" + d,
    )
    p.add_argument(
        "--workload",
        choices=WORKLOADS,
        default="chat",
        help="chat: multi-turn sessions over a few shared system prompts (the --turns ... "
        "--think-time flags); tenants: one-turn questions under many tenants' system prompts "
        "(the --tenant... and --question-words flags)" + d,
    )
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-prompts", type=int, default=4)
    p.add_argument("--system-words", type=int, default=1500, help="shared prefix" + d)
    p.add_argument("--user-words", type=int, default=60)
    p.add_argument("--reply-words", type=int, default=60, help="per assistant turn carried")
    p.add_argument(
        "--max-tokens",
        type=int,
        help="output tokens a request (default: "
        + ", ".join(f"{w} {n}" for w, n in MAX_TOKENS.items())
        + ")",
    )
    p.add_argument("--think-time", type=float, default=2.0, help="mean seconds between turns")
    p.add_argument("--tenants", type=int, default=128, help="tenants' system prompts" + d)
    p.add_argument(
        "--tenant-words",
        type=int,
        default=1000,
        help="words of each tenant's system prompt (1,000: about 2k tokens with the dummy "
        "Llama 3 tokenizer)" + d,
    )
    p.add_argument("--question-words", type=int, default=20, help="a tenant's question" + d)
    p.add_argument(
        "--tenant-popularity",
        choices=("zipf", "uniform"),
        default="zipf",
        help="how a request's tenant is drawn" + d,
    )
    p.add_argument(
        "--tenant-zipf", type=float, default=1.0, help="Zipf exponent of the popularity" + d
    )
    p.add_argument(
        "--ttft-slo",
        type=float,
        default=1.0,
        help="seconds: attainment, and the p90 TTFT at which a sweep reads each policy's rate",
    )
    p.add_argument(
        "--settle",
        type=float,
        default=60.0,
        help="seconds to wait after a run for a scale-down to finish" + d,
    )
    p.add_argument(
        "--start-timeout",
        type=float,
        default=600.0,
        help="seconds for the first engines to become ready" + d,
    )
    p.add_argument(
        "--adapters", type=int, default=0, help="LoRA adapters in spec.adapters (0: none)" + d
    )
    p.add_argument(
        "--adapter-zipf", type=float, default=1.0, help="Zipf exponent of their popularity" + d
    )
    p.add_argument("--adapter-rank", type=int, default=16, help="their rank (maxLoraRank)" + d)
    p.add_argument("--max-loras", type=int, default=4, help="spec.engine.maxLoras" + d)
    p.add_argument("--max-cpu-loras", type=int, default=16, help="spec.engine.maxCpuLoras" + d)
    p.add_argument(
        "--cpu-kv-cache",
        help="spec.engine.cpuKvCacheBytes, the engines' host KV tier: a quantity, 0 for none "
        "(default: the operator sizes it from the memory request)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-dir", type=Path, help="keep the processes' logs here (default: temp)")
    p.add_argument("--result-json", type=Path)
    ns = p.parse_args(argv)
    try:
        ns.phases = [parse_phases(spec) for spec in ns.phases.split(";") if spec.strip()]
    except ValueError as e:
        p.error(str(e))
    if not ns.phases:
        p.error("--phases names no load")
    ns.policies = [x.strip() for x in ns.policies.split(",") if x.strip()]
    if bad := [x for x in ns.policies if x not in POLICIES]:
        p.error(f"unknown policies {bad}: choose from {', '.join(POLICIES)}")
    if "precise" in ns.policies and ns.model == "default":
        p.error("precise scoring needs the model's tokenizer in the router: --model tiny or a path")
    try:
        ns.router_replicas = [int(x) for x in ns.router_replicas.split(",")]
    except ValueError:
        ns.router_replicas = []
    replicas = ns.router_replicas
    if not replicas or len(set(replicas)) < len(replicas):
        p.error(f"--router-replicas is a list of distinct counts, e.g. 1,3, got {replicas}")
    if not all(1 <= n <= MAX_ROUTER_REPLICAS for n in replicas):
        p.error(f"--router-replicas counts are 1 to {MAX_ROUTER_REPLICAS}")
    if ns.workload == "tenants" and (ns.adapters or ns.tenants < 1):
        p.error("--workload tenants takes --tenants >= 1 and no --adapters")
    if ns.max_tokens is None:
        ns.max_tokens = MAX_TOKENS[ns.workload]
    if not 0 <= ns.min_replicas <= ns.max_replicas or ns.max_replicas < 1:
        p.error("need 0 <= --min-replicas <= --max-replicas and --max-replicas >= 1")
    if ns.scenario == "scale-from-zero" and (ns.min_replicas != 0 or ns.repeats < 1):
        p.error("--scenario scale-from-zero needs --min-replicas 0 and --repeats >= 1")
    gpus = [g for g in ns.gpus.split(",") if g.strip()]
    if gpus and len(gpus) < ns.max_replicas:
        p.error(f"--max-replicas {ns.max_replicas} needs as many --gpus, got {len(gpus)}")
    if ns.model not in ("tiny", "default") and not Path(ns.model).is_absolute():
        p.error(f"--model is tiny, default or an absolute path, got {ns.model!r}")
    if ns.adapters and ns.model == "default":
        p.error("--adapters needs a model folder with a config.json: tiny or a path")
    if not 0 <= ns.adapters <= 128 or ns.adapter_zipf < 0:
        p.error("--adapters is 0 to 128 (spec.adapters' bound), --adapter-zipf >= 0")
    return ns


def print_table(runs: list[dict[str, Any]]) -> None:
    def f(x: float | None, fmt: str = ".0f") -> str:
        return "" if x is None else format(x, fmt)

    print(
        "| load | policy | requests | failed | output tok/s | TTFT p50 ms | TTFT p90 ms "
        "| latency p90 ms | hit rate | spilled | retries | peak replicas | replica-s "
        "| static at peak |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in runs:
        router = r["router"] or {}
        print(f"| {r['load']} | {series_name(r)} | {r['requests']} | {r['failed']} "
              f"| {f(r['output_tok_s'])} "
              f"| {f(r['ttft_p50_ms'])} | {f(r['ttft_p90_ms'])} | {f(r['latency_p90_ms'])} "
              f"| {f(hit_rate(r), '.1%')} | {router.get('spilled', '')} "
              f"| {router.get('retries', '')} | {r['peak_replicas']} | {r['replica_seconds']} "
              f"| {r['static_peak_replica_seconds']} |")  # fmt: skip
    for r in runs:
        if r.get("host_cache_hit_rate"):
            print(f"{r['policy']}: hit rate {f(hit_rate(r), '.1%')}: "
                  f"{f(r['prefix_cache_hit_rate'], '.1%')} of prompt tokens found on the device, "
                  f"{r['host_cache_hit_rate']:.1%} copied back from the engines' host KV "
                  "tier")  # fmt: skip
    for r in runs:
        if "adapter_loads" in r:
            print(f"{r['policy']}: {r['adapter_loads']} adapter loads into GPU slots, "
                  f"{r['adapter_loads_per_min']:.1f} a minute")  # fmt: skip
    if any(len(r["phases"]) > 1 for r in runs):
        print("| load | policy | phase | requests | failed | TTFT p50 ms | TTFT p90 ms "
              "| TTFT within SLO |")  # fmt: skip
        print("|---|---|---|---|---|---|---|---|")
        for r in runs:
            for ph in r["phases"]:
                print(f"| {r['load']} | {r['policy']} | {ph['phase']} | {ph['requests']} "
                      f"| {ph['failed']} | {f(ph['ttft_p50_ms'])} | {f(ph['ttft_p90_ms'])} "
                      f"| {f(ph['slo_attainment'], '.1%')} |")  # fmt: skip
    for r in runs:
        for event in r["scaling"]:
            print(f"{r['policy']}: {json.dumps(event)}")
        for d in r.get("decisions", []):
            print(f"{r['policy']}: decision at {d['at_s']} s: {json.dumps(d['decision'])}")


def make(ns: argparse.Namespace, phases: list[Phase], adapters: list[str]) -> Workload:
    """The requests of one load, the same for every policy."""
    if ns.workload == "tenants":
        return make_tenant_workload(
            phases, tenants=ns.tenants, system_words=ns.tenant_words,
            question_words=ns.question_words, max_tokens=ns.max_tokens,
            popularity=ns.tenant_popularity, zipf=ns.tenant_zipf, seed=ns.seed,
        )  # fmt: skip
    return make_workload(
        phases, turns=ns.turns, systems=ns.system_prompts, system_words=ns.system_words,
        user_words=ns.user_words, reply_words=ns.reply_words, think_s=ns.think_time,
        max_tokens=ns.max_tokens, seed=ns.seed, adapters=adapters, zipf=ns.adapter_zipf,
    )  # fmt: skip


def print_capacities(found: list[Capacity], runs: list[dict[str, Any]], slo_s: float) -> None:
    """The rate each policy serves at the SLO, against round robin's and approximate
    scoring's, with its hit rate over the sweep."""
    by_policy = {c.policy: c for c in found}

    def ratio(c: Capacity, base: str) -> str:
        other = by_policy.get(base)
        if c.policy == base or other is None or c.rate is None or not other.rate:
            return ""
        exact = c.crossed and other.crossed
        return f"{c.rate / other.rate:.2f}x" + ("" if exact else " (a bound)")

    print(f"\nRate at the TTFT SLO (p90 <= {slo_s:g} s, failed requests counted as over it):")
    print("| policy | rates swept | rate at SLO req/s | vs round-robin | vs prefix | hit rate "
          "| spilled | failed |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for c in found:
        mine = [r for r in runs if series_name(r) == c.policy]
        hits = [h for h in map(hit_rate, mine) if h is not None]
        spilled = sum((r["router"] or {}).get("spilled", 0) for r in mine)
        print(f"| {c.policy} | {', '.join(f'{x:g}' for x in c.swept)} | {c.describe()} "
              f"| {ratio(c, 'round-robin')} | {ratio(c, 'prefix')} "
              f"| {min(hits, default=0):.1%} - {max(hits, default=0):.1%} "
              f"| {spilled if any(r['router'] for r in mine) else ''} "
              f"| {sum(r['failed'] for r in mine)} |")  # fmt: skip


async def measure(ns: argparse.Namespace, work: Path) -> dict[str, Any]:
    adapters = write_adapters(ns, work) if ns.adapters else {}
    workloads = [make(ns, phases, list(adapters)) for phases in ns.phases]
    header = {
        "date": time.strftime("%Y-%m-%d"),
        "device": device_name() if ns.gpus else "CPU",
        "commit": git_commit(),
        "args": {k: str(v) for k, v in vars(ns).items() if k != "phases"},
        "phases": [[asdict(p) for p in phases] for phases in ns.phases],
    }
    async with fleet(ns, work, adapters) as f:
        if ns.scenario == "scale-from-zero":
            async with f.routers("prefix", 1, ns) as (router,):
                return {**header, **await measure_from_zero(f, ns, router)}
        runs = []
        for j, (phases, workload) in enumerate(zip(ns.phases, workloads, strict=True)):
            load = ",".join(f"{p.seconds:g}x{p.rate:g}" for p in phases)
            for i, policy in enumerate(ns.policies):
                for n in [0] if policy == "round-robin" else ns.router_replicas:
                    # A tag per run: no run may hit the blocks an earlier one left.
                    tag = f"run{j}.{i}.{n}-{ns.seed}"
                    run = await run_policy(f, policy, n, workload, tag, ns)
                    logger.info("%s at %s: %d requests, %d failed",
                                series_name(run), load, run["requests"], run["failed"])  # fmt: skip
                    runs.append({"load": load, "sessions": len(workload.sessions), **run})
        if f.runner.failures:
            raise RuntimeError("; ".join(f.runner.failures))
    return {**header, "runs": runs, "capacity": [asdict(c) for c in capacities(runs, ns.ttft_slo)]}


def main(argv: Sequence[str] | None = None) -> int:
    ns = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    # The emulator's access log: a line per API request.
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    with tempfile.TemporaryDirectory() as tmp:
        work = ns.log_dir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        report = asyncio.run(measure(ns, work))
    if ns.scenario == "scale-from-zero":
        print_from_zero(report)
    else:
        print_table(report["runs"])
        print_capacities([Capacity(**c) for c in report["capacity"]], report["runs"], ns.ttft_slo)
    if ns.result_json:
        ns.result_json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
