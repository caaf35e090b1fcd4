"""The built-in autoscaler: every interval, per InferenceService in builtin mode, scrape the
engines (and the routers' held requests), decide with scaling_policy.decide, record the decision
in the status, which the reconciler applies to the engine Deployment (its only writer).

One asyncio task per service rather than a kopf timer: kopf puts a finalizer on every object
with a timer, and this operator writes nothing onto the objects it watches (reconciler.py). What
must survive a restart (the recommendations inside the windows, when work was last seen, the
engine starts learned) is kept in status.autoscaling, written when its content changes or at most
every REFRESH_SECONDS, so a settled service is not a write every interval; the process keeps the
exact memory in between. A failing step changes nothing, is retried the next interval, and is
reported once per cause. docs/autoscaling.md says what a user sees of each.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import math
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp
from prometheus_client import Counter

from kvfleet.operator import kube, service_metrics
from kvfleet.operator.api import GROUP, LABEL_COMPONENT, PLURAL, VERSION
from kvfleet.operator.deletion_cost import cost_patches, deletion_costs
from kvfleet.operator.forecast import EngineStart, epoch, learn, start_estimate
from kvfleet.operator.latency import LATENCY_METRICS, Buckets, service_quantile
from kvfleet.operator.metrics_scraper import Scraper, Target, ready_targets
from kvfleet.operator.pods import list_pods
from kvfleet.operator.scaling_policy import (
    Observation,
    PodMetrics,
    Recommendation,
    ScaleDecision,
    ScalingMemory,
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
from kvfleet.telemetry.ports import ENGINE_PORT, ROUTER_PORT

logger = logging.getLogger("kvfleet.operator.autoscaler")

REFRESH_SECONDS = 60.0
MAX_REASON = 1024  # the CRD's limit on lastScaleDecision.reason
MAX_FAILURE_MESSAGE = 1024  # the CRD's limit on status.autoscaling.failure.message
# While a service is at zero, how often its routers' held requests are read between steps: a
# request held at zero waits for the scale decision, and the interval alone (10 s by default)
# would add up to its whole length to that request's first token. One /metrics read per router a
# second, and no API request: the step that follows a held request makes those.
ZERO_POLL_SECONDS = 1.0
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


def load_memory(status: Mapping[str, Any]) -> ScalingMemory:
    """The decisions' memory as persisted in status.autoscaling (the forecast's load samples are
    not: they fill again after a restart)."""
    state = status.get("autoscaling") or {}
    history = tuple(Recommendation(float(t), int(n)) for t, n in state.get("recommendations") or [])
    last_active = state.get("lastActiveTime")
    return ScalingMemory(history, epoch(last_active) if last_active else None)


def load_starts(status: Mapping[str, Any]) -> tuple[EngineStart, ...]:
    """The engine starts learned, as persisted in status.autoscaling."""
    pairs = (status.get("autoscaling") or {}).get("engineStarts") or []
    return tuple(EngineStart(float(ready), float(seconds)) for ready, seconds in pairs)


def clamp_future(
    memory: ScalingMemory, starts: tuple[EngineStart, ...], now: float
) -> tuple[ScalingMemory, tuple[EngineStart, ...], dict[str, float]]:
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

    history = tuple(
        Recommendation(clamp("recommendations", r.time), r.replicas) for r in memory.history
    )
    last_active = memory.last_active
    if last_active is not None:
        last_active = clamp("lastActiveTime", last_active)
    starts = tuple(EngineStart(clamp("engineStarts", s.ready), s.seconds) for s in starts)
    return replace(memory, history=history, last_active=last_active), starts, ahead


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
    memory = decision.memory
    state: dict[str, Any] = {
        "recommendations": [[round(r.time, 3), r.replicas] for r in memory.history],
        "unreachablePods": sorted(unreachable),
    }
    if unreachable:
        state["unreachableReasons"] = {
            pod: why[:MAX_UNREACHABLE_REASON] for pod, why in sorted(unreachable.items())
        }
    if memory.last_active is not None:
        state["lastActiveTime"] = _rfc3339(memory.last_active)
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
    deployment_replicas: int,
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
    if decision.replicas != deployment_replicas:
        metrics: dict[str, float | None] = {
            SIGNAL_NAMES[key]: round(value, 4) for key, value in decision.signals.items()
        }
        # The patch merges this object into the last decision's: a reading this decision lacks
        # (no latency in an idle interval, no forecast) is removed, not left as the last one's.
        last = (previous.get("lastScaleDecision") or {}).get("metrics") or {}
        metrics |= {name: None for name in last if name not in metrics}
        patch["lastScaleDecision"] = {
            "time": _rfc3339(now),
            "from": deployment_replicas,
            "to": decision.replicas,
            "reason": decision.reason[:MAX_REASON],
            "signal": decision.signal,
            "metrics": metrics,
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


@dataclass
class ServiceState:
    """What the autoscaler keeps of one InferenceService while its loop runs."""

    task: asyncio.Task[None]
    # The InferenceService last read (the watch event's until a read succeeds), to report a
    # failure that comes before the next read succeeds.
    seen: dict[str, Any]
    # The cause last reported: kept here too, so that a status the API server pruned (a CRD
    # without the field) still gets one write and one Event per cause.
    failing: str | None = None
    # The rest was learned of the object with this uid: a recreated object starts afresh.
    uid: str = ""
    # The decisions' memory, exact between its status writes; None: read it from the status.
    memory: ScalingMemory | None = None
    # Each engine's latency buckets at the last scrape, by pod: the next scrape's difference is
    # the interval's latency. Not persisted: after a restart the latency signal is absent for one
    # interval.
    buckets: dict[str, Buckets] = field(default_factory=dict)
    # The engine starts learned and the engine pods seen Ready (forecast.learn); None: read the
    # starts from the status.
    starts: tuple[tuple[EngineStart, ...], frozenset[str]] | None = None
    # The routers whose held requests end the wait for the next step early: the ready routers of
    # the last step, if it decided zero replicas; empty otherwise (after a step that failed or
    # was skipped too, so its retry waits the whole interval).
    routers_at_zero: list[Target] = field(default_factory=list)

    def learning_of(self, uid: str) -> None:
        """Forget what was learned of an earlier object of the same name."""
        if uid != self.uid:
            self.uid, self.memory, self.buckets, self.starts = uid, None, {}, None


@dataclass(frozen=True)
class Decided:
    """A step that decided (the count may be the same)."""

    decision: ScaleDecision


@dataclass(frozen=True)
class Skipped:
    """A step with nothing to scale: the spec is invalid (the reconciler reports it) or not in
    builtin mode (its loop stops at the watch event). The last decision stands."""

    why: str


@dataclass(frozen=True)
class Gone:
    """The service no longer exists: its loop ends."""


@dataclass(frozen=True)
class Failed:
    """A step that could not decide; the replica count stays. reason: the cause's name in the
    status and the counter."""

    reason: str
    message: str


StepOutcome = Decided | Skipped | Gone | Failed


class _StepFailed(Exception):
    """Ends a step early; step() returns it as Failed."""

    def __init__(self, reason: str, error: BaseException) -> None:
        super().__init__(f"{type(error).__name__}: {error}")
        self.reason = reason


@contextlib.contextmanager
def _failing_as(reason: str) -> Iterator[None]:
    try:
        yield
    except (kube.APIError, aiohttp.ClientError, TimeoutError) as e:
        raise _StepFailed("APIError", e) from e
    except Exception as e:
        raise _StepFailed(reason, e) from e


class Autoscaler:
    def __init__(
        self,
        api: kube.Kube,
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
        self._services: dict[kube.Key, ServiceState] = {}
        self._scraper = Scraper(timeout=scrape_timeout)

    def track(self, key: kube.Key, body: Mapping[str, Any], *, deleted: bool = False) -> None:
        """Follow an InferenceService's watch event: a loop runs while it exists in builtin
        mode."""
        meta = body.get("metadata") or {}
        mode = ((body.get("spec") or {}).get("autoscaling") or {}).get("mode", "builtin")
        if mode == "builtin" and not deleted and not meta.get("deletionTimestamp"):
            if key not in self._services:
                task = asyncio.create_task(self._loop(key), name=f"autoscale {key[0]}/{key[1]}")
                self._services[key] = ServiceState(task, dict(body))
        elif state := self._services.pop(key, None):
            state.task.cancel()
            service_metrics.forget_decision(key)

    @property
    def tracked(self) -> set[kube.Key]:
        """The services whose loop runs."""
        return set(self._services)

    async def _loop(self, key: kube.Key) -> None:
        state = self._services[key]  # stored by track before this task first runs
        while True:
            await self._until_next_step(state)
            match await self.step(key, state):
                case Failed() as failure:
                    await self._failed(key, state, failure)
                case Gone():
                    logger.info("%s/%s: gone, autoscaling stops", *key)
                    if self._services.get(key) is state:
                        del self._services[key]
                        service_metrics.forget_decision(key)
                    return
                case Skipped(why=why):
                    logger.debug("%s/%s: nothing to scale: %s", *key, why)
                case Decided():
                    pass

    async def _until_next_step(self, state: ServiceState) -> None:
        """The interval; while the service is at zero, cut short as soon as one of its routers
        holds a request (read every ZERO_POLL_SECONDS)."""
        deadline = time.monotonic() + self._interval
        while True:
            left = deadline - time.monotonic()
            if not state.routers_at_zero or left <= ZERO_POLL_SECONDS:
                # The step itself reads them next: no read of its own just before.
                await asyncio.sleep(max(0.0, left))
                return
            await asyncio.sleep(ZERO_POLL_SECONDS)
            held, _ = await self._scraper.held_requests(state.routers_at_zero)
            if held > 0:
                return

    async def _failed(self, key: kube.Key, state: ServiceState, failure: Failed) -> None:
        """Count a failed step; when its cause is new, say so in the log, an Event and the
        status (a failed status write is the StatusWriter's to report)."""
        FAILURES.labels(failure.reason).inc()
        if state.failing == failure.reason:
            logger.debug(
                "%s/%s: autoscaling step failed (%s): %s", *key, failure.reason, failure.message
            )
            return
        state.failing = failure.reason
        if failure.reason == STATUS_WRITE_FAILED:
            return
        logger.warning(
            "%s/%s: autoscaling step failed (%s): %s", *key, failure.reason, failure.message
        )
        isvc = state.seen
        patch = failure_update(
            isvc.get("status") or {}, failure.reason, failure.message, self._clock()
        )
        if not patch:
            return  # recorded before a restart: reported then
        message = (
            f"{failure.reason}: {failure.message}; the replica count stays, retried every interval"
        )
        # Before the write, which may fail: the Event does not depend on it.
        kube.post_event(isvc, type="Warning", reason="AutoscalingFailed", message=message)
        with contextlib.suppress(kube.APIError):  # the StatusWriter reports it
            await self._status.write(key, isvc, patch, periodic=True)

    async def step(self, key: kube.Key, state: ServiceState) -> StepOutcome:
        """One scrape and decision. Each request is sent once: the next interval is its retry."""
        state.routers_at_zero = []  # until a step decides zero: a failed one waits the interval
        try:
            return await self._step(key, state)
        except _StepFailed as e:
            return Failed(e.reason, str(e))

    async def _step(self, key: kube.Key, state: ServiceState) -> StepOutcome:
        namespace, name = key
        url = kube.resource_url(f"{GROUP}/{VERSION}", PLURAL, namespace, name)
        with _failing_as("APIError"):
            isvc = await self._api.get(url, periodic=True)
        if isvc is None or isvc["metadata"].get("deletionTimestamp"):
            return Gone()
        state.seen = isvc
        try:
            spec = parse_spec(name, isvc.get("spec"))
        except SpecError:
            return Skipped("invalid spec")
        if spec.autoscaling.mode != "builtin":
            return Skipped(f"autoscaling mode {spec.autoscaling.mode}")
        status = isvc.get("status") or {}
        deployment_replicas = engine_deployment_replicas(spec, status.get("desiredReplicas"))

        with _failing_as("APIError"):
            pods = await list_pods(self._api, namespace, name, periodic=True)

        def of(component: str) -> list[dict[str, Any]]:
            return [p for p in pods if p["metadata"]["labels"].get(LABEL_COMPONENT) == component]

        engines = ready_targets(of("engine"), ENGINE_PORT)
        routers = ready_targets(of("router"), ROUTER_PORT)
        target = spec.autoscaling.latency_target
        histogram = LATENCY_METRICS[target.metric] if target is not None else None
        with _failing_as("ScrapeFailed"):
            metrics, (held, silent_routers) = await asyncio.gather(
                self._scraper.engines(engines, histogram),
                self._scraper.held_requests(routers),
            )
        now = self._clock()
        state.learning_of(isvc["metadata"]["uid"])
        latency = None
        if target is not None:
            buckets = {m.pod: m.latency for m in metrics if m.answered and m.latency is not None}
            latency = service_quantile(target.quantile, state.buckets, buckets)
            state.buckets = buckets
        with _failing_as("DecisionFailed"):
            memory = state.memory or load_memory(status)
            starts, seen = state.starts or (load_starts(status), None)
            memory, starts, ahead = clamp_future(memory, starts, now)
            if memory.last_active is None:
                # Never seen busy: the idle time counts from the first look, so a new endpoint
                # keeps its replica for the whole scale-to-zero delay.
                memory = replace(memory, last_active=now)
            starts, seen = learn(starts, of("engine"), seen)
            state.starts = starts, seen
            observation = Observation(
                deployment_replicas,
                metrics,
                starting=max(0, deployment_replicas - len(engines)),
                held_requests=held,
                latency=latency,
                start_seconds=start_estimate(starts),
            )
            decision = decide(policy_of(spec.autoscaling), observation, memory, now)
        logger.debug(
            "%s/%s: %d -> %d: %s",
            namespace,
            name,
            deployment_replicas,
            decision.replicas,
            decision.reason,
        )
        state.memory = decision.memory
        state.routers_at_zero = routers if decision.replicas == 0 else []
        if decision.wanted is not None:
            service_metrics.record_decision(key, decision.wanted, spec.autoscaling.max_replicas)
        if 0 < decision.replicas < deployment_replicas:
            # Before the status write that makes the reconciler shrink the Deployment.
            await self._rank_for_deletion(namespace, of("engine"), metrics)
        unreachable = {**decision.problems, **silent_routers}
        patch = status_update(
            status, deployment_replicas, decision, unreachable, now, starts, rewrite=bool(ahead)
        )
        if ahead:
            skew = clock_skew_state(ahead, now)
            patch["autoscaling"] = patch.get("autoscaling", {}) | {"clockSkew": skew}
            # Reported before the write, which may fail: the memory is clamped in the process
            # already, so no later step would find these times again.
            logger.warning("%s/%s: %s", namespace, name, skew["message"])
            kube.post_event(isvc, type="Warning", reason="ClockSkew", message=skew["message"])
        recovered = failure_update(status, None, "", now)
        if recovered:
            # Merged into the memory's own patch, which replaces every other field it names.
            patch["autoscaling"] = patch.get("autoscaling", {}) | recovered["autoscaling"]
        if patch:
            try:
                await self._status.write(key, isvc, patch, periodic=True)
            except kube.APINotFoundError:
                return Gone()
            except kube.APIError as e:
                raise _StepFailed(STATUS_WRITE_FAILED, e) from e
        # A failed status write's recovery is the StatusWriter's to report.
        was_failing = state.failing not in (None, STATUS_WRITE_FAILED)
        state.failing = None
        if recovered or was_failing:
            message = "autoscaling steps succeed again"
            logger.info("%s/%s: %s", namespace, name, message)
            kube.post_event(isvc, type="Normal", reason="AutoscalingRecovered", message=message)
        if decision.replicas != deployment_replicas:
            message = (
                f"engine replicas {deployment_replicas} -> {decision.replicas}: {decision.reason}"
            )
            logger.info("%s/%s: %s", namespace, name, message)
            kube.post_event(isvc, type="Normal", reason="Scaled", message=message)
        return Decided(decision)

    async def _rank_for_deletion(
        self, namespace: str, pods: list[dict[str, Any]], metrics: list[PodMetrics]
    ) -> None:
        """Marks the coldest, idlest engines as the ones the ReplicaSet deletes first. A failed
        write leaves the choice to the ReplicaSet's own order; the scale-down goes ahead, since
        holding it would keep idle GPUs for a ranking."""
        for pod, patch in cost_patches(pods, deletion_costs(metrics)).items():
            try:
                url = kube.resource_url("v1", "pods", namespace, pod)
                await self._api.merge_patch(url, patch, periodic=True)
            except kube.APINotFoundError:
                pass  # gone already
            except kube.APIError as e:
                DELETION_COST_FAILURES.inc()
                logger.warning("%s/%s: pod-deletion-cost not written: %s", namespace, pod, e)

    async def stop(self) -> None:
        tasks = [state.task for state in self._services.values()]
        self._services.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._scraper.close()
