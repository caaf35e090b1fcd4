"""The scale-from-zero scenario: a service of minReplicas 0 idle at zero engines; one request
through the router, which holds it while no engine is ready; the operator scales from zero on
the routers' held requests; the request is answered. Repeated, the service idling back to zero
between trials.

The time from the request's arrival to its first token is split where each component hands over:

* decision: arrival -> the operator's decision written (status.desiredReplicas 0 -> 1), which
  waits for its next interval's scrape of the routers' held requests;
* reconcile: decision -> the engine Deployment's replicas 0 -> 1 (the reconciler);
* pod start: Deployment -> the engine process started (here a local process: a cluster adds
  scheduling and the image pull);
* engine start: process started -> its readiness path answers (imports, weights, memory
  profile, graph capture);
* probe: -> the kubelet's startup probe, ticking at its period, finds it up (the pod Ready);
* first token: Ready -> the first token (the router sees the EndpointSlice, forwards the held
  request, the engine prefills).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import aiohttp
from fleet.pods import PodRunner
from fleet.workload import VOCABULARY, Record, chat

POLL_S = 0.05
# The phases of the split, in order: each is the time from the previous hand-over to its own.
PHASES = ("decision", "reconcile", "pod_start", "engine_start", "probe", "first_token")


class Fleet(Protocol):
    """What the scenario uses of the harness's fleet (run.Fleet)."""

    runner: PodRunner
    model: str

    def status(self) -> dict[str, Any]: ...

    async def router_counters(self, routers: Sequence[str]) -> dict[str, float]: ...


@dataclass(frozen=True)
class Trial:
    """One request from zero: the split in seconds (PHASES), and what decided the scale."""

    decision: float
    reconcile: float
    pod_start: float
    engine_start: float
    probe: float
    first_token: float
    total: float  # arrival -> first token: the request's TTFT
    signal: str
    reason: str


def split(
    arrival: float,
    decided: float,
    scaled: float,
    started: float,
    up: float,
    ready: float,
    first_token: float,
    decision: dict[str, Any],
) -> Trial:
    """A trial from the monotonic times of its hand-overs and status.lastScaleDecision. A time
    out of order is a broken measurement, not a phase of negative length."""
    times = (arrival, decided, scaled, started, up, ready, first_token)
    if any(b < a for a, b in itertools.pairwise(times)):
        raise ValueError(f"hand-overs out of order: {times}")
    spans = [round(b - a, 3) for a, b in itertools.pairwise(times)]
    return Trial(
        *spans,
        total=round(first_token - arrival, 3),
        signal=str(decision.get("signal", "")),
        reason=str(decision.get("reason", "")),
    )


async def at_zero(runner: PodRunner, timeout: float) -> None:
    """Until the Deployment asks for no engine and every engine process has exited."""
    deadline = time.monotonic() + timeout
    while runner.desired != 0 or runner.running():
        if runner.failures:
            raise RuntimeError(runner.failures[0])
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"not at zero within {timeout:g}s: {runner.desired} replicas asked, "
                f"{runner.running()} engines running"
            )
        await asyncio.sleep(POLL_S)


async def first_request(
    f: Fleet, router: str, ns: argparse.Namespace, tag: str, timeout: float
) -> tuple[Trial | None, Record]:
    """One streamed chat completion through the router (its URL) of a fleet at zero, and its
    split (None when the request failed)."""
    decided: list[float] = []

    async def watch_decision() -> None:
        while not (f.status().get("desiredReplicas") or 0):
            await asyncio.sleep(POLL_S)
        decided.append(time.monotonic())

    watcher = asyncio.create_task(watch_decision())
    words = " ".join(VOCABULARY[i % len(VOCABULARY)] for i in range(ns.user_words))
    body = {"model": f.model, "messages": [{"role": "user", "content": f"[{tag}] {words}"}],
            "max_tokens": ns.max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    record = Record(0, 0, 0.0)
    arrival = time.monotonic()
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as http:
            await chat(http, router, {}, body, record)
    except (aiohttp.ClientError, TimeoutError, RuntimeError, ValueError) as e:
        record.error = f"{type(e).__name__}: {e}"
    finally:
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
    if record.error is not None or record.ttft is None or not decided:
        return None, record
    runner = f.runner
    scaled = next(
        e.t for e in runner.events if e.what == "replicas" and e.t >= arrival
    )  # the runner's "replicas" event: the Deployment's count as the reconciler wrote it
    pod = next(runner.pods[e.pod] for e in runner.events if e.what == "created" and e.t >= arrival)
    # It answered the request: started, up and Ready.
    assert pod.started is not None and pod.up is not None and pod.ready is not None
    first_token = arrival + record.ttft
    trial = split(arrival, decided[0], scaled, pod.started, pod.up, pod.ready, first_token,
                  f.status().get("lastScaleDecision") or {})  # fmt: skip
    return trial, record


async def measure(f: Fleet, ns: argparse.Namespace, router: str) -> dict[str, Any]:
    """``ns.repeats`` trials from zero on the fleet ``f`` through ``router`` (its URL), and
    whether anything failed on the way."""
    # Idle for the scale-to-zero delay and the scale-down window, then the operator's interval,
    # the preStop sleep and the drain: generously bounded.
    to_zero_s = ns.scale_to_zero_delay + ns.scale_down_window + 4 * ns.autoscale_interval + 120
    r0 = await f.router_counters([router])
    trials: list[dict[str, Any]] = []
    failed: list[str] = []
    for i in range(ns.repeats):
        await at_zero(f.runner, to_zero_s)
        trial, record = await first_request(f, router, ns, f"zero{i}-{ns.seed}", ns.start_timeout)
        if trial is None:
            failed.append(record.error or "no scale decision seen")
            continue
        if record.output_tokens != ns.max_tokens:
            failed.append(f"{record.output_tokens} tokens, not {ns.max_tokens}")
        trials.append(asdict(trial))
    r1 = await f.router_counters([router])
    failed += f.runner.failures  # engines that exited on their own
    return {
        "scenario": "scale-from-zero",
        "trials": trials,
        "failed": failed,
        "router": {k: int(r1[k] - r0[k]) for k in r0},
        "median": {k: round(statistics.median(t[k] for t in trials), 3) for k in (*PHASES, "total")}
        if trials
        else {},
    }


def print_table(result: dict[str, Any]) -> None:
    print("| trial | decision s | reconcile s | pod start s | engine start s | startup probe s "
          "| Ready to first token s | first token s | signal |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    rows = [(str(i + 1), t) for i, t in enumerate(result["trials"])]
    if result["median"]:
        rows.append(("median", {**result["median"], "signal": ""}))
    for name, t in rows:
        cells = " | ".join(f"{t[k]:.2f}" for k in (*PHASES, "total"))
        print(f"| {name} | {cells} | {t['signal']} |")
    print(f"failed: {len(result['failed'])} {result['failed']}; router: {result['router']}")
