"""The built-in autoscaler: every interval, per InferenceService in builtin mode, scrape the
engines (and the routers' held requests), decide with scaling_policy.decide, record the decision.

Ownership of the replica count: the autoscaler writes only the InferenceService's status
(desiredReplicas, lastScaleDecision, and its own memory under status.autoscaling); the reconciler,
the only writer of the engine Deployment, applies status.desiredReplicas
(spec.engine_deployment_replicas).
A status write is a watch event, so the Deployment follows within one reconcile. In external mode
no loop runs: HPA or KEDA write spec.replicas through /scale and the reconciler applies that.

One asyncio task per InferenceService, started and stopped from its watch events, rather than a
kopf timer: kopf puts a finalizer on every object with a timer, and this operator deliberately
writes nothing onto the objects it watches (see reconciler.py).

The memory that must survive a restart (recommendations inside the windows, when work was last
seen) is kept in status.autoscaling. Writing it every interval would make every service a write
and a watch event every few seconds, so it is written when a decision changes something, when
its content (not just its times) changes, and otherwise at most every REFRESH_SECONDS; between
writes the exact memory is kept in the process. After a restart a window may therefore close up
to REFRESH_SECONDS early.

For scaling ahead (forecast.py), each step learns the engine start time from the engine pods it
lists (kept in status.autoscaling too: a restart keeps it; a new start is part of the content, so
it is written when learned) and keeps the load samples of the last ten minutes (the trend's
window and the load's cycle, forecast.CYCLE_S) in the process only: after a restart the forecast
waits for the window to fill again, and knows no cycle until the load falls again.

The remembered times are checked against the operator's clock as a step reads them: one ahead
(a skewed clock, a status written by hand) counts as now, never holding a window or the idle
delay open longer than configured, and a gap over CLOCK_SKEW_TOLERANCE_S is reported once, with
a Warning Event ClockSkew and status.autoscaling.clockSkew (clamp_future).

A step that fails (the API, a scrape or the decision raising) leaves the replica count as it is
and is tried again the next interval. It is made visible once per cause, not once per interval:
a log warning and a Warning Event go with each new cause and a Normal one with the recovery,
status.autoscaling.failure names the cause (written when the cause changes, removed by the next
step that succeeds), and kvfleet_operator_autoscaling_failures_total{reason} counts every failed
step. A step whose status write fails (StatusWriteFailed) cannot say so in the status: the
StatusWriter reports it (status_writer.py). Each service has its own task, so one service's
failures never delay another's steps.

Each request of a step is sent once, not retried within it: the next interval is its retry. So
a service costs at most 3 API requests an interval whatever fails (its read, its pod list, one
status write), and its status writes back off further while they fail (kube.py).

A loop ends when its service is gone: a watch event says so, or, should that event be missed
(a watch that broke at the wrong moment), the loop's own GET answers 404.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import math
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import aiohttp
import kopf
from prometheus_client import Counter

from kvfleet.operator import kube as k
from kvfleet.operator import service_metrics
from kvfleet.operator.api import GROUP, LABEL_COMPONENT, PLURAL, VERSION
from kvfleet.operator.deletion_cost import cost_patches, deletion_costs
from kvfleet.operator.forecast import EngineStart, Sample, epoch, learn, start_estimate
from kvfleet.operator.latency import LATENCY_METRICS, Buckets, service_quantile
from kvfleet.operator.metrics_scraper import Scraper, ready_targets
from kvfleet.operator.pods import list_pods
from kvfleet.operator.resources import ENGINE_PORT, ROUTER_PORT
from kvfleet.operator.scaling_policy import (
    PodMetrics,
    Recommendation,
    ScaleDecision,
    ScalingPolicy,
    decide,
)
from kvfleet.operator.spec import (
    AutoscalingSpec,
    SpecError,
    engine_deployment_replicas,
    parse_spec,
)
from kvfleet.operator.status import timestamp
from kvfleet.operator.status_writer import StatusWriter

logger = logging.getLogger("kvfleet.operator.autoscaler")

Memory = tuple[tuple[Recommendation, ...], float | None]  # (history, last active)


class Gone:
    """What a step returns for a service that no longer exists."""


GONE = Gone()

REFRESH_SECONDS = 60.0
MAX_REASON = 1024  # the CRD's limit on lastScaleDecision.reason
MAX_FAILURE_MESSAGE = 1024  # the CRD's limit on status.autoscaling.failure.message
MAX_UNREACHABLE_REASON = 256  # the CRD's limit on each status.autoscaling.unreachableReasons value
# How far ahead of the operator's clock a remembered time may be without a report: a time ahead
# is clamped to now whatever its size, but clocks synchronised by NTP differ by far less than
# this, so only a larger gap (a skewed clock, a hand-written status) is worth an Event.
CLOCK_SKEW_TOLERANCE_S = 5.0
MAX_CLOCK_SKEW_MESSAGE = 1024  # the CRD's limit on status.autoscaling.clockSkew.message
FAILURES = Counter(
    "kvfleet_operator_autoscaling_failures",
    "Autoscaling steps that failed, by cause: APIError (reading the service or its pods), "
    "ScrapeFailed, DecisionFailed, StatusWriteFailed.",
    ["reason"],
)
STATUS_WRITE_FAILED = "StatusWriteFailed"
DELETION_COST_FAILURES = Counter(
    "kvfleet_operator_deletion_cost_failures",
    "Pod-deletion-cost writes that failed before a scale-down (which went ahead regardless).",
)
SIGNAL_NAMES = {
    "current": "current",
    "starting": "starting",
    "in_flight": "inFlight",
    "held": "heldRequests",
    "queue_per_replica": "queuePerReplica",
    "kv_cache_usage": "kvCacheUsage",
    "latency": "latencySeconds",
    "forecast_slope": "forecastSlope",
    "forecast_horizon": "forecastHorizonSeconds",
    "forecast_in_flight": "forecastInFlight",
}
LATENCY_NAMES = {"ttft": "TTFT", "queueTime": "queue time"}


# -- pure ----------------------------------------------------------------------------------


def policy_of(a: AutoscalingSpec) -> ScalingPolicy:
    latency = a.latency_target
    return ScalingPolicy(
        min_replicas=a.min_replicas,
        max_replicas=a.max_replicas,
        target_queue_depth=a.target_queue_depth,
        target_kv_cache_usage=a.target_kv_cache_usage,
        scale_up_stabilization_s=a.scale_up_stabilization_seconds,
        scale_down_stabilization_s=a.scale_down_stabilization_seconds,
        scale_to_zero_delay_s=a.scale_to_zero_delay_seconds,
        latency_target_s=latency.target_seconds if latency else None,
        latency_name=f"p{latency.quantile * 100:g} {LATENCY_NAMES[latency.metric]}"
        if latency
        else "latency",
        scale_ahead=a.scale_ahead,
    )


def _rfc3339(seconds: float) -> str:
    return timestamp(datetime.datetime.fromtimestamp(seconds, datetime.UTC))


def load_memory(status: Mapping[str, Any]) -> Memory:
    """The autoscaler's memory as persisted in status.autoscaling."""
    state = status.get("autoscaling") or {}
    history = tuple(Recommendation(float(t), int(n)) for t, n in state.get("recommendations") or [])
    last_active = state.get("lastActiveTime")
    return history, epoch(last_active) if last_active else None


def load_starts(status: Mapping[str, Any]) -> tuple[EngineStart, ...]:
    """The engine starts learned, as persisted in status.autoscaling."""
    pairs = (status.get("autoscaling") or {}).get("engineStarts") or []
    return tuple(EngineStart(float(ready), float(seconds)) for ready, seconds in pairs)


def clamp_future(
    history: tuple[Recommendation, ...],
    last_active: float | None,
    starts: tuple[EngineStart, ...],
    now: float,
) -> tuple[tuple[Recommendation, ...], float | None, tuple[EngineStart, ...], dict[str, float]]:
    """The memory with every time ahead of now moved to now, and how far ahead the furthest time
    of each field was, for the fields ahead by more than CLOCK_SKEW_TOLERANCE_S.

    A time from the future is a clock that skews, or a status written by hand (anyone with the
    status verb can): trusted, a recommendation keeps its window open, and lastActiveTime keeps
    an idle service up, for as long as it is ahead. Clamped, it counts as seen now: its window
    closes one window from now, as for a recommendation made now."""
    ahead: dict[str, float] = {}

    def clamp(name: str, t: float) -> float:
        if t > now:
            if t - now > CLOCK_SKEW_TOLERANCE_S:
                ahead[name] = max(ahead.get(name, 0.0), t - now)
            return now
        return t

    history = tuple(Recommendation(clamp("recommendations", r.time), r.replicas) for r in history)
    if last_active is not None:
        last_active = clamp("lastActiveTime", last_active)
    starts = tuple(EngineStart(clamp("engineStarts", s.ready), s.seconds) for s in starts)
    return history, last_active, starts, ahead


def clock_skew_state(ahead: Mapping[str, float], now: float) -> dict[str, Any]:
    """status.autoscaling.clockSkew for the times clamp_future moved back to now."""
    fields = ", ".join(f"{name} {seconds:.0f}s" for name, seconds in sorted(ahead.items()))
    message = (
        f"times ahead of the operator's clock, counted as now: {fields}; "
        "a skewed clock, or a status written by hand"
    )
    return {
        "reason": "ClockSkew",
        "message": message[:MAX_CLOCK_SKEW_MESSAGE],
        "time": _rfc3339(now),
    }


def memory_state(
    decision: ScaleDecision,
    unreachable: Mapping[str, str],
    starts: tuple[EngineStart, ...] = (),
) -> dict[str, Any]:
    """status.autoscaling for a decision: its history as [unix seconds, replicas] pairs, when
    work was last seen, the pods whose metrics did not come or could not be used, with why, and
    the engine starts learned with their estimate."""
    state: dict[str, Any] = {
        "recommendations": [[round(r.time, 3), r.replicas] for r in decision.history],
        "unreachablePods": sorted(unreachable),
    }
    if unreachable:
        state["unreachableReasons"] = {
            pod: why[:MAX_UNREACHABLE_REASON] for pod, why in sorted(unreachable.items())
        }
    if decision.last_active is not None:
        state["lastActiveTime"] = _rfc3339(decision.last_active)
    if (estimate := start_estimate(starts)) is not None:
        state["engineStarts"] = [[round(s.ready, 3), round(s.seconds, 3)] for s in starts]
        state["engineStartSeconds"] = round(estimate, 3)
    return state


def _content(state: Mapping[str, Any]) -> tuple[Any, ...]:
    """What a state says, without its times (nor the wording of why a pod was unreachable, which
    may change from one scrape to the next: it rides along with the next write)."""
    return (
        [n for _, n in state.get("recommendations") or []],
        state.get("unreachablePods") or [],
        "lastActiveTime" in state,
        state.get("engineStarts") or [],
    )


def _written_at(state: Mapping[str, Any]) -> float:
    # The newest recommendation is the one of the step that wrote the state.
    return max((t for t, _ in state.get("recommendations") or []), default=-math.inf)


def status_update(
    previous: Mapping[str, Any],
    current: int,
    decision: ScaleDecision,
    unreachable: Mapping[str, str],
    now: float,
    starts: tuple[EngineStart, ...] = (),
    *,
    rewrite: bool = False,
) -> dict[str, Any]:
    """The status merge patch that records a decision; empty when nothing needs writing.
    ``rewrite``: the memory read back held times from the future, replaced now whatever its
    content, so that no later read finds them again."""
    patch: dict[str, Any] = {}
    if previous.get("desiredReplicas") != decision.replicas:
        patch["desiredReplicas"] = decision.replicas
    if decision.replicas != current:
        patch["lastScaleDecision"] = {
            "time": _rfc3339(now),
            "from": current,
            "to": decision.replicas,
            "reason": decision.reason[:MAX_REASON],
            "signal": decision.signal,
            "metrics": {
                SIGNAL_NAMES[key]: round(value, 4) for key, value in decision.signals.items()
            },
        }
    state = memory_state(decision, unreachable, starts)
    old = previous.get("autoscaling") or {}
    if state != old and (
        patch
        or rewrite
        or _content(state) != _content(old)
        # A state "written" in the future is stale too: left as it is, it would never refresh.
        or not 0 <= now - _written_at(old) < REFRESH_SECONDS
    ):
        patch["autoscaling"] = state
    return patch


def failure_update(
    previous: Mapping[str, Any], reason: str | None, message: str, now: float
) -> dict[str, Any]:
    """The status merge patch that records a step's failure (reason None: it succeeded); empty
    when the recorded cause is already this one. The message alone never makes a write: one
    that changes every interval (a timestamp, an address) would write every interval."""
    recorded = (previous.get("autoscaling") or {}).get("failure")
    if (recorded or {}).get("reason") == reason:
        return {}
    if reason is None:
        return {"autoscaling": {"failure": None}}
    failure = {"reason": reason, "message": message[:MAX_FAILURE_MESSAGE], "since": _rfc3339(now)}
    return {"autoscaling": {"failure": failure}}


# -- I/O -----------------------------------------------------------------------------------


class StepFailed(Exception):
    """A step that could not decide; reason is the cause's name in status and the counter."""

    def __init__(self, reason: str, error: BaseException) -> None:
        super().__init__(f"{type(error).__name__}: {error}")
        self.reason = reason


@contextlib.contextmanager
def _failing_as(reason: str) -> Iterator[None]:
    try:
        yield
    except (k.APIError, aiohttp.ClientError, TimeoutError) as e:
        raise StepFailed("APIError", e) from e
    except Exception as e:
        raise StepFailed(reason, e) from e


class Autoscaler:
    def __init__(
        self,
        api: k.Kube,
        status: StatusWriter,
        *,
        interval: float = 10.0,
        scrape_timeout: float = 2.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._api = api
        self._status = status
        self._interval = interval
        self._clock = clock
        self._tasks: dict[k.Key, asyncio.Task[None]] = {}
        self._memory: dict[str, Memory] = {}  # by uid: a recreated object starts afresh
        # Each engine's latency buckets at the last scrape, by uid then pod: the next scrape's
        # difference is the interval's latency. Not persisted: after a restart the latency
        # signal is absent for one interval.
        self._buckets: dict[str, dict[str, Buckets]] = {}
        # By uid: the engine starts learned, the engine pods seen Ready (forecast.learn), and the
        # load samples the forecast reads (forecast.CYCLE_S of them).
        self._starts: dict[str, tuple[tuple[EngineStart, ...], frozenset[str]]] = {}
        self._load: dict[str, tuple[Sample, ...]] = {}
        # The last InferenceService each loop read (the watch event's until a read succeeds), to
        # report a failure that comes before the next read succeeds.
        self._seen: dict[k.Key, dict[str, Any]] = {}
        # The cause last reported per service: kept here too, so that a status the API server
        # pruned (a CRD without the field) still gets one write and one Event per cause.
        self._failing: dict[k.Key, str] = {}
        self._scraper = Scraper(timeout=scrape_timeout)

    def track(self, key: k.Key, body: Mapping[str, Any], *, deleted: bool = False) -> None:
        """Follow an InferenceService's watch event: a loop runs while it exists in builtin
        mode."""
        meta = body.get("metadata") or {}
        mode = ((body.get("spec") or {}).get("autoscaling") or {}).get("mode", "builtin")
        if mode == "builtin" and not deleted and not meta.get("deletionTimestamp"):
            if key not in self._tasks:
                self._seen.setdefault(key, dict(body))
                self._tasks[key] = asyncio.create_task(
                    self._loop(key), name=f"autoscale {key[0]}/{key[1]}"
                )
        elif task := self._tasks.pop(key, None):
            task.cancel()
            self._forget(key)

    @property
    def tracked(self) -> set[k.Key]:
        """The services whose loop runs."""
        return set(self._tasks)

    def _forget(self, key: k.Key) -> None:
        service_metrics.forget_decision(key)
        self._failing.pop(key, None)
        if body := self._seen.pop(key, None):
            uid = body["metadata"].get("uid", "")
            for memory in (self._memory, self._buckets, self._starts, self._load):
                memory.pop(uid, None)

    async def _loop(self, key: k.Key) -> None:
        while True:
            await asyncio.sleep(self._interval)
            try:
                decision = await self.step(key)
            except StepFailed as e:
                await self._failed(key, e)
                continue
            if decision is GONE:
                logger.info("%s/%s: gone, autoscaling stops", *key)
                if self._tasks.get(key) is asyncio.current_task():
                    del self._tasks[key]
                self._forget(key)
                return

    async def _failed(self, key: k.Key, failure: StepFailed) -> None:
        """Count a failed step; when its cause is new, say so in the log, an Event and the
        status (a failed status write is the StatusWriter's to report)."""
        FAILURES.labels(failure.reason).inc()
        isvc = self._seen.get(key)
        if isvc is None or self._failing.get(key) == failure.reason:
            logger.debug("%s/%s: autoscaling step failed (%s): %s", *key, failure.reason, failure)
            return
        self._failing[key] = failure.reason
        if failure.reason == STATUS_WRITE_FAILED:
            return
        logger.warning("%s/%s: autoscaling step failed (%s): %s", *key, failure.reason, failure)
        patch = failure_update(
            isvc.get("status") or {}, failure.reason, str(failure), self._clock()
        )
        if not patch:
            return  # recorded before a restart: reported then
        message = f"{failure.reason}: {failure}; the replica count stays, retried every interval"
        # Before the write, which may fail: the Event does not depend on it.
        kopf.event(isvc, type="Warning", reason="AutoscalingFailed", message=message)
        with contextlib.suppress(k.APIError):  # the StatusWriter reports it
            await self._status.write(key, isvc, patch, periodic=True)

    async def step(self, key: k.Key) -> ScaleDecision | Gone | None:
        """One scrape and decision; None when there is nothing to scale, GONE when the service
        no longer exists. Raises StepFailed."""
        namespace, name = key
        url = k.resource_url(f"{GROUP}/{VERSION}", PLURAL, namespace, name)
        with _failing_as("APIError"):
            isvc = await self._api.get(url, periodic=True)
        if isvc is None or isvc["metadata"].get("deletionTimestamp"):
            return GONE
        self._seen[key] = isvc
        try:
            spec = parse_spec(name, isvc.get("spec"))
        except SpecError:
            return None  # the reconciler reports it; the last decision stands
        if spec.autoscaling.mode != "builtin":
            return None
        status = isvc.get("status") or {}
        # What the reconciler applies to the engine Deployment.
        current = engine_deployment_replicas(spec, status.get("desiredReplicas"))

        with _failing_as("APIError"):
            pods = await list_pods(self._api, namespace, name, periodic=True)

        def of(component: str) -> list[dict[str, Any]]:
            return [p for p in pods if p["metadata"]["labels"].get(LABEL_COMPONENT) == component]

        engines = ready_targets(of("engine"), ENGINE_PORT)
        target = spec.autoscaling.latency_target
        histogram = LATENCY_METRICS[target.metric] if target is not None else None
        with _failing_as("ScrapeFailed"):
            metrics, (held, silent_routers) = await asyncio.gather(
                self._scraper.engines(engines, histogram),
                self._scraper.held_requests(ready_targets(of("router"), ROUTER_PORT)),
            )
        now = self._clock()
        uid = isvc["metadata"]["uid"]
        latency = None
        if target is not None:
            buckets = {m.pod: m.latency for m in metrics if m.answered and m.latency is not None}
            latency = service_quantile(target.quantile, self._buckets.get(uid, {}), buckets)
            self._buckets[uid] = buckets
        with _failing_as("DecisionFailed"):
            history, last_active = self._memory.get(uid) or load_memory(status)
            starts, seen = self._starts.get(uid) or (load_starts(status), None)
            history, last_active, starts, ahead = clamp_future(history, last_active, starts, now)
            if last_active is None:
                # Never seen busy: the idle time counts from the first look, so a new endpoint
                # keeps its replica for the whole scale-to-zero delay.
                last_active = now
            starts, seen = learn(starts, of("engine"), seen)
            self._starts[uid] = (starts, seen)
            decision = decide(
                current,
                metrics,
                policy_of(spec.autoscaling),
                history,
                last_active,
                now,
                held_requests=held,
                starting=max(0, current - len(engines)),
                latency=latency,
                load=self._load.get(uid, ()),
                start_seconds=start_estimate(starts),
            )
        logger.debug(
            "%s/%s: %d -> %d: %s", namespace, name, current, decision.replicas, decision.reason
        )
        self._memory[uid] = (decision.history, decision.last_active)
        self._load[uid] = decision.load
        if decision.wanted is not None:
            service_metrics.record_decision(key, decision.wanted, spec.autoscaling.max_replicas)
        if 0 < decision.replicas < current:
            # Before the status write that makes the reconciler shrink the Deployment.
            await self._rank_for_deletion(namespace, of("engine"), metrics)
        unreachable = {**decision.problems, **silent_routers}
        patch = status_update(
            status, current, decision, unreachable, now, starts, rewrite=bool(ahead)
        )
        if ahead:
            skew = clock_skew_state(ahead, now)
            patch["autoscaling"] = patch.get("autoscaling", {}) | {"clockSkew": skew}
            # Reported before the write, which may fail: the memory is clamped in the process
            # already, so no later step would find these times again.
            logger.warning("%s/%s: %s", namespace, name, skew["message"])
            kopf.event(isvc, type="Warning", reason="ClockSkew", message=skew["message"])
        recovered = failure_update(status, None, "", now)
        if recovered:
            # Merged into the memory's own patch, which replaces every other field it names.
            patch["autoscaling"] = patch.get("autoscaling", {}) | recovered["autoscaling"]
        if patch:
            try:
                await self._status.write(key, isvc, patch, periodic=True)
            except k.APINotFoundError:
                return GONE
            except k.APIError as e:
                raise StepFailed(STATUS_WRITE_FAILED, e) from e
        # A failed status write's recovery is the StatusWriter's to report.
        was_failing = self._failing.pop(key, None) not in (None, STATUS_WRITE_FAILED)
        if recovered or was_failing:
            message = "autoscaling steps succeed again"
            logger.info("%s/%s: %s", namespace, name, message)
            kopf.event(isvc, type="Normal", reason="AutoscalingRecovered", message=message)
        if decision.replicas != current:
            message = f"engine replicas {current} -> {decision.replicas}: {decision.reason}"
            logger.info("%s/%s: %s", namespace, name, message)
            kopf.event(isvc, type="Normal", reason="Scaled", message=message)
        return decision

    async def _rank_for_deletion(
        self, namespace: str, pods: list[dict[str, Any]], metrics: list[PodMetrics]
    ) -> None:
        """Marks the coldest, idlest engines as the ones the ReplicaSet deletes first. A failed
        write leaves the choice to the ReplicaSet's own order; the scale-down goes ahead, since
        holding it would keep idle GPUs for a ranking."""
        for pod, patch in cost_patches(pods, deletion_costs(metrics)).items():
            try:
                url = k.resource_url("v1", "pods", namespace, pod)
                await self._api.merge_patch(url, patch, periodic=True)
            except k.APINotFoundError:
                pass  # gone already
            except k.APIError as e:
                DELETION_COST_FAILURES.inc()
                logger.warning("%s/%s: pod-deletion-cost not written: %s", namespace, pod, e)

    async def stop(self) -> None:
        tasks = list(self._tasks.values())
        self._tasks.clear()
        self._seen.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._scraper.close()
