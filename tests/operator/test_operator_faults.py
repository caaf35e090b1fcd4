"""Issue 17: the operator under API faults, on the kmock emulator with faults injected before the
emulator stores anything, counting requests.

Stated rates (docs/operations.md, "API outages"), per service, in autoscaling intervals:
* a service whose every autoscaling step fails: at most MAX_FAILING_PER_INTERVAL requests per
  interval (the loop's read, its failed list and the reconciler's backed-off retries), one
  status write and one Warning Event for the cause, however many intervals it lasts;
* a service deleted without its watch event: at most one more read by its loop;
* kopf's own requests while the InferenceService list answers 503: at most
  MAX_OUTAGE_RPS a second, and the operator is still there and reconciling afterwards;
* an HTTP 410 answer to kopf's list or watch, of InferenceServices or of a child: the operator
  stays up, /healthz answers 200, and it lists and watches again (watch_recovery);
* a watch that ends at once with no event, or drops mid-event, again and again: at most
  most_requests() in a window, a geometric sequence up to the backoff's cap, not a hot loop.
* a service whose status writes fail (500, 409): at most MAX_STATUS_FAILING_PER_INTERVAL
  requests per interval, its status writes further and further apart, one Warning Event and
  one log warning per cause, every failed write counted, and the status written once the
  writes succeed again (issue 36).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp.web
import kmock
import kopf
import pytest
from prometheus_client import REGISTRY

from kvfleet.operator.autoscaler import REFRESH_SECONDS, failure_update
from kvfleet.operator.main import (
    MAX_BACKOFF_S,
    WATCHER_TASK_PREFIX,
    WatchBackoffs,
    WatchProbe,
    build_registry,
    build_settings,
)
from tests.support.kmock import (
    CONFIG,
    DEMO,
    DEPLOYMENTS,
    EVENTS,
    ISVCS,
    NS,
    PODS,
    APIServer,
    EndedWatch,
    Fault,
    api,
    by_operator,
    create,
    eventually,
    kube_for,
    run_operator,
    url,
)
from tests.support.net import free_port

INTERVAL = 0.25
# The client's retry delays and write backoff in their production proportion to the interval
# (10 s), so that requests per interval are counted as production makes them.
SCALE = INTERVAL / 10.0
MAX_FAILING_PER_INTERVAL = 4
MAX_STATUS_FAILING_PER_INTERVAL = 3
MAX_OUTAGE_RPS = 5
# Watch recovery with the test's short delays: kopf's backoff (first, cap) and its pause before
# listing again.
FAST_BACKOFF = (0.1, 0.4)
FAST_WATCH = {
    "networking__error_backoffs": WatchBackoffs(*FAST_BACKOFF),
    "watching__reconnect_backoff": 0.1,
}
ENDED_WINDOW_S = 3.0
ISVC_COLLECTION = "/apis/kvfleet.dev/v1alpha1/inferenceservices"


# -- pure parts ------------------------------------------------------------------------------


def test_a_failure_is_written_once_per_cause_and_cleared_once():
    first = failure_update({}, "APIError", "GET pods: 500", 1_750_000_000.0)
    assert first == {
        "autoscaling": {
            "failure": {
                "reason": "APIError",
                "message": "GET pods: 500",
                "since": "2025-06-15T15:06:40Z",
            }
        }
    }
    status = {"autoscaling": {"recommendations": [], **first["autoscaling"]}}
    # Another message, same cause: nothing to write.
    assert failure_update(status, "APIError", "GET pods: 503", 1_750_000_010.0) == {}
    assert (
        failure_update(status, "DecisionFailed", "x", 1_750_000_010.0)["autoscaling"]["failure"][
            "reason"
        ]
        == "DecisionFailed"
    )
    assert failure_update(status, None, "", 0) == {"autoscaling": {"failure": None}}
    assert failure_update({}, None, "", 0) == {}


def test_kopf_retries_without_end_with_jitter_below_the_cap():
    backoffs = build_settings().networking.error_backoffs
    assert isinstance(backoffs, WatchBackoffs)
    first = list(itertools.islice(backoffs, 100))
    second = list(itertools.islice(backoffs, 100))  # anew for every request
    assert len(first) == 100 and first != second  # kopf's default gives up after 8 (54 s)
    assert 0.5 <= first[0] <= 1.0 and max(first) <= MAX_BACKOFF_S
    assert sum(first[:8]) < sum(first)  # it grows, and keeps going past kopf's 54 s
    assert not hasattr(backoffs, "__len__")  # kopf counts a Sized one as the last attempt
    settings = build_settings()
    assert settings.watching.reconnect_backoff >= 1.0
    assert settings.watching.server_timeout and settings.watching.client_timeout


class FakeKube:
    def __init__(self) -> None:
        self.failing: Exception | None = None
        self.lists = 0

    async def list(self, url: str, label_selector: str) -> list[dict[str, Any]]:
        self.lists += 1
        if self.failing is not None:
            raise self.failing
        return []


@pytest.mark.asyncio
async def test_the_probe_fails_once_listing_has_failed_too_long():
    api, now = FakeKube(), [0.0]
    probe = WatchProbe(api, ["team-a"], stale_after=300, clock=lambda: now[0])  # type: ignore[arg-type]
    assert await probe.check() == "watching"
    api.failing = ConnectionError("refused")
    now[0] = 299.0
    assert "listing fails" in await probe.check()  # an outage is waited out for a while
    now[0] = 300.0
    with pytest.raises(kopf.PermanentError, match="cannot list"):
        await probe.check()
    api.failing = None
    assert await probe.check() == "watching"


@pytest.mark.asyncio
async def test_the_probe_fails_once_a_watch_task_has_ended():
    probe = WatchProbe(FakeKube(), [], stale_after=300, clock=lambda: 0.0)  # type: ignore[arg-type]
    stop = asyncio.Event()
    watcher = asyncio.create_task(stop.wait(), name=f"{WATCHER_TASK_PREFIX}inferenceservices")
    await asyncio.sleep(0)
    assert await probe.check() == "watching"
    stop.set()
    await watcher
    with pytest.raises(kopf.PermanentError, match="no longer watching"):
        await probe.check()


# -- under kopf --------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def operator(
    k: APIServer,
    liveness_endpoint: str | None = None,
    scale: float = 1.0,
    clock: Callable[[], float] = time.time,
    **settings_changes: Any,
) -> AsyncIterator[None]:
    settings = build_settings()
    for name, value in settings_changes.items():
        section, attr = name.split("__")
        setattr(getattr(settings, section), attr, value)
    registry = build_registry(
        settings,
        CONFIG,
        debounce=0.02,
        backoff=0.2,
        autoscale_interval=INTERVAL,
        scrape_timeout=0.2,
        kube=kube_for(k, scale),
        clock=clock,
    )
    async with run_operator(registry, settings, liveness_endpoint=liveness_endpoint):
        yield


def service(name: str, autoscaling: dict[str, Any] | None = None) -> dict[str, Any]:
    body = copy.deepcopy(DEMO)
    body["spec"]["autoscaling"] = autoscaling or {"minReplicas": 1, "maxReplicas": 4}
    return body | {"metadata": {"name": name}}


class PodListFault:
    """The pod list of one InferenceService answers 403, as when a Role lost a rule; not a
    status the client retries, so every step fails at once (Fault matches paths, not
    selectors)."""

    def __init__(self, isvc: str) -> None:
        self.selector = f"kvfleet.dev/inferenceservice={isvc}"
        self.hits = 0

    def answer(self, request: kmock.Request) -> aiohttp.web.Response | None:
        if request.url.path != url(PODS) or request.params.get("labelSelector") != self.selector:
            return None
        self.hits += 1
        return aiohttp.web.json_response({"kind": "Status", "code": 403}, status=403)


def failures(reason: str) -> float:
    labels = {"reason": reason}
    return REGISTRY.get_sample_value("kvfleet_operator_autoscaling_failures_total", labels) or 0.0


def events_of(k: APIServer, isvc: str, reason: str) -> list[dict[str, Any]]:
    return [
        e for e in k.every(EVENTS) if e["involvedObject"]["name"] == isvc and e["reason"] == reason
    ]


def status_of(k: APIServer, isvc: str) -> dict[str, Any]:
    return (k.live(ISVCS, NS, isvc) or {}).get("status") or {}


def requests_for(k: APIServer, isvc: str, since: int) -> list[kmock.Request]:
    selector = f"kvfleet.dev/inferenceservice={isvc}"
    return [
        r
        for r in by_operator(k, since)
        if r.url.path.startswith(url(ISVCS, isvc)) or r.params.get("labelSelector") == selector
    ]


@pytest.mark.asyncio
async def test_a_failing_step_is_visible_once_and_never_holds_up_another_service(cluster):
    k = cluster
    fault = PodListFault("bad")
    async with operator(k):
        await create(k, service("good"))
        await create(k, service("bad"))
        await eventually(lambda: k.live(DEPLOYMENTS, NS, "good-engine"))
        before = failures("APIError")
        k.faults.append(fault)  # type: ignore[arg-type]
        mark = len(k)
        await eventually(lambda: status_of(k, "bad").get("autoscaling", {}).get("failure"))
        failure = status_of(k, "bad")["autoscaling"]["failure"]
        assert failure["reason"] == "APIError" and "403" in failure["message"]

        # The other service's loop goes on: a spec change is decided within two intervals.
        await api(k, "patch", url(ISVCS, "good"), {"spec": {"autoscaling": {"minReplicas": 3}}})
        await eventually(lambda: status_of(k, "good").get("desiredReplicas") == 3, 10 * INTERVAL)
        await eventually(lambda: k.live(DEPLOYMENTS, NS, "good-engine")["spec"]["replicas"] == 3)

        # Tried again every interval; reported once.
        start = asyncio.get_running_loop().time()
        hits = fault.hits
        await asyncio.sleep(12 * INTERVAL)
        elapsed = asyncio.get_running_loop().time() - start
        assert fault.hits - hits >= 6, "the next intervals did not try again"
        assert failures("APIError") - before >= 6
        assert len(events_of(k, "bad", "AutoscalingFailed")) == 1
        status_writes = [
            r
            for r in requests_for(k, "bad", mark)
            if r.method.value == "PATCH" and "autoscaling" in (r.data.get("status") or {})
        ]
        assert len(status_writes) == 1
        rate = len(requests_for(k, "bad", mark)) / (elapsed / INTERVAL + 8)
        assert rate <= MAX_FAILING_PER_INTERVAL, rate
        assert "failure" not in status_of(k, "good").get("autoscaling", {})

        # Fixed: the next step clears it, once.
        k.faults.remove(fault)  # type: ignore[arg-type]
        await eventually(lambda: "failure" not in status_of(k, "bad").get("autoscaling", {}))
        await eventually(lambda: events_of(k, "bad", "AutoscalingRecovered"))
        await asyncio.sleep(4 * INTERVAL)
        assert len(events_of(k, "bad", "AutoscalingRecovered")) == 1


def status_write_failures(cause: str) -> float:
    labels = {"reason": cause}
    return REGISTRY.get_sample_value("kvfleet_operator_status_write_failures_total", labels) or 0.0


WRITE_WINDOW = 24  # intervals


@pytest.mark.parametrize(("code", "cause"), [(500, "unavailable"), (409, "conflict")])
@pytest.mark.asyncio
async def test_a_failing_status_write_is_bounded_and_reported_elsewhere(
    cluster, caplog, code, cause
):
    k = cluster
    now = [1_750_000_000.0]
    caplog.set_level(logging.DEBUG, logger="kvfleet.operator")
    async with operator(k, scale=SCALE, clock=lambda: now[0]):
        await create(k, service("bad"))
        await eventually(lambda: status_of(k, "bad").get("autoscaling"))
        await eventually(lambda: status_of(k, "bad").get("observedGeneration"))
        fault = k.inject(Fault("PATCH", url(ISVCS, "bad", "status"), code, times=None))
        before = status_write_failures(cause)
        mark = len(k)
        caplog.clear()
        # A minute on: the autoscaler's memory is due to be written, at every step while the
        # write fails (only its times changed: nothing for the reconciler to write).
        now[0] += REFRESH_SECONDS
        start = asyncio.get_running_loop().time()
        await asyncio.sleep(WRITE_WINDOW * INTERVAL)
        elapsed = asyncio.get_running_loop().time() - start

        requests = requests_for(k, "bad", mark)
        # The step under way at the end may have started its requests.
        assert len(requests) <= MAX_STATUS_FAILING_PER_INTERVAL * (elapsed / INTERVAL + 1)
        patches = [r for r in requests if r.method.value == "PATCH"]
        assert len(patches) == fault.hits and fault.hits >= 6
        # Tried again the next interval at first, then several intervals apart.
        times = [k.arrived[r.id] for r in patches]
        gaps = [b - a for a, b in itertools.pairwise(times)]
        assert gaps[0] <= 2 * INTERVAL and min(gaps[-2:]) >= 2.5 * INTERVAL, gaps
        # Counted, and reported once: not in the status (which cannot be written), but in an
        # Event, which is an object of its own, and in the log.
        assert status_write_failures(cause) - before == fault.hits
        [event] = events_of(k, "bad", "StatusWriteFailed")
        assert event["type"] == "Warning" and f"({cause})" in event["message"]
        assert events_of(k, "bad", "AutoscalingFailed") == []
        warned = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert [r.getMessage() for r in warned if "bad" in r.getMessage()] == [
            f"{NS}/bad: {event['message']}"
        ]

        # The fault over: the memory is written, and that is said once.
        k.faults.remove(fault)
        await eventually(
            lambda: (
                max(t for t, _ in status_of(k, "bad")["autoscaling"]["recommendations"]) >= now[0]
            )
        )
        await eventually(lambda: events_of(k, "bad", "StatusWriteRecovered"))
        await asyncio.sleep(4 * INTERVAL)
        assert len(events_of(k, "bad", "StatusWriteRecovered")) == 1
        assert len(events_of(k, "bad", "StatusWriteFailed")) == 1


@pytest.mark.asyncio
async def test_a_missed_deleted_event_stops_the_loop(cluster):
    k = cluster
    gone = url(ISVCS, "gone")
    async with operator(k):
        await create(k, service("gone"))

        def polled() -> int:
            return sum(1 for r in by_operator(k) if r.method.value == "GET" and r.url.path == gone)

        await eventually(lambda: polled() >= 2)
        # Gone from the store, and no watch event says so.
        k.objects[ISVCS, NS, "gone"].delete()
        await eventually(lambda: k.live(ISVCS, NS, "gone") is None)
        count = polled()
        await asyncio.sleep(12 * INTERVAL)
        # The step under way, then the 404 that ends the loop: at most two more reads.
        assert polled() - count <= 2, polled() - count


@pytest.mark.asyncio
async def test_an_outage_of_the_inferenceservice_list_is_waited_out(cluster):
    """More 503s than kopf's default eight retries survive, at a bounded rate; delays are
    shortened so the test waits seconds, not minutes."""
    k = cluster
    outage = k.inject(Fault("GET", ISVC_COLLECTION, 503, times=20))
    start = asyncio.get_running_loop().time()
    async with operator(k, networking__error_backoffs=WatchBackoffs(first=0.1, cap=0.4)):
        await eventually(lambda: outage.hits >= 20, timeout=30)
        elapsed = asyncio.get_running_loop().time() - start
        assert outage.hits / elapsed <= MAX_OUTAGE_RPS, outage.hits / elapsed
        # Still watching: a new service is reconciled.
        await create(k, service("after"))
        await eventually(lambda: k.live(DEPLOYMENTS, NS, "after-engine"), timeout=15)


async def healthz(endpoint: str) -> int | None:
    try:
        async with aiohttp.ClientSession() as session, session.get(endpoint) as resp:
            return resp.status
    except aiohttp.ClientError:
        return None  # not answering: the kubelet counts it as a failure too


def kopfs(k: APIServer, path: str, watch: bool) -> int:
    """kopf's list (watch=False) or watch requests of path so far."""
    return sum(
        1
        for r in k
        if r.url.path == path
        and r.headers.get("User-Agent", "").startswith("kopf/")
        and (r.params.get("watch") == "true") == watch
    )


def most_requests(window: float, first: float, cap: float) -> int:
    """The most requests WatchBackoffs(first, cap) lets a stream that fails at once make in
    window seconds: the first at once, then after each delay, each at least half its value."""
    count, elapsed, delay = 1, 0.0, first
    while (elapsed := elapsed + delay / 2) <= window:
        count += 1
        delay = min(delay * 2, cap)
    return count


@pytest.mark.asyncio
async def test_410_answers_to_lists_and_watches_are_recovered_in_process(cluster):
    """An API server answers 410 to a list whose continue token, or a watch whose
    resourceVersion, it no longer has; kopf does not retry it. The operator stays up and
    healthy, lists and watches again, and reconciles what changed meanwhile."""
    k = cluster
    endpoint = f"http://127.0.0.1:{free_port()}/healthz"
    listing = k.inject(Fault("GET", ISVC_COLLECTION, 410, times=None, watch=False))
    # Every watch answered 410, the InferenceServices' and a child's: each is listed again.
    watches = [
        k.inject(Fault("GET", path, 410, times=None, watch=True))
        for path in (ISVC_COLLECTION, "/apis/apps/v1/deployments")
    ]
    async with operator(k, endpoint, **FAST_WATCH):
        await eventually(lambda: kopfs(k, ISVC_COLLECTION, watch=False) >= 3)
        assert await healthz(endpoint) == 200
        k.faults.remove(listing)
        await create(k, service("during"))
        await eventually(lambda: k.live(DEPLOYMENTS, NS, "during-engine"), timeout=15)
        lists, isvc_watches = kopfs(k, ISVC_COLLECTION, watch=False), watches[0].hits
        await eventually(
            lambda: watches[0].hits - isvc_watches >= 3 and watches[1].hits >= 3, timeout=15
        )
        assert kopfs(k, ISVC_COLLECTION, watch=False) - lists >= 2
        assert await healthz(endpoint) == 200
        for w in watches:
            k.faults.remove(w)

        await create(k, service("after"))
        await eventually(lambda: k.live(DEPLOYMENTS, NS, "after-engine"), timeout=15)
        # The child watch works again: a hand edit of a Deployment is undone.
        template = copy.deepcopy(k.live(DEPLOYMENTS, NS, "after-engine")["spec"]["template"])
        image = template["spec"]["containers"][0]["image"]
        template["spec"]["containers"][0]["image"] = "someone/else:latest"
        await api(k, "patch", url(DEPLOYMENTS, "after-engine"), {"spec": {"template": template}})

        def engine_image() -> str:
            deploy = k.live(DEPLOYMENTS, NS, "after-engine")
            return deploy["spec"]["template"]["spec"]["containers"][0]["image"]

        await eventually(lambda: engine_image() == image)
        assert await healthz(endpoint) == 200


INTERNAL_ERROR = {"kind": "Status", "status": "Failure", "code": 500, "message": "etcd timeout"}


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "fault",
    [
        EndedWatch(ISVC_COLLECTION),
        EndedWatch(ISVC_COLLECTION, dropped=True),
        EndedWatch(ISVC_COLLECTION, error=INTERNAL_ERROR),
    ],
    ids=["ended", "dropped", "error-event"],
)
async def test_a_watch_that_ends_at_once_is_reopened_after_a_growing_wait(cluster, fault):
    """A watch answered 200 that ends at once with no event, or whose connection drops mid-
    event, which kopf alone reopens at once (hundreds of times a second here), or that holds
    only an ERROR event other than 410, which ended kopf: each failure in a row waits longer
    (FAST_WATCH: 0.1 s doubling to 0.4 s; 1 s doubling to 30 s in production), and the watch
    works again once the fault ends."""
    k = cluster
    ended = k.inject(copy.deepcopy(fault))
    endpoint = f"http://127.0.0.1:{free_port()}/healthz"
    async with operator(k, endpoint, **FAST_WATCH):
        await eventually(lambda: ended.hits >= 1)
        first = ended.hits
        await asyncio.sleep(ENDED_WINDOW_S)
        # +1: one may be on its way as the window opens.
        assert ended.hits - first <= most_requests(ENDED_WINDOW_S, *FAST_BACKOFF) + 1, ended.hits
        assert await healthz(endpoint) == 200
        ended.active = False
        await create(k, service("after"))
        await eventually(lambda: k.live(DEPLOYMENTS, NS, "after-engine"), timeout=15)
