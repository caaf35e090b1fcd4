"""Reconciliation: kopf handlers, a per-object work queue, and the API calls of one reconcile.

Level-triggered: any change of an InferenceService or of one of its children (Deployments,
Services, ConfigMaps, RBAC objects, pods) queues that InferenceService, and a reconcile compares
everything desired with everything live. An event that repeats what was seen (a relist) queues
nothing, but a relist that misses a child does (watch_memory). Only kopf's silent ``on.event``
handlers are used: kopf then stores nothing on the objects (no finalizers, no progress
annotations), so an object in the desired state sees no writes at all, and deletion is left to
Kubernetes' garbage collector through the owner references.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import kopf
from prometheus_client import Counter

from kvfleet.operator import kube, service_metrics
from kvfleet.operator.adapter_sync import AdapterSync, adapter_status
from kvfleet.operator.adapters import adapter_paths
from kvfleet.operator.admission import policy_violations
from kvfleet.operator.api import (
    GROUP,
    LABEL_COMPONENT,
    LABEL_ISVC,
    LABEL_MANAGED_BY,
    MANAGED_BY,
    PLURAL,
    PLURALS,
    VERSION,
)
from kvfleet.operator.autoscaler import Autoscaler
from kvfleet.operator.backoff import backoff_delay
from kvfleet.operator.drift import excess, in_sync
from kvfleet.operator.pods import list_pods
from kvfleet.operator.resources import (
    ChildRef,
    OperatorConfig,
    Owner,
    build_children,
    engine_name,
    engine_selector,
    optional_children,
    router_name,
    service_url,
)
from kvfleet.operator.spec import (
    MSG_SCALE_BUILTIN,
    InferenceServiceSpec,
    SpecError,
    engine_deployment_replicas,
    fp8_cpu_warning,
    fp8_gpu_problem,
    parse_spec,
    served_model_name,
)
from kvfleet.operator.status import (
    Observed,
    Problem,
    compute_status,
    status_patch,
    transition_events,
)
from kvfleet.operator.status_writer import StatusWriter
from kvfleet.operator.watch_memory import Collection, WatchMemory

logger = logging.getLogger("kvfleet.operator")


# (group, version, plural) of every kind of child, watched to restore edits and follow status.
CHILD_RESOURCES = (
    ("apps", "v1", "deployments"),
    ("", "v1", "services"),
    ("", "v1", "configmaps"),
    ("", "v1", "serviceaccounts"),
    ("rbac.authorization.k8s.io", "v1", "roles"),
    ("rbac.authorization.k8s.io", "v1", "rolebindings"),
    ("policy", "v1", "poddisruptionbudgets"),
    ("", "v1", "pods"),
)


# Labelled from the start, so that a first failure is an increase too.
RECONCILE_FAILURE_REASONS = ("ApplyFailed", "NameConflict", "AddedFieldsKept", "Error")
RECONCILE_FAILURES = Counter(
    "kvfleet_operator_reconcile_failures",
    "Reconciles that failed and are retried with backoff, by cause: the first child problem's "
    "reason (ApplyFailed, NameConflict, AddedFieldsKept), or Error (an unexpected exception, "
    "logged with its traceback).",
    ["reason"],
)
for _reason in RECONCILE_FAILURE_REASONS:
    RECONCILE_FAILURES.labels(_reason)


# How long the events of a relist may pause before it counts as over (watch_memory): longer
# than kopf takes to hand a listed collection to the handlers, so that a late object costs at
# most a reconcile more; a deletion no event reported is reconciled this much after its relist.
RELIST_SETTLE_S = 5.0


class RetryLater(Exception):
    """The reconcile did what it could and recorded why it is not done; try again later.
    reason: the first problem's, the failure counter's label."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


class WorkQueue:
    """At most one reconcile per key at a time; events arriving meanwhile coalesce into one rerun.

    A failed reconcile is retried with exponential backoff and jitter, per key: after n failures
    in a row the next attempt waits ``backoff * 2**(n-1)`` (at most ``max_backoff``) times a
    random factor in [0.5, 1]. Only an urgent event (a change of the object itself, by someone
    else) cuts the wait short; the others (its children's, which a failing reconcile may cause
    itself) wait for it to end. Only a success resets the count.
    """

    def __init__(
        self,
        work: Callable[[kube.Key], Awaitable[None]],
        *,
        debounce: float = 0.1,
        backoff: float = 1.0,
        max_backoff: float = 300.0,
    ) -> None:
        self._work = work
        self._debounce = debounce
        self._backoff = backoff
        self._max_backoff = max_backoff
        # Per key: any event since the last start, and an urgent one since then.
        self._dirty: dict[kube.Key, tuple[asyncio.Event, asyncio.Event]] = {}
        self._tasks: dict[kube.Key, asyncio.Task[None]] = {}

    def enqueue(self, key: kube.Key, *, urgent: bool = True) -> None:
        if key not in self._tasks:
            self._dirty[key] = (asyncio.Event(), asyncio.Event())
            self._tasks[key] = asyncio.create_task(
                self._run(key), name=f"reconcile {key[0]}/{key[1]}"
            )
        dirty, hurry = self._dirty[key]
        dirty.set()
        if urgent:
            hurry.set()

    async def _run(self, key: kube.Key) -> None:
        dirty, hurry = self._dirty[key]
        failures = 0
        try:
            while dirty.is_set():
                # A create or a rollout fires a burst of child events: let it settle first.
                await asyncio.sleep(self._debounce)
                dirty.clear()
                hurry.clear()
                try:
                    await self._work(key)
                    failures = 0
                except Exception as e:
                    failures += 1
                    RECONCILE_FAILURES.labels(
                        e.reason if isinstance(e, RetryLater) else "Error"
                    ).inc()
                    delay = backoff_delay(failures, self._backoff, self._max_backoff)
                    if isinstance(e, RetryLater | kube.APIError):
                        # Expected in operation (an API answer, a wait): one line, no traceback.
                        logger.warning("%s/%s: %s; retrying in %.1fs", *key, e, delay)
                    else:
                        logger.exception("%s/%s: reconcile failed; retrying in %.1fs", *key, delay)
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(hurry.wait(), timeout=delay)
                    dirty.set()
        finally:
            del self._tasks[key]
            del self._dirty[key]

    async def stop(self) -> None:
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _child_url(obj: dict[str, Any]) -> str:
    meta = obj["metadata"]
    return kube.resource_url(
        obj["apiVersion"], PLURALS[obj["kind"]], meta["namespace"], meta["name"]
    )


def _controlled_by(obj: dict[str, Any], uid: str) -> bool:
    return any(
        ref.get("uid") == uid and ref.get("controller")
        for ref in obj.get("metadata", {}).get("ownerReferences") or []
    )


class ChildConflict(Exception):
    pass


class AddedFieldsKept(Exception):
    """Something (a mutating admission webhook) adds back what the operator removes."""


class Reconciler:
    def __init__(
        self,
        api: kube.Kube,
        config: OperatorConfig,
        status: StatusWriter,
        clock: Callable[[], datetime.datetime] = lambda: datetime.datetime.now(datetime.UTC),
        adapter_sync: AdapterSync | None = None,
    ) -> None:
        self._api = api
        self._config = config
        self._status = status
        self._clock = clock
        self._adapters = adapter_sync or AdapterSync()
        # Per service: (uid, autoscaling mode, spec.replicas) as the last reconcile saw them.
        self._spec_replicas_seen: dict[kube.Key, tuple[str, str, int | None]] = {}
        # Per service: (uid, generation) of the spec last warned about, so a warning that holds
        # for a spec is an Event once, not one per reconcile.
        self._warned: dict[kube.Key, tuple[str, int]] = {}

    async def reconcile(self, key: kube.Key) -> None:
        namespace, name = key
        url = kube.resource_url(f"{GROUP}/{VERSION}", PLURAL, namespace, name)
        isvc = await self._api.get(url)
        if isvc is None or isvc["metadata"].get("deletionTimestamp"):
            self._spec_replicas_seen.pop(key, None)
            self._warned.pop(key, None)
            self._status.forget(key)
            service_metrics.forget_status(key)
            return  # the garbage collector removes the children
        owner = Owner(name=name, namespace=namespace, uid=isvc["metadata"]["uid"])
        previous = isvc.get("status") or {}

        spec_error: str | None = None
        problems: list[Problem] = []
        # The engine Deployment's replicas, when this reconcile applies a spec.
        deployment_replicas: int | None = None
        try:
            spec = parse_spec(name, isvc.get("spec"))
        except SpecError as e:
            spec, spec_error = None, str(e)
            logger.warning("%s/%s: invalid spec: %s", namespace, name, e)
        refused = [
            Problem(v.reason, v.message)
            for v in (policy_violations(spec, self._config) if spec is not None else [])
        ]
        if spec is not None and (fp8 := fp8_gpu_problem(spec)) is not None:
            # The engine would exit at start-up on these GPUs: keep the last applied spec.
            refused.append(Problem("FP8Unsupported", fp8))
        for problem in refused:
            logger.warning("%s/%s: not applied: %s", namespace, name, problem.message)
        if spec is not None:
            self._refuse_scale_request(key, isvc, spec)
            self._warn_once(key, isvc, "FP8OnCPU", fp8_cpu_warning(spec))
        if spec is not None and not refused:
            deployment_replicas = engine_deployment_replicas(spec, previous.get("desiredReplicas"))
            live, problems = await self._converge(owner, spec, deployment_replicas)
        else:
            # Nothing is applied; the children of the last applied spec keep serving.
            live = await self._existing(owner)
        pods = await list_pods(self._api, namespace, name)
        adapters: list[dict[str, Any]] = []
        if (
            spec is not None
            and deployment_replicas is not None
            and spec.adapters
            # With an API key, adapter edits roll the engines instead (resources.py).
            and spec.api_key_secret_ref is None
        ):
            adapter_problems, adapters = await self._sync_adapters(spec, pods)
            problems += adapter_problems
        observed = Observed(
            generation=isvc["metadata"].get("generation", 0),
            selector=engine_selector(name),
            previous=previous,
            spec_error=spec_error,
            refused=refused,
            child_problems=problems,
            desired_replicas=deployment_replicas,
            model_name=served_model_name(spec) if spec is not None else None,
            url=service_url(owner) if live.get(f"Service/{name}") else None,
            engine=live.get(f"Deployment/{engine_name(name)}"),
            router=live.get(f"Deployment/{router_name(name)}"),
            pods=pods,
            adapters=adapters,
        )
        status = compute_status(observed, self._clock())
        service_metrics.record_status(key, status)
        patch = status_patch(previous, status)
        if patch:
            try:
                await self._status.write(key, isvc, patch)
            except kube.APINotFoundError:
                return  # deleted meanwhile
        for event in transition_events(previous.get("conditions") or [], status["conditions"]):
            kube.post_event(isvc, type=event.type, reason=event.reason, message=event.message)
        if problems:
            raise RetryLater("; ".join(p.message for p in problems), problems[0].reason)

    async def _sync_adapters(
        self, spec: InferenceServiceSpec, pods: list[dict[str, Any]]
    ) -> tuple[list[Problem], list[dict[str, Any]]]:
        """Load and unload adapters in the ready engine pods as spec.adapters says; what failed,
        and status.adapters."""
        desired = adapter_paths(spec)
        engines = [
            p for p in pods if (p["metadata"].get("labels") or {}).get(LABEL_COMPONENT) == "engine"
        ]
        synced = await self._adapters.sync(engines, desired)
        problems = [
            Problem("AdapterNotLoaded", f"adapter {name} on engine pod {p.pod}: {message}")
            for p in synced
            for name, message in p.failures.items()
        ]
        return problems, adapter_status(desired, synced)

    async def close(self) -> None:
        await self._adapters.close()

    def _refuse_scale_request(
        self, key: kube.Key, isvc: dict[str, Any], spec: InferenceServiceSpec
    ) -> None:
        """Say so when spec.replicas is set or changed in builtin mode (``kubectl scale``),
        where the autoscaler's decision overrides it.

        The CRD's transition rule refuses that update; this covers an API server that does not
        enforce it. A restarted operator has not seen the previous value and says nothing.
        """
        seen = (isvc["metadata"]["uid"], spec.autoscaling.mode, spec.replicas)
        before = self._spec_replicas_seen.get(key)
        self._spec_replicas_seen[key] = seen
        if (
            before is not None
            and before[0] == seen[0]
            and before[1] == seen[1] == "builtin"
            and spec.replicas is not None
            and before[2] != spec.replicas
        ):
            logger.warning("%s/%s: replicas %s ignored: %s", *key, spec.replicas, MSG_SCALE_BUILTIN)
            kube.post_event(isvc, type="Warning", reason="ScaleIgnored", message=MSG_SCALE_BUILTIN)

    def _warn_once(
        self, key: kube.Key, isvc: dict[str, Any], reason: str, message: str | None
    ) -> None:
        """A Warning Event for something a spec asks that works but may surprise, once per
        spec generation."""
        if message is None:
            return
        seen = (isvc["metadata"]["uid"], isvc["metadata"].get("generation", 0))
        if self._warned.get(key) == seen:
            return
        self._warned[key] = seen
        logger.warning("%s/%s: %s", *key, message)
        kube.post_event(isvc, type="Warning", reason=reason, message=message)

    async def _converge(
        self, owner: Owner, spec: InferenceServiceSpec, deployment_replicas: int
    ) -> tuple[dict[str, dict[str, Any]], list[Problem]]:
        """Apply every desired child and remove the ones no longer desired.

        Returns the live children by "Kind/name" and what went wrong; one failing child does not
        stop the others.
        """
        live: dict[str, dict[str, Any]] = {}
        problems: list[Problem] = []
        desired = build_children(owner, spec, self._config, deployment_replicas)
        for obj in desired:
            label = f"{obj['kind']}/{obj['metadata']['name']}"
            try:
                live[label] = await self._ensure(obj, owner)
            except ChildConflict as e:
                problems.append(Problem("NameConflict", str(e)))
            except AddedFieldsKept as e:
                problems.append(Problem("AddedFieldsKept", str(e)))
            except kube.APIError as e:
                problems.append(Problem("ApplyFailed", f"{label}: {e}"))
        wanted = {f"{obj['kind']}/{obj['metadata']['name']}" for obj in desired}
        for ref in optional_children(owner):
            if f"{ref.kind}/{ref.name}" not in wanted:
                try:
                    await self._remove(ref, owner)
                except kube.APIError as e:
                    problems.append(Problem("ApplyFailed", f"{ref.kind}/{ref.name}: {e}"))
        return live, problems

    async def _existing(self, owner: Owner) -> dict[str, dict[str, Any]]:
        """The children the status is computed from, as they are."""
        found = {}
        for kind, api_version, name in (
            ("Deployment", "apps/v1", engine_name(owner.name)),
            ("Deployment", "apps/v1", router_name(owner.name)),
            ("Service", "v1", owner.name),
        ):
            url = kube.resource_url(api_version, PLURALS[kind], owner.namespace, name)
            if (obj := await self._api.get(url)) is not None:
                found[f"{kind}/{name}"] = obj
        return found

    async def _ensure(self, obj: dict[str, Any], owner: Owner) -> dict[str, Any]:
        """Create the child, or bring the live one back to the desired state; return it.

        Both are one server-side apply, which creates a missing object: the operator's field
        manager then owns every field from the start, so a field later dropped from the desired
        object is removed by the next apply. Two operator replicas applying at once agree.
        """
        url = _child_url(obj)
        label = f"{obj['kind']} {owner.namespace}/{obj['metadata']['name']}"
        current = await self._api.get(url)
        if current is not None:
            if not _controlled_by(current, owner.uid):
                raise ChildConflict(f"{label} exists and is not owned by this InferenceService")
            if current["metadata"].get("deletionTimestamp"):
                return current
        if current is None or not in_sync(obj, current):
            logger.info("%s %s", "updating" if current else "creating", label)
            current = await self._api.apply(url, obj)
        # The apply leaves what other managers added; where that changes what the child does,
        # it is removed (drift.excess says where and why not by the apply).
        if (extra := excess(obj, current)) is not None:
            logger.warning("%s: removing what was added to %s", label, ", ".join(extra.paths))
            current = await self._api.merge_patch(url, extra.patch)
            if (kept := excess(obj, current)) is not None:
                # Removing it again at once would fight the webhook in a hot loop: the
                # reconcile's backoff paces the retries and the condition says why.
                raise AddedFieldsKept(
                    f"{label}: the API server adds back {', '.join(kept.paths)} "
                    "(a mutating admission webhook?); set them in spec.scheduling"
                )
        return current

    async def _remove(self, ref: ChildRef, owner: Owner) -> None:
        url = kube.resource_url(ref.api_version, ref.plural, owner.namespace, ref.name)
        current = await self._api.get(url)
        if current is not None and _controlled_by(current, owner.uid):
            logger.info(
                "deleting %s %s/%s: the spec no longer needs it",
                ref.kind,
                owner.namespace,
                ref.name,
            )
            await self._api.delete(url)


def _reconcile_input(body: kopf.Body) -> object:
    """What of an InferenceService a reconcile acts on: everything but the status, which the
    operator writes itself (its own writes must not trigger reconciles, or each failed one
    would retry at once), except the autoscaler's decision, which the reconcile applies."""
    meta = {
        key: value
        for key, value in (body.get("metadata") or {}).items()
        if key not in ("resourceVersion", "managedFields")
    }
    return meta, body.get("spec"), (body.get("status") or {}).get("desiredReplicas")


def register(
    registry: kopf.OperatorRegistry,
    settings: kopf.OperatorSettings,
    queue: WorkQueue,
    autoscaler: Autoscaler,
    *,
    relist_settle: float = RELIST_SETTLE_S,
) -> None:
    """Wire the kopf handlers that feed the queue and start or stop the autoscaling loops;
    settings gain server-side label selectors.

    An event queues a reconcile only when its object changed since the operator last saw it
    (watch_memory): a relist repeats every object, and a relist that changes nothing must cost
    nothing. relist_settle: how long a relist's events may pause before it counts as over, and
    the objects it did not bring as deleted."""
    memory = WatchMemory()
    ends: dict[Collection, asyncio.TimerHandle] = {}

    def end_relist(collection: Collection) -> None:
        del ends[collection]
        for owner in memory.end_relist(collection):
            logger.info("%s/%s: %s gone from a relist: reconciling", *owner, collection[0])
            queue.enqueue(owner, urgent=False)

    def changed(
        plural: str,
        event_type: str | None,
        body: kopf.Body,
        owner: kube.Key,
        content: object = None,
    ) -> bool:
        """Remember the event; whether its owner needs a reconcile."""
        collection, name = (plural, body.metadata.namespace or ""), body.metadata.name or ""
        if event_type == "DELETED":
            memory.forget(collection, name)
            return True
        version = body.metadata.get("resourceVersion")
        seen = memory.observe(collection, name, owner, event_type, version, content)
        if seen.relisting:
            if handle := ends.pop(collection, None):
                handle.cancel()
            ends[collection] = asyncio.get_running_loop().call_later(
                relist_settle, end_relist, collection
            )
        return seen.changed

    # async: kopf runs sync handlers in threads, and the queue belongs to the event loop.
    @kopf.on.event(GROUP, VERSION, PLURAL, registry=registry)
    async def inference_service_event(
        name: str, namespace: str | None, type: str | None, body: kopf.Body, **_: Any
    ) -> None:
        key = (namespace or "", name)  # None only for cluster-scoped kinds
        autoscaler.track(key, body, deleted=type == "DELETED")
        if changed(PLURAL, type, body, key, _reconcile_input(body)):
            queue.enqueue(key)

    def child_event(plural: str) -> Callable[..., Awaitable[None]]:
        async def handler(
            labels: kopf.Labels, namespace: str, type: str | None, body: kopf.Body, **_: Any
        ) -> None:
            if (owner := labels.get(LABEL_ISVC)) and changed(
                plural, type, body, (namespace, owner)
            ):
                # Not urgent: a failing reconcile's own writes to children must not cut its
                # backoff short.
                queue.enqueue((namespace, owner), urgent=False)

        return handler

    managed = {LABEL_MANAGED_BY: MANAGED_BY}
    for group, version, plural in CHILD_RESOURCES:
        # Server-side, so the operator is not sent every pod of the cluster; the handler's own
        # filter repeats it for API servers (and emulators) that ignore the selector.
        settings.watching.label_selectors[group, version, plural] = (
            f"{LABEL_MANAGED_BY}={MANAGED_BY}"
        )
        kopf.on.event(
            group, version, plural, labels=managed, id=f"child-{plural}", registry=registry
        )(child_event(plural))

    @kopf.on.cleanup(registry=registry)
    async def stop_queue(**_: Any) -> None:
        for handle in ends.values():
            handle.cancel()
        await autoscaler.stop()
        await queue.stop()
