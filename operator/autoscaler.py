"""The built-in autoscaler: every interval, per InferenceService in builtin mode, scrape the
engines (and the routers' held requests), decide with scaling_policy.decide, record the decision.

Ownership of the replica count: the autoscaler writes only the InferenceService's status
(desiredReplicas, lastScaleDecision, and its own memory under status.autoscaling); the reconciler,
the only writer of the engine Deployment, applies status.desiredReplicas (spec.engine_replicas).
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
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import math
import time
from collections.abc import Callable, Mapping
from typing import Any

import kopf

from kvfleet.operator import kube as k
from kvfleet.operator.metrics_scraper import Scraper, ready_targets
from kvfleet.operator.pods import list_pods
from kvfleet.operator.resources import (
    ENGINE_PORT,
    GROUP,
    LABEL_COMPONENT,
    PLURAL,
    ROUTER_PORT,
    VERSION,
)
from kvfleet.operator.scaling_policy import Recommendation, ScaleDecision, ScalingPolicy, decide
from kvfleet.operator.spec import AutoscalingSpec, SpecError, engine_replicas, parse_spec
from kvfleet.operator.status import timestamp

logger = logging.getLogger("kvfleet.operator.autoscaler")

Memory = tuple[tuple[Recommendation, ...], float | None]  # (history, last active)

REFRESH_SECONDS = 60.0
MAX_REASON = 1024  # the CRD's limit on lastScaleDecision.reason
SIGNAL_NAMES = {
    "current": "current",
    "starting": "starting",
    "in_flight": "inFlight",
    "held": "heldRequests",
    "queue_per_replica": "queuePerReplica",
    "kv_cache_usage": "kvCacheUsage",
}


# -- pure ----------------------------------------------------------------------------------


def policy_of(a: AutoscalingSpec) -> ScalingPolicy:
    return ScalingPolicy(
        min_replicas=a.min_replicas,
        max_replicas=a.max_replicas,
        target_queue_depth=a.target_queue_depth,
        target_kv_cache_usage=a.target_kv_cache_usage,
        scale_up_stabilization_s=a.scale_up_stabilization_seconds,
        scale_down_stabilization_s=a.scale_down_stabilization_seconds,
        scale_to_zero_delay_s=a.scale_to_zero_delay_seconds,
    )


def _epoch(value: str) -> float:
    return datetime.datetime.fromisoformat(value).timestamp()


def _rfc3339(epoch: float) -> str:
    return timestamp(datetime.datetime.fromtimestamp(epoch, datetime.UTC))


def load_memory(status: Mapping[str, Any]) -> Memory:
    """The autoscaler's memory as persisted in status.autoscaling."""
    state = status.get("autoscaling") or {}
    history = tuple(Recommendation(float(t), int(n)) for t, n in state.get("recommendations") or [])
    last_active = state.get("lastActiveTime")
    return history, _epoch(last_active) if last_active else None


def memory_state(decision: ScaleDecision, unreachable: tuple[str, ...]) -> dict[str, Any]:
    """status.autoscaling for a decision: its history as [unix seconds, replicas] pairs, when
    work was last seen, and the pods whose metrics did not come."""
    state: dict[str, Any] = {
        "recommendations": [[round(r.time, 3), r.replicas] for r in decision.history],
        "unreachablePods": sorted(unreachable),
    }
    if decision.last_active is not None:
        state["lastActiveTime"] = _rfc3339(decision.last_active)
    return state


def _content(state: Mapping[str, Any]) -> tuple[Any, ...]:
    """What a state says, without its times."""
    return (
        [n for _, n in state.get("recommendations") or []],
        state.get("unreachablePods") or [],
        "lastActiveTime" in state,
    )


def _written_at(state: Mapping[str, Any]) -> float:
    # The newest recommendation is the one of the step that wrote the state.
    return max((t for t, _ in state.get("recommendations") or []), default=-math.inf)


def status_update(
    previous: Mapping[str, Any],
    current: int,
    decision: ScaleDecision,
    unreachable: tuple[str, ...],
    now: float,
) -> dict[str, Any]:
    """The status merge patch that records a decision; empty when nothing needs writing."""
    patch: dict[str, Any] = {}
    if previous.get("desiredReplicas") != decision.replicas:
        patch["desiredReplicas"] = decision.replicas
    if decision.replicas != current:
        patch["lastScaleDecision"] = {
            "time": _rfc3339(now),
            "from": current,
            "to": decision.replicas,
            "reason": decision.reason[:MAX_REASON],
            "metrics": {
                SIGNAL_NAMES[key]: round(value, 4) for key, value in decision.signals.items()
            },
        }
    state = memory_state(decision, unreachable)
    old = previous.get("autoscaling") or {}
    if state != old and (
        patch or _content(state) != _content(old) or now - _written_at(old) >= REFRESH_SECONDS
    ):
        patch["autoscaling"] = state
    return patch


# -- I/O -----------------------------------------------------------------------------------


class Autoscaler:
    def __init__(
        self,
        api: k.Kube,
        *,
        interval: float = 10.0,
        scrape_timeout: float = 2.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._api = api
        self._interval = interval
        self._clock = clock
        self._tasks: dict[k.Key, asyncio.Task[None]] = {}
        self._memory: dict[str, Memory] = {}  # by uid: a recreated object starts afresh
        self._scraper = Scraper(timeout=scrape_timeout)

    def track(self, key: k.Key, body: Mapping[str, Any], *, deleted: bool = False) -> None:
        """Follow an InferenceService's watch event: a loop runs while it exists in builtin
        mode."""
        meta = body.get("metadata") or {}
        mode = ((body.get("spec") or {}).get("autoscaling") or {}).get("mode", "builtin")
        if mode == "builtin" and not deleted and not meta.get("deletionTimestamp"):
            if key not in self._tasks:
                self._tasks[key] = asyncio.create_task(
                    self._loop(key), name=f"autoscale {key[0]}/{key[1]}"
                )
        elif task := self._tasks.pop(key, None):
            task.cancel()
            self._memory.pop(meta.get("uid", ""), None)

    async def _loop(self, key: k.Key) -> None:
        while True:
            await asyncio.sleep(self._interval)
            try:
                await self.step(key)
            except Exception:
                logger.exception("%s/%s: autoscaling step failed", *key)

    async def step(self, key: k.Key) -> ScaleDecision | None:
        """One scrape and decision; None when there is nothing to scale."""
        namespace, name = key
        url = k.resource_url(f"{GROUP}/{VERSION}", PLURAL, namespace, name)
        isvc = await self._api.get(url)
        if isvc is None or isvc["metadata"].get("deletionTimestamp"):
            return None
        try:
            spec = parse_spec(name, isvc.get("spec"))
        except SpecError:
            return None  # the reconciler reports it; the last decision stands
        if spec.autoscaling.mode != "builtin":
            return None
        status = isvc.get("status") or {}
        # What the reconciler applies to the engine Deployment.
        current = engine_replicas(spec, status.get("desiredReplicas"))

        pods = await list_pods(self._api, namespace, name)

        def of(component: str) -> list[dict[str, Any]]:
            return [p for p in pods if p["metadata"]["labels"].get(LABEL_COMPONENT) == component]

        engines = ready_targets(of("engine"), ENGINE_PORT)
        metrics, (held, silent_routers) = await asyncio.gather(
            self._scraper.engines(engines),
            self._scraper.held_requests(ready_targets(of("router"), ROUTER_PORT)),
        )
        now = self._clock()
        uid = isvc["metadata"]["uid"]
        history, last_active = self._memory.get(uid) or load_memory(status)
        if last_active is None:
            # Never seen busy: the idle time counts from the first look, so a new endpoint keeps
            # its replica for the whole scale-to-zero delay.
            last_active = now
        decision = decide(
            current,
            metrics,
            policy_of(spec.autoscaling),
            history,
            last_active,
            now,
            held_requests=held,
            starting=max(0, current - len(engines)),
        )
        logger.debug(
            "%s/%s: %d -> %d: %s", namespace, name, current, decision.replicas, decision.reason
        )
        self._memory[uid] = (decision.history, decision.last_active)
        patch = status_update(
            status, current, decision, decision.unanswered + tuple(silent_routers), now
        )
        if patch:
            try:
                await self._api.merge_patch(f"{url}/status", {"status": patch})
            except k.APINotFoundError:
                return None  # deleted meanwhile
        if decision.replicas != current:
            message = f"engine replicas {current} -> {decision.replicas}: {decision.reason}"
            logger.info("%s/%s: %s", namespace, name, message)
            kopf.event(isvc, type="Normal", reason="Scaled", message=message)
        return decision

    async def stop(self) -> None:
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._scraper.close()
