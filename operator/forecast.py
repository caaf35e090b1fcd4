"""Scaling ahead of a rising load by the time an engine takes to start. Pure: the autoscaler
feeds it the pods it lists and the load it computes, and keeps what it returns.

The start time is learned from the engine pods themselves (creation to first Ready: what the
next replica pays too). A least-squares trend of the load projects one start time ahead only
when the rise is worth believing, and never further above the top of the load's own cycle than
the load already is: a sawtooth or a spike climbs like a ramp for a while, and replicas brought
forward for it would go unused. The forecast only ever brings a scale-up forward, never a
scale-down. docs/autoscaling.md#scaling-ahead-by-the-engine-start-time gives the rules and
their thresholds.
"""

from __future__ import annotations

import datetime
import math
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

# Engine starts kept for the estimate.
START_SAMPLES = 5
# A start longer than this is capped: the estimate is a forecast horizon, and a line fitted over a
# minute says little about the load half an hour on.
MAX_START_S = 1800.0
# The load history the trend is fitted to, and what makes it worth projecting.
WINDOW_S = 60.0
MIN_SAMPLES = 4
MIN_SPAN_S = 15.0
MIN_R2 = 0.6
# How far back the tops of the load's cycle are looked for: twice the default scale-down window
# (300 s), so the cycles whose peaks that window holds replicas for, and some longer, are known
# as cycles. The rise of a longer cycle is treated as a new trend.
CYCLE_S = 600.0
# A fall from a level marks the top of a cycle when it is larger than this many standard
# deviations of the window's load about its trend line: the noise of a steady ramp seldom falls
# that far below an earlier sample, a sawtooth's drop or a spike's end does.
REVERSAL_SDS = 3.0
# A sample this close after the one before replaces it: the memory is at most CYCLE_S / this
# many samples a service whatever the decision interval, and repeated decisions at one time
# (a clock that did not move) weigh as one.
MIN_SAMPLE_GAP_S = 1.0


@dataclass(frozen=True)
class Sample:
    time: float  # unix seconds
    value: float


@dataclass(frozen=True)
class EngineStart:
    ready: float  # unix seconds of the pod's first Ready
    seconds: float  # from its creation to then


@dataclass(frozen=True)
class Projection:
    slope: float  # load units per second
    horizon: float  # seconds ahead
    value: float  # the load now
    projected: float  # the load one horizon ahead
    top: float | None = None  # the top of the load's cycle, when it limited the projection


def epoch(value: str) -> float:
    """Unix seconds of an RFC 3339 time, as the API server writes them."""
    return datetime.datetime.fromisoformat(value).timestamp()


def pod_start(pod: Mapping[str, Any]) -> EngineStart | None:
    """How long a Ready pod took from creation to Ready, capped; None for a pod that is not
    Ready, whose containers restarted, or whose times are missing or inconsistent."""
    status = pod.get("status") or {}
    created = (pod.get("metadata") or {}).get("creationTimestamp")
    ready = next(
        (
            c.get("lastTransitionTime")
            for c in status.get("conditions") or []
            if c.get("type") == "Ready" and c.get("status") == "True"
        ),
        None,
    )
    if not created or not ready:
        return None
    if any((c.get("restartCount") or 0) > 0 for c in status.get("containerStatuses") or []):
        return None
    try:
        created_at, ready_at = epoch(created), epoch(ready)
    except (TypeError, ValueError):
        return None
    if not created_at <= ready_at < math.inf:
        return None  # clock skew between the nodes and the API server
    return EngineStart(ready_at, min(ready_at - created_at, MAX_START_S))


def learn(
    starts: tuple[EngineStart, ...], pods: Iterable[Mapping[str, Any]], seen: frozenset[str] | None
) -> tuple[tuple[EngineStart, ...], frozenset[str]]:
    """``starts`` with the first Ready of each engine pod not counted yet, the last
    START_SAMPLES kept; and the uids of the pods seen Ready so far that still exist, to pass as
    ``seen`` next time. A pod seen Ready before does not count again (a Ready after a spell
    unready is no start). ``seen`` None: this process has not looked yet (it just started), so
    only pods Ready after the newest start counted count, which keeps a restart from counting
    the same pods twice."""
    newest = max((s.ready for s in starts), default=-math.inf) if seen is None else -math.inf
    seen = seen or frozenset()
    existing, ready, new = set(), set(), []
    for pod in pods:
        uid = (pod.get("metadata") or {}).get("uid") or ""
        existing.add(uid)
        if (start := pod_start(pod)) is None or uid in seen:
            continue
        ready.add(uid)
        if start.ready > newest:
            new.append(start)
    new.sort(key=lambda s: s.ready)
    return (*starts, *new)[-START_SAMPLES:], frozenset((seen & existing) | ready)


def start_estimate(starts: tuple[EngineStart, ...]) -> float | None:
    """The service's engine start time in seconds: the median of its recent starts."""
    return statistics.median(s.seconds for s in starts) if starts else None


def recent(samples: Iterable[Sample], now: float) -> tuple[Sample, ...]:
    """The samples to keep: those of the last CYCLE_S seconds."""
    return tuple(s for s in samples if 0 <= now - s.time <= CYCLE_S)


def remember(samples: tuple[Sample, ...], sample: Sample) -> tuple[Sample, ...]:
    """``samples`` (in time order) with ``sample`` added as the newest, replacing the newest one
    kept when it is less than MIN_SAMPLE_GAP_S older, and those older than CYCLE_S dropped."""
    if samples and sample.time - samples[-1].time < MIN_SAMPLE_GAP_S:
        samples = samples[:-1]
    return recent((*samples, sample), sample.time)


def cycle_top(samples: tuple[Sample, ...], fall: float) -> float | None:
    """The highest level among ``samples`` (in time order) that a later one fell from by more
    than ``fall``; None if the load never fell that far."""
    top, lowest_after = None, math.inf
    for s in reversed(samples):
        if s.value - lowest_after > fall:
            top = s.value if top is None else max(top, s.value)
        lowest_after = min(lowest_after, s.value)
    return top


def projection(
    samples: tuple[Sample, ...], now: float, horizon: float, max_rise: float
) -> Projection | None:
    """The load ``horizon`` seconds after now by the trend of the window's samples, the rise
    capped at ``max_rise`` and by the top of the load's cycle. The last sample is the load now.

    None unless the rise is worth believing: MIN_SAMPLES over MIN_SPAN_S, a rising line that
    explains MIN_R2 of the variance, and a load now above all it was until MIN_SPAN_S ago (a
    step that levelled off still fits a rising line for a while). The cycle's top is a level the
    load fell from by more than its noise about the line (``cycle_top``): below it nothing is
    projected, past it no further above it than the load already is, until the load is one
    horizon's rise beyond it."""
    memory = recent(samples, now)
    window = tuple(s for s in memory if now - s.time <= WINDOW_S)
    if len(window) < MIN_SAMPLES or not 0 < horizon < math.inf or not max_rise > 0:
        return None
    times = [s.time for s in window]
    values = [s.value for s in window]
    if max(times) - min(times) < MIN_SPAN_S:
        return None
    mean_t, mean_v = statistics.fmean(times), statistics.fmean(values)
    stt = sum((t - mean_t) ** 2 for t in times)
    svv = sum((v - mean_v) ** 2 for v in values)
    stv = sum((t - mean_t) * (v - mean_v) for t, v in zip(times, values, strict=True))
    if stt <= 0 or svv <= 0:
        return None
    slope = stv / stt
    if not (slope > 0 and stv * stv / (stt * svv) >= MIN_R2):
        return None
    value = window[-1].value
    if not value > max(s.value for s in window if now - s.time >= MIN_SPAN_S):
        return None  # levelled off or fell back: no longer rising
    rise = min(slope * horizon, max_rise)
    # The scatter about the line: what the residuals' sum of squares leaves per degree of
    # freedom (two went into the line).
    spread = math.sqrt(max(0.0, svv - stv * stv / stt) / (len(window) - 2))
    top = cycle_top(memory, REVERSAL_SDS * spread)
    if top is None or value - top >= rise:
        return Projection(slope, horizon, value, value + rise)
    if value <= top:
        return None
    return Projection(slope, horizon, value, value + (value - top), top)
