"""An InferenceService's status, computed from what its children report. Pure: no I/O.

Three conditions (metav1.Condition, each with observedGeneration): Ready (requests are served:
the router and an engine replica are ready and have a pod IP), Progressing (a rollout is under
way) and Degraded (something needs a human). Ready describes serving, not the spec: when a spec
change is invalid or refused the previous children keep serving (Ready=True) while
Degraded=True says why the change was not applied. docs/crd.md#status lists every reason.
"""

from __future__ import annotations

import contextlib
import datetime
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvfleet.operator.api import LABEL_COMPONENT

# Degraded reasons, most urgent first: the condition shows the first found, its message all.
SEVERITY = (
    "InvalidSpec",
    "ImageNotAllowed",
    "SecretNotAllowed",
    "FP8Unsupported",
    "NameConflict",
    "ApplyFailed",
    "AddedFieldsKept",
    "ImagePullError",
    "ContainerConfigError",
    "ModelDownloadFailed",
    "AdapterNotLoaded",
    "CrashLoopBackOff",
    "ReplicaFailure",
    "ProgressDeadlineExceeded",
    "Unschedulable",
    "PodWithoutIP",
)
IMAGE_PULL_REASONS = frozenset({"ErrImagePull", "ImagePullBackOff", "InvalidImageName"})
CONFIG_REASONS = frozenset({"CreateContainerConfigError", "CreateContainerError"})
MAX_PROBLEMS_SHOWN = 3
# A container's termination message, as the Degraded condition quotes it (the kubelet keeps up
# to 4096 bytes of it).
MAX_TERMINATION_CHARS = 300
# Status keys this module owns; others (lastScaleDecision: the autoscaler's) are left alone.
OWNED_KEYS = (
    "observedGeneration",
    "replicas",
    "readyReplicas",
    "desiredReplicas",
    "selector",
    "url",
    "modelName",
    "adapters",
    "conditions",
)


@dataclass(frozen=True)
class Problem:
    reason: str
    message: str


@dataclass(frozen=True)
class Observed:
    """Everything the status is computed from, gathered by the reconciler."""

    generation: int
    selector: str
    previous: Mapping[str, Any]  # the live .status
    spec_error: str | None = None
    # Why the operator's allow-lists keep a valid spec from being applied.
    refused: Sequence[Problem] = ()
    child_problems: Sequence[Problem] = ()
    desired_replicas: int | None = None
    model_name: str | None = None
    url: str | None = None  # set once the router Service exists
    engine: Mapping[str, Any] | None = None  # the live engine Deployment
    router: Mapping[str, Any] | None = None  # the live router Deployment
    pods: Sequence[Mapping[str, Any]] = field(default_factory=tuple)
    # status.adapters of an applied spec (adapter_sync.adapter_status); while a spec is not
    # applied, the previous one stays.
    adapters: Sequence[Mapping[str, Any]] = ()


@dataclass(frozen=True)
class Event:
    type: str  # Normal | Warning
    reason: str
    message: str


def timestamp(now: datetime.datetime) -> str:
    return now.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _get(obj: Mapping[str, Any] | None, *path: str, default: Any = None) -> Any:
    for key in path:
        if not isinstance(obj, Mapping) or key not in obj:
            return default
        obj = obj[key]
    return obj


def _last_line(message: Any) -> str:
    """The last non-empty line of a termination message (a JSON log record's message, with
    --log-format json), at most MAX_TERMINATION_CHARS."""
    if not isinstance(message, str):
        return ""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    if not lines:
        return ""
    line = lines[-1]
    with contextlib.suppress(ValueError):
        record = json.loads(line)
        if isinstance(record, dict) and isinstance(record.get("message"), str):
            line = record["message"]
    if len(line) > MAX_TERMINATION_CHARS:
        line = line[: MAX_TERMINATION_CHARS - 3] + "..."
    return line


def _pod_problems(pod: Mapping[str, Any]) -> list[Problem]:
    name = _get(pod, "metadata", "name", default="?")
    component = _get(pod, "metadata", "labels", LABEL_COMPONENT, default="")
    where = f"{component} pod {name}".strip()
    problems = []
    for cond in _get(pod, "status", "conditions", default=[]) or []:
        if (cond.get("type"), cond.get("status"), cond.get("reason")) == (
            "PodScheduled",
            "False",
            "Unschedulable",
        ):
            problems.append(
                Problem("Unschedulable", f"{where} cannot be scheduled: {cond.get('message', '')}")
            )
    statuses = [
        (cs, True) for cs in _get(pod, "status", "initContainerStatuses", default=[]) or []
    ] + [(cs, False) for cs in _get(pod, "status", "containerStatuses", default=[]) or []]
    for cs, is_init in statuses:
        waiting = _get(cs, "state", "waiting")
        if not waiting:
            continue
        reason, detail = waiting.get("reason", ""), waiting.get("message", "")
        container = cs.get("name", "?")
        if reason in IMAGE_PULL_REASONS:
            problems.append(
                Problem(
                    "ImagePullError",
                    f"{where}: image {cs.get('image', '?')!r} cannot be pulled ({reason}): "
                    f"{detail}".rstrip(": "),
                )
            )
        elif reason in CONFIG_REASONS:
            problems.append(
                Problem("ContainerConfigError", f"{where}: container {container}: {detail}")
            )
        elif reason == "CrashLoopBackOff":
            last = _get(cs, "lastState", "terminated", default={}) or {}
            exit_info = f"last exit code {last.get('exitCode', '?')}"
            if last.get("reason"):
                exit_info += f" ({last['reason']})"
            if said := _last_line(last.get("message")):
                # The container's own reason: its termination-log line, or (FallbackToLogsOnError)
                # the last line it logged, such as a GPU without fp8.
                exit_info += f": {said}"
            if is_init:
                problems.append(
                    Problem(
                        "ModelDownloadFailed",
                        f"{where}: init container {container} keeps failing ({exit_info}); "
                        "see its logs",
                    )
                )
            else:
                problems.append(
                    Problem(
                        "CrashLoopBackOff",
                        f"{where}: container {container} is crash-looping ({exit_info})",
                    )
                )
    return problems


def _is_ready(pod: Mapping[str, Any]) -> bool:
    return any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in _get(pod, "status", "conditions", default=[]) or []
    )


def _without_ip(pods: Sequence[Mapping[str, Any]], component: str) -> list[str]:
    """The names of the component's Ready pods that have no pod IP: counted ready by their
    Deployment, reachable by nothing."""
    return [
        _get(pod, "metadata", "name", default="?")
        for pod in pods
        if _get(pod, "metadata", "labels", LABEL_COMPONENT) == component
        and not _get(pod, "metadata", "deletionTimestamp")
        and _is_ready(pod)
        and not _get(pod, "status", "podIP")  # podIPs[0], when set, is podIP
    ]


def _deployment_problems(dep: Mapping[str, Any] | None, component: str) -> list[Problem]:
    problems = []
    for cond in _get(dep, "status", "conditions", default=[]) or []:
        if cond.get("type") == "ReplicaFailure" and cond.get("status") == "True":
            problems.append(Problem("ReplicaFailure", f"{component}: {cond.get('message', '')}"))
        if (
            cond.get("type") == "Progressing"
            and cond.get("status") == "False"
            and cond.get("reason") == "ProgressDeadlineExceeded"
        ):
            problems.append(
                Problem("ProgressDeadlineExceeded", f"{component}: {cond.get('message', '')}")
            )
    return problems


def _rollout(dep: Mapping[str, Any] | None) -> str | None:
    """What a Deployment's rollout still waits for, or None when it is complete."""
    if dep is None:
        return "not created yet"
    want = _get(dep, "spec", "replicas", default=1)
    status = dep.get("status") or {}
    if _get(dep, "metadata", "generation", default=0) > status.get("observedGeneration", 0):
        return "waiting for the controller to see the new spec"
    updated = status.get("updatedReplicas", 0)
    total = status.get("replicas", 0)
    available = status.get("availableReplicas", 0)
    if updated < want:
        return f"{updated} of {want} replicas updated"
    if total > updated:
        return f"{total - updated} old replicas still terminating"
    # Once the new ReplicaSet has been available, the rollout is done: replicas lost later are a
    # Ready (and maybe Degraded) matter, not a rollout.
    done = any(
        c.get("type") == "Progressing" and c.get("reason") == "NewReplicaSetAvailable"
        for c in status.get("conditions") or []
    )
    if available < updated and not done:
        return f"{available} of {updated} updated replicas available"
    return None


def _condition(
    ctype: str,
    ok: bool,
    reason: str,
    message: str,
    obs: Observed,
    now: datetime.datetime,
) -> dict[str, Any]:
    status = "True" if ok else "False"
    prev = _find(obs.previous.get("conditions") or [], ctype)
    # lastTransitionTime moves only when the status flips, whatever happens to reason/message.
    since = (
        prev["lastTransitionTime"]
        if prev and prev.get("status") == status and prev.get("lastTransitionTime")
        else timestamp(now)
    )
    return {
        "type": ctype,
        "status": status,
        "observedGeneration": obs.generation,
        "lastTransitionTime": since,
        "reason": reason,
        "message": message,
    }


def _find(conditions: Sequence[Mapping[str, Any]], ctype: str) -> Mapping[str, Any] | None:
    return next((c for c in conditions if c.get("type") == ctype), None)


def _summary(problems: Sequence[Problem]) -> tuple[str, str]:
    ranked = sorted(problems, key=lambda p: SEVERITY.index(p.reason))
    messages = list(dict.fromkeys(p.message for p in ranked))
    shown = "; ".join(messages[:MAX_PROBLEMS_SHOWN])
    if len(messages) > MAX_PROBLEMS_SHOWN:
        shown += f"; and {len(messages) - MAX_PROBLEMS_SHOWN} more"
    return ranked[0].reason, shown


def compute_status(obs: Observed, now: datetime.datetime) -> dict[str, Any]:
    """The status fields the operator owns (OWNED_KEYS), None for those to remove."""
    problems: list[Problem] = []
    if obs.spec_error is not None:
        problems.append(Problem("InvalidSpec", obs.spec_error))
    problems += obs.refused
    problems += obs.child_problems
    problems += _deployment_problems(obs.engine, "engine")
    problems += _deployment_problems(obs.router, "router")
    pods = sorted(obs.pods, key=lambda p: _get(p, "metadata", "name", default=""))
    for pod in pods:
        if not _get(pod, "metadata", "deletionTimestamp"):
            problems += _pod_problems(pod)
    engines_without_ip = _without_ip(pods, "engine")
    routers_without_ip = _without_ip(pods, "router")
    unreachable = [f"engine pod {n}" for n in engines_without_ip] + [
        f"router pod {n}" for n in routers_without_ip
    ]
    problems += [
        Problem("PodWithoutIP", f"{where} is Ready but has no pod IP, so nothing reaches it")
        for where in unreachable
    ]

    # Why the spec is not applied: the first of these problems, None when it is.
    not_applied = (
        "InvalidSpec"
        if obs.spec_error is not None
        else obs.refused[0].reason
        if obs.refused
        else None
    )
    engine_ready = _get(obs.engine, "status", "readyReplicas", default=0) or 0
    router_ready = _get(obs.router, "status", "readyReplicas", default=0) or 0
    engine_want = _get(obs.engine, "spec", "replicas", default=0)
    router_want = _get(obs.router, "spec", "replicas", default=0)
    counts = (
        f"{engine_ready} of {engine_want} engine and {router_ready} of {router_want} router "
        "replicas ready"
    )
    if unreachable:
        counts += f"; without a pod IP: {', '.join(unreachable)}"
    # The ready replicas that have an address (the pods are listed after the Deployments were
    # read, so this may be off by a pod that changed meanwhile; the next event reconciles).
    engine_serving = max(0, engine_ready - len(engines_without_ip))
    router_serving = max(0, router_ready - len(routers_without_ip))
    if engine_serving >= 1 and router_serving >= 1:
        ready = _condition("Ready", True, "Serving", counts, obs, now)
    elif obs.engine is None or obs.router is None:
        reason = not_applied or "Creating"
        ready = _condition("Ready", False, reason, "the children do not all exist yet", obs, now)
    elif engine_want == 0:
        ready = _condition(
            "Ready", False, "ScaledToZero", "no engine replicas are running", obs, now
        )
    elif engine_serving == 0:
        reason = "EngineWithoutIP" if engine_ready else "EngineNotReady"
        ready = _condition("Ready", False, reason, counts, obs, now)
    else:
        reason = "RouterWithoutIP" if router_ready else "RouterNotReady"
        ready = _condition("Ready", False, reason, counts, obs, now)

    if not_applied is not None:
        progressing = _condition(
            "Progressing",
            False,
            not_applied,
            "the spec is not applied: see the Degraded condition",
            obs,
            now,
        )
    else:
        rolling = [
            f"{component}: {msg}"
            for component, dep in (("engine", obs.engine), ("router", obs.router))
            if (msg := _rollout(dep)) is not None
        ]
        progressing = (
            _condition("Progressing", True, "RollingOut", "; ".join(rolling), obs, now)
            if rolling
            else _condition("Progressing", False, "RolloutComplete", "", obs, now)
        )

    if problems:
        reason, message = _summary(problems)
        degraded = _condition("Degraded", True, reason, message, obs, now)
    else:
        degraded = _condition("Degraded", False, "Healthy", "", obs, now)

    prev = obs.previous
    return {
        "observedGeneration": obs.generation,
        "replicas": _get(obs.engine, "status", "replicas", default=0) or 0,
        "readyReplicas": engine_ready,
        "desiredReplicas": (
            obs.desired_replicas
            if obs.desired_replicas is not None
            else prev.get("desiredReplicas")
        ),
        "selector": obs.selector,
        "url": obs.url,
        "modelName": obs.model_name if obs.model_name is not None else prev.get("modelName"),
        "adapters": list(obs.adapters) or None if not_applied is None else prev.get("adapters"),
        "conditions": [ready, progressing, degraded],
    }


def _outcome(conditions: Sequence[Mapping[str, Any]] | None) -> list[tuple[Any, ...]]:
    return [(c.get("type"), c.get("status"), c.get("reason")) for c in conditions or []]


def status_patch(previous: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """The merge patch that turns the live status into the computed one; empty when nothing
    worth a write changed.

    A condition's message alone is not worth one: messages carry details that change from one
    attempt to the next (an API server's error text, counts during a rollout), and a write per
    new message is a watch event per failed reconcile. A write made for anything else carries
    the current messages along.
    """
    patch: dict[str, Any] = {}
    for key in OWNED_KEYS:
        value = new.get(key)
        if value is None:
            if previous.get(key) is not None:
                patch[key] = None
        elif key == "conditions" and _outcome(previous.get(key)) == _outcome(value):
            continue
        elif previous.get(key) != value:
            patch[key] = value
    if patch and "conditions" not in patch and previous.get("conditions") != new["conditions"]:
        patch["conditions"] = new["conditions"]
    return patch


def transition_events(
    previous: Sequence[Mapping[str, Any]], current: Sequence[Mapping[str, Any]]
) -> list[Event]:
    """Kubernetes Events for condition changes worth a line in ``kubectl describe``."""
    events = []
    for cond in current:
        old = _find(previous, cond["type"])
        old_status = old.get("status") if old else None
        if old is not None and (old_status, old.get("reason")) == (cond["status"], cond["reason"]):
            continue
        is_true = cond["status"] == "True"
        match cond["type"]:
            case "Degraded" if is_true:
                events.append(Event("Warning", cond["reason"], cond["message"]))
            case "Degraded" if old_status == "True":
                events.append(Event("Normal", "Recovered", "no failures remain"))
            case "Ready" if is_true:
                events.append(Event("Normal", "Ready", cond["message"]))
            case "Ready" if old_status == "True":
                events.append(Event("Warning", cond["reason"], cond["message"]))
            case "Progressing" if is_true and old_status != "True":
                events.append(Event("Normal", "RollingOut", cond["message"]))
            case "Progressing" if not is_true and old_status == "True":
                events.append(Event("Normal", cond["reason"], cond["message"] or "rollout done"))
    return events
