"""The autoscaler's forecast judged on shaped loads: the operator's own decision
(kvfleet.operator.scaling_policy.decide, with the policy a spec gives through
autoscaler.policy_of) driven over simulated time by a fake clock, with and without
``scaleAhead``, on a sawtooth, a step, stairs, a ramp, a spike and noise. Pure and fast: no
cluster, no engines, 90 decisions a run::

    python bench/forecast_loads.py                 # the table in docs/autoscaling.md
    python bench/forecast_loads.py --start-seconds 300 --result-json loads.json

The model. A load is the requests in flight the service holds at each second. Every 10 s (the
operator's default --autoscale-interval) the decision sees each ready replica holding an equal
share of them (with a KV-cache usage of 0, so queue depth and the forecast decide), and the
replicas asked for but not ready yet as starting; a replica asked for is ready one start time
after the decision that asked for it (the start time the operator would have learned, passed as
learned), and a scale-down removes replicas still starting first, as a ReplicaSet does. The
service starts with one ready replica. Each second counts:

* replica-seconds: the replicas asked for, starting ones included (a starting GPU is paid for);
* SLO misses: the seconds in which the requests in flight per ready replica exceed
  ``targetQueueDepth``, the load the service promised each replica at most;
* and when enough replicas for the load's peak were first ready.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from kvfleet.operator.autoscaler import policy_of
from kvfleet.operator.scaling_policy import (
    Observation,
    PodMetrics,
    ScalingMemory,
    ScalingPolicy,
    decide,
)
from kvfleet.operator.spec import parse_spec

# The operator's default step (--autoscale-interval) and the accounting's resolution.
INTERVAL_S = 10.0
TICK_S = 1.0
# Engine start times judged: the dummy-weight engine's 15-20 s on an H100 (bench/RESULTS.md), and
# one and two minutes, as a real checkpoint's read adds.
START_SECONDS = (20.0, 60.0, 120.0)
# Long enough for several cycles of the sawtooth and for the scale-down window (300 s) to close
# after the spike.
DURATION_S = 900.0
# The service the loads are shaped for: the spec's defaults but for the replica bounds, so that
# the peaks (3 replicas' worth) fit with room to overshoot.
TARGET = 4.0
MAX_REPLICAS = 8


@dataclass(frozen=True)
class Load:
    name: str
    shape: str  # in words, for the table's legend
    in_flight: Callable[[float], float]  # requests in flight at t seconds from the start


@dataclass(frozen=True)
class Run:
    load: str
    scale_ahead: bool
    replica_seconds: float
    slo_miss_seconds: float
    peak_replicas: int
    # When enough replicas for the load's peak were first ready (None: never).
    peak_ready_s: float | None
    replicas: tuple[int, ...]  # asked for, each tick


def sawtooth(low: float, high: float, period: float, rise: float) -> Callable[[float], float]:
    """Rises linearly from low to high over `rise` seconds, holds low for the rest of `period`."""

    def load(t: float) -> float:
        phase = t % period
        return low + (high - low) * phase / rise if phase < rise else low

    return load


def step(low: float, high: float, at: float) -> Callable[[float], float]:
    return lambda t: low if t < at else high


def stairs(
    low: float, high: float, start: float, steps: int, every: float
) -> Callable[[float], float]:
    """From low to high in `steps` equal steps, one every `every` seconds from `start`."""

    def load(t: float) -> float:
        done = 0 if t < start else min(int((t - start) // every) + 1, steps)
        return low + (high - low) * done / steps

    return load


def ramp(low: float, high: float, start: float, seconds: float) -> Callable[[float], float]:
    return lambda t: low + (high - low) * min(max(t - start, 0.0), seconds) / seconds


def spike(low: float, high: float, at: float, rise: float, fall: float) -> Callable[[float], float]:
    """Up linearly over `rise` seconds from `at`, back down over `fall`, then low again."""

    def load(t: float) -> float:
        if at <= t < at + rise:
            return low + (high - low) * (t - at) / rise
        if at + rise <= t < at + rise + fall:
            return high - (high - low) * (t - at - rise) / fall
        return low

    return load


def noise(mean: float, spread: float, hold: float, seed: int) -> Callable[[float], float]:
    """A new uniform draw in mean +- spread every `hold` seconds, the same for every run."""
    draws = random.Random(seed)
    levels: list[float] = []

    def load(t: float) -> float:
        i = int(t // hold)
        while len(levels) <= i:
            levels.append(max(0.0, draws.uniform(mean - spread, mean + spread)))
        return levels[i]

    return load


def loads(target: float = TARGET) -> list[Load]:
    """The shapes, in units of the per-replica target: from 1 replica's worth (0.8 targets) to
    3 replicas' worth at most (2.8 targets, inside the 10 % tolerance of 3)."""
    low, high = 0.8 * target, 2.8 * target
    return [
        Load(
            "sawtooth",
            "from 1 to 3 replicas' worth over 90 s, back at once, every 150 s",
            sawtooth(low, high, 150.0, 90.0),
        ),
        Load(
            "step",
            "from 1 to 3 replicas' worth at once at 120 s, then level",
            step(low, high, 120.0),
        ),
        Load(
            "stairs",
            "from 1 to 3 replicas' worth in 4 steps 60 s apart from 120 s, then level",
            stairs(low, high, 120.0, 4, 60.0),
        ),
        Load(
            "ramp",
            "from 1 to 3 replicas' worth over 300 s from 120 s, then level",
            ramp(low, high, 120.0, 300.0),
        ),
        Load(
            "spike",
            "from 1 to 3 replicas' worth over 40 s at 120 s, back over 20 s",
            spike(low, high, 120.0, 40.0, 20.0),
        ),
        Load(
            "noise",
            "uniform between 1 and 3 replicas' worth, a new draw every 10 s",
            noise((low + high) / 2, (high - low) / 2, 10.0, seed=36),
        ),
    ]


def service_policy(scale_ahead: bool, target: float = TARGET) -> ScalingPolicy:
    """The policy the operator derives from a spec with these settings (and defaults else)."""
    autoscaling = {
        "minReplicas": 1,
        "maxReplicas": MAX_REPLICAS,
        "targetQueueDepth": target,
        "scaleAhead": scale_ahead,
    }
    return policy_of(parse_spec("llm", {"autoscaling": autoscaling}).autoscaling)


def simulate(
    load: Load,
    policy: ScalingPolicy,
    start_s: float,
    interval_s: float = INTERVAL_S,
    duration_s: float = DURATION_S,
) -> Run:
    """The service under `load` for `duration_s` seconds from one ready replica (see the
    module's doc for the model)."""
    ready_at = [0.0]  # when each replica asked for is (or was) ready
    memory = ScalingMemory()
    replica_seconds = miss = 0.0
    trace: list[int] = []
    ticks = [i * TICK_S for i in range(int(duration_s / TICK_S))]
    need = math.ceil(max(map(load.in_flight, ticks)) / policy.target_queue_depth)
    at_need: float | None = None
    next_decision = interval_s
    for t in ticks:
        in_flight = load.in_flight(t)
        ready = sum(1 for r in ready_at if r <= t)
        if t >= next_decision:
            next_decision += interval_s
            seen = Observation(
                len(ready_at),
                [PodMetrics(f"p{j}", in_flight / ready, 0.0, 0.0) for j in range(ready)],
                starting=len(ready_at) - ready,
                start_seconds=start_s,
            )
            d = decide(policy, seen, memory, t)
            memory = d.memory
            if d.replicas > len(ready_at):
                ready_at += [t + start_s] * (d.replicas - len(ready_at))
            else:
                # A ReplicaSet removes the replicas not ready yet first, the newest of them.
                ready_at = sorted(ready_at)[: d.replicas]
        replica_seconds += len(ready_at) * TICK_S
        if ready == 0 or in_flight / ready > policy.target_queue_depth:
            miss += TICK_S
        trace.append(len(ready_at))
        if at_need is None and ready >= need:
            at_need = t
    return Run(
        load.name,
        policy.scale_ahead,
        replica_seconds,
        miss,
        max(trace),
        at_need,
        tuple(trace),
    )


def compare(start_s: float, duration_s: float = DURATION_S) -> list[tuple[Run, Run]]:
    """Each load without and with the forecast."""
    pairs = []
    for load in loads():
        plain, ahead = (
            simulate(load, service_policy(on), start_s=start_s, duration_s=duration_s)
            for on in (False, True)
        )
        pairs.append((plain, ahead))
    return pairs


def table(results: Sequence[tuple[float, Sequence[tuple[Run, Run]]]]) -> str:
    """A Markdown table: per start time and load, each figure without / with the forecast."""

    def when(r: Run) -> str:
        return "never" if r.peak_ready_s is None else f"{r.peak_ready_s:.0f}"

    rows = [
        "| start s | load | replica-seconds | SLO miss s | peak replicas | peak capacity at s |",
        "|---|---|---|---|---|---|",
    ]
    for start_s, pairs in results:
        for plain, ahead in pairs:
            rows.append(
                f"| {start_s:g} | {plain.load} "
                f"| {plain.replica_seconds:,.0f} / {ahead.replica_seconds:,.0f} "
                f"| {plain.slo_miss_seconds:.0f} / {ahead.slo_miss_seconds:.0f} "
                f"| {plain.peak_replicas} / {ahead.peak_replicas} | {when(plain)} / {when(ahead)} |"
            )
    legend = [f"* {load.name}: {load.shape}" for load in loads()]
    return "\n".join([*rows, "", *legend])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument(
        "--start-seconds",
        type=float,
        nargs="+",
        default=list(START_SECONDS),
        help="the engines' start times to judge at (default: %(default)s)",
    )
    parser.add_argument("--duration", type=float, default=DURATION_S)
    parser.add_argument("--result-json", type=Path)
    args = parser.parse_args(argv)
    results = [(start, compare(start, args.duration)) for start in args.start_seconds]
    print(table(results))
    if args.result_json:
        runs = [
            {"start_seconds": start} | {k: v for k, v in asdict(r).items() if k != "replicas"}
            for start, pairs in results
            for pair in pairs
            for r in pair
        ]
        args.result_json.write_text(json.dumps(runs, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
