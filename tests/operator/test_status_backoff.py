"""Issue 17: backoff that holds. Status is written only when a condition's type, status or reason
changes; a failing reconcile backs off per service, and neither its own status writes nor its
children's events cut the wait short; transient API errors on an apply are retried quietly; a
`kubectl scale` in builtin mode is never silently ignored. Issue 36: writes that keep failing
come further and further apart, and converge once they succeed. Faults are injected into the
emulator (tests/support/kmock.py) before it stores a write."""

from __future__ import annotations

import asyncio
import copy
import datetime
import itertools
import logging
from typing import Any

import pytest

from kvfleet.operator.api import PLURALS
from kvfleet.operator.main import build_registry, build_settings
from kvfleet.operator.spec import MSG_SCALE_BUILTIN
from kvfleet.operator.status import Observed, Problem, compute_status, status_patch
from tests.support.kmock import (
    CONFIG,
    DEMO,
    DEPLOYMENTS,
    EVENTS,
    ISVCS,
    NS,
    APIServer,
    Fault,
    api,
    by_operator,
    child_names,
    children_of,
    condition,
    create,
    eventually,
    kube_for,
    operator,
    run_operator,
    settled,
    url,
    writes,
)

NOW = datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=datetime.UTC)
# The stated bound: a service whose reconcile keeps failing is reconciled at most this often in
# its first 20 s, with the operator's default backoff (1 s, doubling, times a jitter in
# [0.5, 1]: attempts at 0 and at most 0.5 + 1 + 2 + 4 + 8 = 15.5 s later, the next one >= 31.5 s).
WINDOW_S = 20.0
MAX_RECONCILES = 6
# One reconcile of the demo service: the InferenceService, each of its 7 children (read, and
# written when missing), the pods.
MAX_REQUESTS_PER_RECONCILE = 1 + 2 * 7 + 1


def status_with(previous: dict[str, Any], **observed: Any) -> dict[str, Any]:
    return compute_status(
        Observed(generation=1, selector="app=x", previous=previous, **observed), NOW
    )


def test_a_new_message_alone_is_no_reason_to_write_the_status():
    first = status_with({}, child_problems=[Problem("ApplyFailed", "Deployment/x: denied #1")])
    again = status_with(first, child_problems=[Problem("ApplyFailed", "Deployment/x: denied #2")])
    assert status_patch(first, again) == {}
    # Another reason is written, with its message.
    patch = status_patch(first, status_with(first, spec_error="spec.x: bad"))
    degraded = next(c for c in patch["conditions"] if c["type"] == "Degraded")
    assert (degraded["reason"], degraded["message"]) == ("InvalidSpec", "spec.x: bad")
    # A write made for another field carries the new messages along.
    patch = status_patch(first, dict(again, url="http://x.team-a.svc/v1"))
    assert set(patch) == {"url", "conditions"}
    assert "denied #2" in next(c for c in patch["conditions"] if c["type"] == "Degraded")["message"]


def status_writes(k: APIServer, name: str, since: int = 0) -> list[dict[str, Any]]:
    return [
        r.data["status"]
        for r in by_operator(k, since)
        if r.method.value == "PATCH" and r.url.path == url(ISVCS, name, "status")
    ]


def warnings(k: APIServer, name: str) -> list[dict[str, Any]]:
    return [
        e for e in k.every(EVENTS) if e["involvedObject"]["name"] == name and e["type"] == "Warning"
    ]


@pytest.mark.asyncio
async def test_a_changing_error_message_does_not_defeat_the_backoff(cluster):
    k = cluster
    counter = itertools.count(1)
    k.inject(
        Fault(
            "PATCH",
            url(DEPLOYMENTS, "demo-engine"),
            422,
            times=None,
            message=lambda n: f"admission webhook denied the request (attempt {next(counter)})",
        )
    )
    settings = build_settings()
    # The operator's default backoff; no autoscaling step within the window.
    registry = build_registry(
        settings, CONFIG, debounce=0.02, backoff=1.0, autoscale_interval=3600, kube=kube_for(k)
    )
    async with run_operator(registry, settings):
        mark = len(k)
        await create(k, DEMO, "demo")
        await asyncio.sleep(WINDOW_S)
        end = len(k)

        # The service's own requests (kopf's watches and discovery are the operator's, shared).
        requests = [
            r for r in by_operator(k, mark) if r.id < end and f"/namespaces/{NS}/" in r.url.path
        ]
        reconciles = [
            r for r in requests if r.method.value == "GET" and r.url.path == url(ISVCS, "demo")
        ]
        assert 3 <= len(reconciles) <= MAX_RECONCILES, len(reconciles)
        assert len(requests) <= MAX_RECONCILES * MAX_REQUESTS_PER_RECONCILE + 2, len(requests)
        # One status write (Degraded, the first message) and one Warning, however many messages.
        written = status_writes(k, "demo", mark)
        assert len(written) == 1
        degraded = condition(k.live(ISVCS, NS, "demo"), "Degraded")
        assert (degraded["status"], degraded["reason"]) == ("True", "ApplyFailed")
        assert "(attempt 1)" in degraded["message"]
        assert [e["reason"] for e in warnings(k, "demo")] == ["ApplyFailed"]

        # A change of the object itself cuts the backoff short; the fault gone, it recovers.
        k.faults.clear()
        await api(k, "patch", url(ISVCS, "demo"), {"metadata": {"labels": {"team": "a"}}})
        await eventually(
            lambda: condition(k.live(ISVCS, NS, "demo"), "Degraded").get("status") == "False",
            timeout=5,
        )
        await settled(k)


@pytest.mark.asyncio
async def test_transient_errors_on_an_apply_are_retried_quietly(cluster):
    k = cluster
    unavailable = k.inject(
        Fault("PATCH", url(DEPLOYMENTS, "demo-engine"), 503, 2, headers={"Retry-After": "0"})
    )
    conflict = k.inject(Fault("PATCH", url(DEPLOYMENTS, "demo-router"), 409, 2))
    async with operator(k):
        await create(k, DEMO, "demo")
        await eventually(lambda: set(children_of(k, "demo")) == child_names("demo"))
        await eventually(lambda: condition(k.live(ISVCS, NS, "demo"), "Progressing"))
        await settled(k)
    assert (unavailable.hits, conflict.hits) == (2, 2)
    for status in status_writes(k, "demo"):
        for cond in status.get("conditions") or []:
            assert (cond["type"], cond["status"]) != ("Degraded", "True"), cond
    assert condition(k.live(ISVCS, NS, "demo"), "Degraded")["status"] == "False"
    assert warnings(k, "demo") == []
    assert not [e for e in k.every(EVENTS) if e["reason"] == "Recovered"]


@pytest.mark.asyncio
async def test_kubectl_scale_in_builtin_mode_is_not_silently_ignored(cluster):
    """The CRD's transition rule refuses it on a real API server (test_crd_schema.py); the
    emulator stores it, and the operator says it is ignored with a Warning Event."""
    k = cluster
    demo = copy.deepcopy(DEMO)
    # 3 lies within the bounds: only the transition rule refuses it.
    demo["spec"]["autoscaling"] = {"minReplicas": 1, "maxReplicas": 4}
    async with operator(k):
        await create(k, demo, "demo")
        await eventually(lambda: set(children_of(k, "demo")) == child_names("demo"))
        await settled(k)
        mark = len(k)
        await api(k, "patch", url(ISVCS, "demo", "scale"), {"spec": {"replicas": 3}})
        events = await eventually(
            lambda: [e for e in warnings(k, "demo") if e["reason"] == "ScaleIgnored"]
        )
        assert events[0]["message"] == MSG_SCALE_BUILTIN
        await settled(k)
        # The autoscaler's count stands; the request is written nowhere else.
        assert k.live(DEPLOYMENTS, NS, "demo-engine")["spec"]["replicas"] == 1
        assert f"PATCH {url(DEPLOYMENTS, 'demo-engine')}" not in writes(k, mark)


INTERVAL = 0.25
SCALE = INTERVAL / 10.0  # the client's and the queue's delays in their production proportion
STRETCH = 24  # intervals of conflicts


@pytest.mark.asyncio
async def test_writes_that_keep_conflicting_come_further_apart_then_converge(cluster, caplog):
    """409 on every write of a service (its children, its status) for a stretch. An API answer is
    expected in operation: each retry logs one line, never a traceback."""
    k = cluster
    caplog.set_level(logging.INFO, logger="kvfleet.operator")
    settings = build_settings()
    registry = build_registry(
        settings,
        CONFIG,
        debounce=0.02,
        backoff=1.0 * SCALE,
        autoscale_interval=INTERVAL,
        scrape_timeout=0.2,
        kube=kube_for(k, SCALE),
    )
    demo = copy.deepcopy(DEMO)
    demo["spec"]["autoscaling"] = {"minReplicas": 1, "maxReplicas": 4}
    async with run_operator(registry, settings):
        await create(k, demo, "demo")
        await eventually(lambda: set(children_of(k, "demo")) == child_names("demo"))
        await eventually(lambda: condition(k.live(ISVCS, NS, "demo"), "Progressing"))
        objects = [url(ISVCS, "demo", "status")] + [
            url(f"{child['apiVersion']}/{PLURALS[child['kind']]}", child["metadata"]["name"])
            for child in children_of(k, "demo").values()
        ]
        faults = [k.inject(Fault("PATCH", path, 409, times=None)) for path in objects]
        mark = len(k)
        # A change that both writers write: the engine Deployment's replicas, the status.
        await api(k, "patch", url(ISVCS, "demo"), {"spec": {"autoscaling": {"minReplicas": 2}}})
        await asyncio.sleep(STRETCH * INTERVAL)
        sent = [
            k.arrived[r.id]
            for r in by_operator(k, mark)
            if r.method.value == "PATCH" and r.url.path in objects
        ]
        # Half the writes early, the other half spread over at least three times as long.
        mid = len(sent) // 2
        assert sent[-1] - sent[mid] >= 3 * (sent[mid] - sent[0]), [t - sent[0] for t in sent]
        assert [e["reason"] for e in warnings(k, "demo")] == ["StatusWriteFailed"]
        retries = [r for r in caplog.records if "retrying in" in r.getMessage()]
        assert retries and not [r for r in retries if r.exc_info], retries

        for fault in faults:
            k.faults.remove(fault)
        await eventually(
            lambda: k.live(DEPLOYMENTS, NS, "demo-engine")["spec"]["replicas"] == 2, timeout=15
        )
        isvc = await eventually(
            lambda: (
                (isvc := k.live(ISVCS, NS, "demo"))
                and isvc["status"].get("observedGeneration") == isvc["metadata"]["generation"]
                and isvc["status"].get("desiredReplicas") == 2
                and isvc
            ),
            timeout=15,
        )
        assert condition(isvc, "Degraded")["status"] == "False"

        def recovered() -> list[dict[str, Any]]:
            return [e for e in k.every(EVENTS) if e["reason"] == "StatusWriteRecovered"]

        await eventually(recovered)  # Events are posted in the background
        await asyncio.sleep(4 * INTERVAL)
        assert len(recovered()) == 1, recovered()
