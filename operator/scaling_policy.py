"""The scale decision: a pure function of the service's policy, what a step saw of it and what
the previous decisions remembered, at a given time. No I/O, so every rule is testable with a fake
clock.

It follows HPA where HPA has an answer (metric over target with a tolerance, the largest signal
wins, stabilization windows, a bounded step, unready pods counted as idle) and adds what HPA
lacks: a latency target, scaling from and to zero on the routers' held requests, and scaling
ahead of a rise by the engines' learned start time (forecast.py). docs/autoscaling.md states
every rule a user sees.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvfleet.operator.forecast import Projection, Sample, projection, recent, remember
from kvfleet.operator.latency import Buckets

# Requests one engine or router can hold: far beyond any real batch or queue, so a larger count is
# a broken gauge, not load.
MAX_REQUESTS = 1e6
# KV-cache blocks one engine can hold: past a terabyte of cache, so a larger count is broken too.
MAX_BLOCKS = 1e9


def out_of_range(value: float, high: float) -> str | None:
    """Why value cannot be a reading in [0, high] (NaN and infinities fail too), or None."""
    return None if 0 <= value <= high else f"{value:g} is outside [0, {high:g}]"


@dataclass(frozen=True)
class PodMetrics:
    pod: str
    running: float | None = None
    waiting: float | None = None
    kv_cache_usage: float | None = None  # 0..1
    # Blocks of reusable prompt prefixes; None from an engine that does not export the gauge.
    cached_blocks: float | None = None
    # Cumulative buckets of the latency histogram the policy targets, if it targets one.
    latency: Buckets | None = None
    error: str | None = None  # why the metrics did not come

    @property
    def problem(self) -> str | None:
        """Why these metrics cannot be used, or None when they can."""
        if self.error is not None:
            return self.error
        for name, value, high in (
            ("requests running", self.running, MAX_REQUESTS),
            ("requests waiting", self.waiting, MAX_REQUESTS),
            ("KV-cache usage", self.kv_cache_usage, 1.0),
        ):
            if value is None:
                return f"no {name}"
            if why := out_of_range(value, high):
                return f"{name}: {why}"
        if self.cached_blocks is not None and (why := out_of_range(self.cached_blocks, MAX_BLOCKS)):
            return f"cached blocks: {why}"
        return None

    @property
    def answered(self) -> bool:
        return self.problem is None

    @property
    def in_flight(self) -> float:
        return (self.running or 0.0) + (self.waiting or 0.0)


@dataclass(frozen=True)
class ScalingPolicy:
    min_replicas: int = 1
    max_replicas: int = 4
    target_queue_depth: float = 8.0  # requests in flight per replica
    target_kv_cache_usage: float = 0.8
    tolerance: float = 0.1
    scale_up_stabilization_s: float = 0.0
    scale_down_stabilization_s: float = 300.0
    scale_to_zero_delay_s: float = 600.0
    # Per decision, grow by at most max(this many pods, 100% of the current count), as HPA does.
    max_scale_up_pods: int = 4
    # The optional third signal: a latency quantile of the service over the last interval
    # against a target, in seconds; ``latency_name`` words it in the reason ("p90 TTFT").
    latency_target_s: float | None = None
    latency_name: str = "latency"
    # Scale up ahead of a rising load by the engines' start time (forecast.py).
    scale_ahead: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.min_replicas <= self.max_replicas or self.max_replicas < 1:
            raise ValueError("need 0 <= min_replicas <= max_replicas and max_replicas >= 1")
        if self.target_queue_depth <= 0 or not 0 < self.target_kv_cache_usage <= 1:
            raise ValueError("targets must be positive (KV-cache usage at most 1)")
        if self.latency_target_s is not None and not 0 < self.latency_target_s < math.inf:
            raise ValueError("a latency target must be a positive number of seconds")


@dataclass(frozen=True)
class Recommendation:
    time: float
    replicas: int


@dataclass(frozen=True)
class Observation:
    """What a step saw of the service: the input of one decision."""

    # The engine Deployment's replicas (HPA's current count), the count a decision moves from.
    deployment_replicas: int
    # The metrics of the ready engine pods.
    pods: Sequence[PodMetrics] = ()
    # Replicas asked for that are not ready yet, so not among ``pods``.
    starting: int = 0
    # Requests the routers hold while no engine is ready.
    held_requests: float = 0.0
    # The service's latency quantile over the last interval, in seconds (None: no request
    # finished in it, or the policy has no latency target).
    latency: float | None = None
    # The engines' learned start time (None: none learned yet, so no forecast).
    start_seconds: float | None = None


@dataclass(frozen=True)
class ScalingMemory:
    """What a decision hands the next one."""

    # The recommendations inside the windows: only the latest of each replica count, which is
    # all the windows ask (the highest and lowest seen since some time), so it stays short.
    history: tuple[Recommendation, ...] = ()
    # When work was last seen.
    last_active: float | None = None
    # The load samples the forecast reads (forecast.CYCLE_S of them).
    load: tuple[Sample, ...] = ()


@dataclass(frozen=True)
class ScaleDecision:
    replicas: int
    reason: str
    memory: ScalingMemory  # for the next decision
    # What set the count before windows and bounds: queueDepth, kvCacheUsage, latency, forecast,
    # heldRequests (scale from zero), idle, or unknown (no engine answered).
    signal: str = "unknown"
    signals: dict[str, float] = field(default_factory=dict)
    unanswered: tuple[str, ...] = ()
    problems: dict[str, str] = field(default_factory=dict)  # why each unanswered pod is
    # What the signals asked for before [min_replicas, max_replicas] bounded it (None: not
    # given): above max_replicas, the service is held at its maximum.
    wanted: int | None = None


def bound_replicas(replicas: int, min_replicas: int, max_replicas: int) -> int:
    """replicas within [min_replicas, max_replicas]: the user's bounds, applied by the decision
    and again by the reconciler, since bounds changed after a decision apply at once."""
    return min(max(replicas, min_replicas), max_replicas)


def compact_history(history: tuple[Recommendation, ...]) -> tuple[Recommendation, ...]:
    """The latest recommendation of each replica count, in the given (time) order."""
    last = {r.replicas: i for i, r in enumerate(history)}
    return tuple(r for i, r in enumerate(history) if last[r.replicas] == i)


def _from_ratio(current: int, ratio: float, tolerance: float) -> int:
    if abs(ratio - 1.0) <= tolerance:
        return current
    return math.ceil(current * ratio - 1e-9)


def decide(
    policy: ScalingPolicy, seen: Observation, memory: ScalingMemory, now: float
) -> ScaleDecision:
    """The replica count for what ``seen`` reports, given what ``memory`` recalls."""
    current, pods, starting = seen.deployment_replicas, seen.pods, seen.starting
    history, last_active = memory.history, memory.last_active
    held_requests, latency = seen.held_requests, seen.latency
    problems = {p.pod: why for p in pods if (why := p.problem) is not None}
    answered = [p for p in pods if p.pod not in problems]
    unanswered = tuple(problems)
    if not 0 <= held_requests < math.inf:
        # The scraper rejects such readings already; a broken caller must not scale on them, nor
        # put a NaN into the signals written to status.
        held_requests = 0.0
    in_flight = sum(p.in_flight for p in answered)
    busy = in_flight > 0 or held_requests > 0
    if busy:
        last_active = now
    signals = {
        "current": float(current),
        "starting": float(starting),
        "in_flight": in_flight,
        "held": held_requests,
    }

    load = recent(memory.load, now)
    # -- what the load asks for ------------------------------------------------------------
    if current == 0:
        if held_requests > 0:
            raw, why = max(1, policy.min_replicas), f"{held_requests:g} requests held at zero"
            signal = "heldRequests"
        else:
            raw, why, signal = policy.min_replicas, "idle at zero", "idle"
    elif not answered:
        raw, why, signal = current, "no engine answered its metrics", "unknown"
    else:
        serving = len(answered) + starting
        per_replica = in_flight / serving
        kv = sum(p.kv_cache_usage or 0.0 for p in answered) / serving
        signals.update(queue_per_replica=per_replica, kv_cache_usage=kv)
        # Each signal's count and why.
        candidates = [
            (
                _from_ratio(current, per_replica / policy.target_queue_depth, policy.tolerance),
                f"{per_replica:.2f} requests per replica, target {policy.target_queue_depth:g}",
                "queueDepth",
            ),
            (
                _from_ratio(current, kv / policy.target_kv_cache_usage, policy.tolerance),
                f"KV-cache usage {kv:.0%}, target {policy.target_kv_cache_usage:.0%}",
                "kvCacheUsage",
            ),
        ]
        target = policy.latency_target_s
        if target is not None and latency is not None and 0 <= latency < math.inf:
            signals["latency"] = latency
            by_latency = _from_ratio(current, latency / target, policy.tolerance)
            if starting:
                # Latency stays high until the replicas already asked for serve: asking for
                # more meanwhile would climb to the maximum on a slow model load.
                by_latency = min(by_latency, current)
            why = f"{policy.latency_name} {latency:.3g}s, target {target:g}s"
            candidates.append((by_latency, why, "latency"))
        # The requests in flight the engines would hold with every replica ready: the trend's
        # quantity, unmoved by replicas joining (a per-replica figure halves when they double).
        demand = per_replica * current
        load = remember(load, Sample(now, demand))
        if policy.scale_ahead and (start_seconds := seen.start_seconds) is not None:
            # The rise is capped at doubling the demand or the current capacity, whichever is
            # more: what one decision's step may add anyway.
            ahead = projection(
                load, now, start_seconds, max(demand, current * policy.target_queue_depth)
            )
            if ahead is not None:
                if not starting:
                    # Replicas still starting were asked for to meet this rise; and the queue
                    # that grows until they serve is no trend of the load: the next forecast
                    # waits for them.
                    candidates.append(_forecast(current, ahead, policy))
                signals.update(
                    forecast_slope=ahead.slope,
                    forecast_horizon=ahead.horizon,
                    forecast_in_flight=ahead.projected,
                )
        # The largest wins, the first of equals: the forecast decides only when it asks for more.
        raw, why, signal = max(candidates, key=lambda c: c[0])
        idle_for = now - last_active if last_active is not None else math.inf
        if raw == 0 and idle_for < policy.scale_to_zero_delay_s:
            raw, why = (
                1,
                f"idle for {idle_for:.0f}s, zero only after {policy.scale_to_zero_delay_s:g}s",
            )
            signal = "idle"
        elif raw == 0:
            why, signal = f"no work for {policy.scale_to_zero_delay_s:g}s", "idle"
    wanted = raw
    raw = bound_replicas(raw, policy.min_replicas, policy.max_replicas)
    if unanswered and raw < current:
        raw, why = current, f"held: no metrics from {', '.join(unanswered)}"
    elif starting and raw < current:
        raw, why = current, f"held: {starting} replicas still starting"

    # -- stabilization ---------------------------------------------------------------------
    keep = max(policy.scale_up_stabilization_s, policy.scale_down_stabilization_s)
    # With no history (a new service), the present size counts as seen now: nothing shrinks
    # before one whole window of evidence. A history whose entries have all left the window is
    # that evidence: seeding it too would hold every scale-down of a window shorter than the
    # interval between decisions, for good.
    past = tuple(r for r in history if now - r.time < keep)
    if not history:
        past = (Recommendation(now, current),)
    history = compact_history((*past, Recommendation(now, raw)))
    if raw > current:
        window = [
            raw,
            *(r.replicas for r in past if now - r.time < policy.scale_up_stabilization_s),
        ]
        desired = max(current, min(window))
        if desired < raw:
            why = f"{why}; scale-up held by the {policy.scale_up_stabilization_s:g}s window"
        cap = max(current + max(policy.max_scale_up_pods, current), policy.min_replicas)
        if desired > cap:
            desired, why = cap, f"{why}; step limited to {cap}"
    elif raw < current:
        window = [
            raw,
            *(r.replicas for r in past if now - r.time < policy.scale_down_stabilization_s),
        ]
        desired = min(current, max(window))
        if desired > raw:
            why = f"{why}; scale-down held by the {policy.scale_down_stabilization_s:g}s window"
    else:
        desired = current
    # The bounds are the user's explicit word and apply at once, whatever the window says.
    bounded = bound_replicas(desired, policy.min_replicas, policy.max_replicas)
    if bounded != desired:
        desired, why = bounded, f"{why}; bounded to [{policy.min_replicas}, {policy.max_replicas}]"
    return ScaleDecision(
        desired,
        why,
        ScalingMemory(history, last_active, load),
        signal,
        signals,
        unanswered,
        problems,
        wanted,
    )


def _forecast(current: int, ahead: Projection, policy: ScalingPolicy) -> tuple[int, str, str]:
    """The forecast's candidate: the replicas the projected requests in flight need."""
    per_replica = ahead.projected / current
    # A projection the load's cycle limited says by what: the replicas it asks for are less than
    # the slope alone would, and the reason should not read as if the slope were misapplied.
    top = (
        ""
        if ahead.top is None
        else f"; no further past {ahead.top:.2f}, the top the load fell from, than it is now"
    )
    return (
        _from_ratio(current, per_replica / policy.target_queue_depth, policy.tolerance),
        f"forecast: {ahead.value:.2f} requests in flight rising {ahead.slope:.3g}/s, "
        f"{ahead.projected:.2f} in {ahead.horizon:.0f}s (the engine start time{top}), "
        f"target {policy.target_queue_depth:g} per replica",
        "forecast",
    )
