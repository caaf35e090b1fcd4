"""The built-in autoscaler end to end under the real kopf runtime against kmock: its loop
scrapes engine and router pods served by HTTP servers the test controls, and the reconciler
carries its decisions to the engine Deployment.

Time: the loop runs every INTERVAL real seconds, but the scaling windows are read from a fake
clock the test moves, so a 300 s window passes in a few intervals. The pure parts of the scaler
(what is persisted and when, who owns the replica count) are tested first, on their own.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
import pytest_asyncio
import yaml
from aiohttp import web

from kvfleet.operator.autoscaler import (
    REFRESH_SECONDS,
    ZERO_POLL_SECONDS,
    load_memory,
    status_update,
)
from kvfleet.operator.deletion_cost import DELETION_COST
from kvfleet.operator.main import build_registry, build_settings
from kvfleet.operator.scaling_policy import Recommendation, ScaleDecision, ScalingMemory
from kvfleet.operator.spec import engine_deployment_replicas, parse_spec
from kvfleet.telemetry.metric_names import KV_CACHE_USAGE, RUNNING, WAITING
from tests.support.kmock import (
    CONFIG,
    DEMO,
    DEPLOYMENTS,
    EVENTS,
    ISVCS,
    NS,
    PODS,
    ROOT,
    APIServer,
    add_ready_pod,
    api,
    assert_rbac_covers,
    by_operator,
    create,
    eventually,
    kube_for,
    run_operator,
    url,
    writes,
)

INTERVAL = 0.25
T0 = 1_750_000_000.0


# -- pure parts ------------------------------------------------------------------------------


def decision(replicas: int, history: list[tuple[float, int]], last_active: float | None):
    return ScaleDecision(
        replicas=replicas,
        reason="why",
        memory=ScalingMemory(tuple(Recommendation(t, n) for t, n in history), last_active),
        signal="queueDepth",
        signals={"current": 2.0, "in_flight": 9.0},
    )


def test_a_change_is_recorded_with_its_metrics_and_the_memory():
    patch = status_update({"desiredReplicas": 2}, 2, decision(3, [(T0, 3)], T0), {}, T0)
    assert patch["desiredReplicas"] == 3
    assert patch["lastScaleDecision"] == {
        "time": "2025-06-15T15:06:40Z",
        "from": 2,
        "to": 3,
        "reason": "why",
        "signal": "queueDepth",
        "metrics": {"current": 2.0, "inFlight": 9.0},
    }
    assert patch["autoscaling"] == {
        "recommendations": [[T0, 3]],
        "unreachablePods": [],
        "lastActiveTime": "2025-06-15T15:06:40Z",
    }
    assert load_memory(patch) == ScalingMemory((Recommendation(T0, 3),), T0)


def test_a_reading_the_new_decision_lacks_leaves_the_last_decisions_metrics():
    # The status is merge-patched, which merges the metrics object into the last decision's: a
    # latency reading of the scale-up (none in an idle interval) read as the scale-down's.
    last = {"time": "2025-06-15T15:00:00Z", "from": 1, "to": 2, "reason": "p90 TTFT 0.912s",
            "signal": "latency", "metrics": {"current": 1.0, "latencySeconds": 0.9125}}  # fmt: skip
    previous = {"desiredReplicas": 2, "lastScaleDecision": last}
    patch = status_update(previous, 2, decision(3, [(T0, 3)], T0), {}, T0)
    assert patch["lastScaleDecision"]["metrics"] == {
        "current": 2.0,
        "inFlight": 9.0,
        "latencySeconds": None,  # removed by the merge patch
    }


def test_memory_is_written_when_its_content_changes_or_it_grows_stale():
    status = {"desiredReplicas": 2}
    status |= status_update(status, 2, decision(2, [(T0, 2)], T0), {}, T0)
    # Only the times moved: nothing to write for a while.
    assert status_update(status, 2, decision(2, [(T0 + 10, 2)], T0 + 10), {}, T0 + 10) == {}
    later = T0 + REFRESH_SECONDS
    assert set(status_update(status, 2, decision(2, [(later, 2)], later), {}, later)) == {
        "autoscaling"
    }
    # A new value inside the window, or a pod that stopped answering, is written at once.
    two_values = decision(2, [(T0, 2), (T0 + 10, 1)], T0)
    assert set(status_update(status, 2, two_values, {}, T0 + 10)) == {"autoscaling"}
    silent = status_update(
        status, 2, decision(2, [(T0 + 10, 2)], T0), {"p1": "timed out after 2.0 s"}, T0 + 10
    )
    assert silent["autoscaling"]["unreachablePods"] == ["p1"]
    assert silent["autoscaling"]["unreachableReasons"] == {"p1": "timed out after 2.0 s"}
    status |= silent
    # The wording of why alone is no reason to write again.
    reworded = {"p1": "timed out after 2.1 s"}
    assert status_update(status, 2, decision(2, [(T0 + 20, 2)], T0), reworded, T0 + 20) == {}


def test_builtin_mode_owns_the_count_and_external_mode_follows_the_spec():
    builtin = parse_spec("x", {"autoscaling": {"minReplicas": 0, "maxReplicas": 4}})
    assert engine_deployment_replicas(builtin, None) == 1  # before any decision
    assert engine_deployment_replicas(builtin, 3) == 3
    assert engine_deployment_replicas(builtin, 0) == 0
    assert engine_deployment_replicas(builtin, 9) == 4  # maxReplicas lowered since the decision
    pinned = parse_spec("x", {"replicas": 2, "autoscaling": {"maxReplicas": 4}})
    assert engine_deployment_replicas(pinned, 3) == 3  # spec.replicas only seeds a builtin count
    external = parse_spec("x", {"replicas": 2, "autoscaling": {"mode": "external"}})
    assert engine_deployment_replicas(external, 3) == 2


@pytest.mark.parametrize("name", ["keda-scaledobject.yaml", "hpa.yaml"])
def test_external_scaler_examples_target_an_external_mode_service(name):
    docs = list(yaml.safe_load_all((ROOT / "examples" / name).read_text()))
    isvc = next(d for d in docs if d["kind"] == "InferenceService")
    scaler = next(d for d in docs if d["kind"] in ("ScaledObject", "HorizontalPodAutoscaler"))
    spec = parse_spec(isvc["metadata"]["name"], isvc["spec"])
    assert spec.autoscaling.mode == "external" and spec.replicas is not None
    assert scaler["spec"]["scaleTargetRef"] == {
        "apiVersion": "kvfleet.dev/v1alpha1",
        "kind": "InferenceService",
        "name": isvc["metadata"]["name"],
    }
    text = (ROOT / "examples" / name).read_text()
    for metric in (RUNNING, WAITING, KV_CACHE_USAGE):
        assert metric in text


# -- under kopf --------------------------------------------------------------------------------


class Clock:
    """Seconds since the epoch, moved by the test; read from the operator's thread."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class MetricsServer:
    """One pod's /metrics: an engine's vLLM gauges, or a router's held-requests gauge."""

    def __init__(self, router: bool = False) -> None:
        self.router = router
        self.running = self.waiting = self.kv = self.held = self.cached = 0.0
        # Cumulative TTFT observations under 0.1 s, under 1 s, and in all.
        self.ttft = (0.0, 0.0, 0.0)
        self.silent = False
        self.extra = ""  # sample lines the engine adds to its exposition (repeats of its own)
        self.scrapes = 0
        self.port = 0
        self._runner: web.AppRunner | None = None

    async def start(self) -> MetricsServer:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app, shutdown_timeout=0.1)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.port = self._runner.addresses[0][1]
        return self

    async def stop(self) -> None:
        assert self._runner is not None
        await self._runner.cleanup()

    def load(self, running: float, waiting: float = 0.0, kv: float = 0.0, cached: float = 0.0):
        self.running, self.waiting, self.kv, self.cached = running, waiting, kv, cached

    async def _metrics(self, _: web.Request) -> web.Response:
        self.scrapes += 1
        if self.silent:
            await asyncio.sleep(30)
        if self.router:
            name = "kvfleet_router_held_requests"
            body = f"# TYPE {name} gauge\n{name} {self.held}\n"
        else:
            label = '{model_name="kvfleet-tiny-random-llama"}'
            body = "".join(
                f"# TYPE {name} gauge\n{name}{label} {value}\n"
                for name, value in (
                    ("vllm:num_requests_running", self.running),
                    ("vllm:num_requests_waiting", self.waiting),
                    ("vllm:kv_cache_usage_perc", self.kv),
                    ("kvfleet_engine_prefix_cache_blocks", self.cached),
                )
            )
            body += self.extra
            name = "vllm:time_to_first_token_seconds"
            body += f"# TYPE {name} histogram\n" + "".join(
                f'{name}_bucket{{le="{le}",model_name="m"}} {count}\n'
                for le, count in zip(("0.1", "1.0", "+Inf"), self.ttft, strict=True)
            )
        return web.Response(text=body, content_type="text/plain")


@pytest_asyncio.fixture
async def servers() -> AsyncIterator[Callable[..., Awaitable[MetricsServer]]]:
    started: list[MetricsServer] = []

    async def start(router: bool = False) -> MetricsServer:
        started.append(await MetricsServer(router).start())
        return started[-1]

    yield start
    for server in started:
        await server.stop()


@contextlib.asynccontextmanager
async def operator(k: APIServer, clock: Clock, interval: float = INTERVAL) -> AsyncIterator[None]:
    """The operator in its own thread and loop (as in tests/operator/test_operator_kmock.py), with a
    short autoscaling interval and the fake clock."""
    settings = build_settings()
    registry = build_registry(
        settings,
        CONFIG,
        debounce=0.02,
        backoff=0.2,
        autoscale_interval=interval,
        scrape_timeout=0.2,
        clock=clock,
        kube=kube_for(k),
    )
    async with run_operator(registry, settings):
        yield


def service(name: str, autoscaling: dict[str, Any], **spec: Any) -> dict[str, Any]:
    body = copy.deepcopy(DEMO)
    body["metadata"] = {"name": name}
    body["spec"]["autoscaling"] = autoscaling
    body["spec"].update(spec)
    return body


async def add_pod(k: APIServer, isvc: str, component: str, server: MetricsServer) -> str:
    """A Ready pod of the engine or the router, its metrics served by `server`."""
    return await add_ready_pod(k, isvc, component, server.port)


def deployment_replicas_of(k: APIServer, isvc: str) -> int | None:
    deploy = k.live(DEPLOYMENTS, NS, f"{isvc}-engine")
    return deploy["spec"]["replicas"] if deploy else None


def status_of(k: APIServer, isvc: str) -> dict[str, Any]:
    return (k.live(ISVCS, NS, isvc) or {}).get("status") or {}


async def steps(server: MetricsServer, n: int = 2) -> None:
    """Wait until the loop has made n whole steps after now (a step counts once the next scrape
    has begun, so its status write is done)."""
    target = server.scrapes + n + 1
    await eventually(lambda: server.scrapes >= target, timeout=10 * n * INTERVAL + 5)


def scaled_events(k: APIServer, isvc: str) -> list[dict[str, Any]]:
    return [
        e
        for e in k.every(EVENTS)
        if e["involvedObject"]["name"] == isvc and e["reason"] == "Scaled"
    ]


@pytest.mark.asyncio
async def test_scales_up_within_two_intervals_and_down_only_after_the_window(cluster, servers):
    k, clock = cluster, Clock(T0)
    spec = service("llm", {"minReplicas": 1, "maxReplicas": 4, "targetQueueDepth": 4,
                           "scaleDownStabilizationSeconds": 300})  # fmt: skip
    engines = [await servers() for _ in range(4)]
    async with operator(k, clock):
        await create(k, spec)
        await eventually(lambda: deployment_replicas_of(k, "llm") == 1)
        await add_pod(k, "llm", "engine", engines[0])
        await steps(engines[0])
        assert deployment_replicas_of(k, "llm") == 1
        assert "lastScaleDecision" not in status_of(k, "llm")

        # Rising load: 16 in flight on one replica, target 4 per replica.
        before = engines[0].scrapes
        engines[0].load(running=4, waiting=12, kv=0.3)
        await eventually(lambda: status_of(k, "llm").get("desiredReplicas") == 4)
        assert engines[0].scrapes - before <= 2, "not decided within two intervals"
        await eventually(lambda: deployment_replicas_of(k, "llm") == 4)
        last = status_of(k, "llm")["lastScaleDecision"]
        assert (last["from"], last["to"]) == (1, 4)
        assert last["metrics"]["inFlight"] == 16 and last["metrics"]["queuePerReplica"] == 16
        assert "requests per replica" in last["reason"]
        events = await eventually(lambda: scaled_events(k, "llm"))
        assert "1 -> 4" in events[0]["message"] and events[0]["type"] == "Normal"

        # The Deployment controller's part: three more ready pods share the load, on target.
        for engine in engines[1:]:
            await add_pod(k, "llm", "engine", engine)
        for engine in engines:
            engine.load(running=4)
        await steps(engines[0])
        assert deployment_replicas_of(k, "llm") == 4

        # Falling load: held for the 300 s window, whatever the load says meanwhile.
        for engine in engines:
            engine.load(running=0.5)
        # The clock moves only once the new load is what the steps see: a step reads its pods
        # first and the clock after.
        await steps(engines[0])
        for t in (100, 200):
            clock.now = T0 + t
            await steps(engines[0])
            assert deployment_replicas_of(k, "llm") == 4
        assert status_of(k, "llm")["autoscaling"]["recommendations"][0] == [T0, 4]

    # The window survives a restart: the new process reads it back from the status.
    mark = len(k)
    async with operator(k, clock):
        clock.now = T0 + 290
        await steps(engines[0])
        assert deployment_replicas_of(k, "llm") == 4
        # A silent pod is reported and is never a reason to scale down.
        engines[3].silent = True
        # As above: the clock moves only once the steps see the silent pod, or a step in
        # flight could pair the old answers with the new time.
        await steps(engines[0])
        clock.now = T0 + 310
        await steps(engines[0])
        assert status_of(k, "llm")["autoscaling"]["unreachablePods"] == [
            f"llm-engine-{engines[3].port}"
        ]
        assert deployment_replicas_of(k, "llm") == 4
        # Holding is a recommendation of its own, so the window restarts from it.
        engines[3].silent = False
        await steps(engines[0])
        clock.now = T0 + 500
        await steps(engines[0])
        assert deployment_replicas_of(k, "llm") == 4
        assert status_of(k, "llm")["autoscaling"]["unreachablePods"] == []
        # The scale-down marks which engines go: the coldest (fewest cached blocks at equal
        # load) costs least, so the ReplicaSet deletes it first; the warmest stays.
        for engine, cached in zip(engines, (10, 500, 0, 50), strict=True):
            engine.load(running=0.5, cached=cached)
        await steps(engines[0])
        mark_down = len(k)
        clock.now = T0 + 620
        await eventually(lambda: deployment_replicas_of(k, "llm") == 1)
        last = status_of(k, "llm")["lastScaleDecision"]
        assert (last["from"], last["to"]) == (4, 1)
        assert by_operator(k, mark)
        costs = [
            k.live(PODS, NS, f"llm-engine-{e.port}")["metadata"]["annotations"][DELETION_COST]
            for e in engines
        ]
        assert costs == ["1", "3", "0", "2"]
        # Written before the Deployment shrinks, and only then (no pod write in earlier steps).
        done = writes(k, mark_down)
        shrink = next(i for i, w in enumerate(done) if w.endswith("/deployments/llm-engine"))
        patched = [f"PATCH /api/v1/namespaces/{NS}/pods/llm-engine-{e.port}" for e in engines]
        assert [w for w in done[:shrink] if "/pods/" in w] == patched
        assert [w for w in writes(k, mark) if "/pods/" in w] == patched
    assert_rbac_covers(k)


@pytest.mark.asyncio
async def test_scales_to_zero_after_the_idle_delay_and_back_on_held_requests(cluster, servers):
    k, clock = cluster, Clock(T0)
    spec = service("idle", {"minReplicas": 0, "maxReplicas": 2, "scaleToZeroDelaySeconds": 600,
                            "scaleDownStabilizationSeconds": 60})  # fmt: skip
    engine, router = await servers(), await servers(router=True)
    async with operator(k, clock):
        await create(k, spec)
        # A new service starts with one replica even though minReplicas is 0.
        await eventually(lambda: deployment_replicas_of(k, "idle") == 1)
        engine_pod = await add_pod(k, "idle", "engine", engine)
        await add_pod(k, "idle", "router", router)
        await steps(engine)
        # Idle since first seen at T0: zero after 600 s, once the last "1" (590 s) left the
        # 60 s window.
        for t in (300, 590, 620):
            clock.now = T0 + t
            await steps(engine)
            assert deployment_replicas_of(k, "idle") == 1, f"at {t}s"
        clock.now = T0 + 670
        await eventually(lambda: deployment_replicas_of(k, "idle") == 0)
        last = status_of(k, "idle")["lastScaleDecision"]
        assert (last["from"], last["to"]) == (1, 0) and "no work for 600s" in last["reason"]
        await api(k, "delete", url(PODS, engine_pod))

        # At zero only the router is scraped; nothing held, nothing happens.
        await steps(router)
        assert deployment_replicas_of(k, "idle") == 0
        before = router.scrapes
        router.held = 3
        await eventually(lambda: status_of(k, "idle").get("desiredReplicas") == 1)
        assert router.scrapes - before <= 2
        await eventually(lambda: deployment_replicas_of(k, "idle") == 1)
        last = status_of(k, "idle")["lastScaleDecision"]
        assert (last["from"], last["to"]) == (0, 1) and "held" in last["reason"]
        assert last["metrics"]["heldRequests"] == 3
        await eventually(lambda: len(scaled_events(k, "idle")) == 2)
    assert_rbac_covers(k)


@pytest.mark.asyncio
async def test_a_request_held_at_zero_is_scaled_for_within_a_poll_not_an_interval(cluster, servers):
    # At zero the routers' held requests are read every ZERO_POLL_SECONDS between steps: the
    # request waits about that for its decision, not up to the whole interval.
    interval = 4.0
    assert interval > 2 * ZERO_POLL_SECONDS
    k, clock = cluster, Clock(T0)
    spec = service("cold", {"minReplicas": 0, "maxReplicas": 1, "scaleToZeroDelaySeconds": 0,
                            "scaleDownStabilizationSeconds": 0})  # fmt: skip
    engine, router = await servers(), await servers(router=True)
    async with operator(k, clock, interval):
        await create(k, spec)
        engine_pod = await add_pod(k, "cold", "engine", engine)
        await add_pod(k, "cold", "router", router)
        # Idle, with no delay and no window: the first step decides zero.
        await eventually(lambda: status_of(k, "cold").get("desiredReplicas") == 0, 3 * interval)
        await api(k, "delete", url(PODS, engine_pod))
        router.held = 1
        held_at = asyncio.get_running_loop().time()
        await eventually(lambda: status_of(k, "cold").get("desiredReplicas") == 1, 3 * interval)
        assert asyncio.get_running_loop().time() - held_at < interval - 1.5
        last = status_of(k, "cold")["lastScaleDecision"]
        assert (last["from"], last["to"], last["signal"]) == (0, 1, "heldRequests")
        await eventually(lambda: deployment_replicas_of(k, "cold") == 1)


@pytest.mark.asyncio
async def test_a_recommendation_from_the_future_is_clamped_and_reported(cluster, servers):
    k, clock = cluster, Clock(T0)
    spec = service("skew", {"minReplicas": 1, "maxReplicas": 4, "targetQueueDepth": 4,
                            "scaleDownStabilizationSeconds": 300})  # fmt: skip
    engines = [await servers() for _ in range(4)]
    await create(k, spec)
    # Left by an operator whose clock ran an hour ahead, or written by hand: 4 replicas
    # recommended "an hour from now".
    await api(k, "patch", url(ISVCS, "skew", "status"), {"status": {
        "desiredReplicas": 4,
        "autoscaling": {"recommendations": [[T0 + 3600, 4]], "unreachablePods": []},
    }})  # fmt: skip
    for engine in engines:
        engine.load(running=0.5)
        await add_pod(k, "skew", "engine", engine)
    async with operator(k, clock):
        await eventually(lambda: "clockSkew" in status_of(k, "skew").get("autoscaling", {}))
        memory = status_of(k, "skew")["autoscaling"]
        assert memory["clockSkew"]["reason"] == "ClockSkew"
        assert "recommendations 3600s" in memory["clockSkew"]["message"]
        assert max(t for t, _ in memory["recommendations"]) <= T0
        events = await eventually(
            lambda: [e for e in k.every(EVENTS) if e["reason"] == "ClockSkew"]
        )
        assert [(e["type"], e["involvedObject"]["name"]) for e in events] == [("Warning", "skew")]
        assert "recommendations 3600s" in events[0]["message"]
        # Idle, the four replicas go once the 300 s window counted from now has passed.
        clock.now = T0 + 290
        await steps(engines[0])
        assert deployment_replicas_of(k, "skew") == 4
        clock.now = T0 + 310
        await eventually(lambda: deployment_replicas_of(k, "skew") == 1)
        # Reported once: the memory now holds the clamped times.
        assert len([e for e in k.every(EVENTS) if e["reason"] == "ClockSkew"]) == 1
    assert_rbac_covers(k)


@pytest.mark.asyncio
async def test_external_mode_leaves_the_count_to_the_external_scaler(cluster, servers):
    k, clock = cluster, Clock(T0)
    spec = service("ext", {"minReplicas": 1, "maxReplicas": 4, "targetQueueDepth": 4})
    engine = await servers()
    engine.load(running=4, waiting=28)  # far above target: builtin mode would scale
    async with operator(k, clock):
        await create(k, spec)
        await eventually(lambda: deployment_replicas_of(k, "ext") == 1)
        await add_pod(k, "ext", "engine", engine)
        await eventually(lambda: deployment_replicas_of(k, "ext") == 4)

        # Handed to HPA/KEDA: the operator stops deciding and applies spec.replicas.
        mark = len(k)
        await api(k, "patch", url(ISVCS, "ext"), {
            "spec": {"replicas": 2, "autoscaling": {"mode": "external"}}
        })  # fmt: skip
        await eventually(lambda: deployment_replicas_of(k, "ext") == 2)
        await eventually(lambda: status_of(k, "ext").get("desiredReplicas") == 2)
        scrapes = engine.scrapes
        # What /scale does when HPA or KEDA resizes: spec.replicas changes.
        await api(k, "patch", url(ISVCS, "ext"), {"spec": {"replicas": 3}})
        await eventually(lambda: deployment_replicas_of(k, "ext") == 3)
        await asyncio.sleep(8 * INTERVAL)
        assert engine.scrapes <= scrapes + 1  # one step may have been under way
        assert deployment_replicas_of(k, "ext") == 3
        assert status_of(k, "ext")["lastScaleDecision"]["to"] == 4  # the last builtin one
        # Every write since: the Deployment following spec.replicas, and status following it.
        status_writes = [
            r.data["status"]
            for r in by_operator(k, mark)
            if r.method.value == "PATCH" and r.url.path == url(ISVCS, "ext", "status")
        ]
        assert all("lastScaleDecision" not in s for s in status_writes)
        assert {s.get("desiredReplicas") for s in status_writes} <= {2, 3, None}
        deploy_writes = [
            r.data["spec"]["replicas"]
            for r in by_operator(k, mark)
            if r.method.value == "PATCH" and r.url.path == url(DEPLOYMENTS, "ext-engine")
        ]
        assert deploy_writes == [2, 3]
        assert set(writes(k, mark)) <= {
            f"PATCH {url(ISVCS, 'ext', 'status')}",
            f"PATCH {url(DEPLOYMENTS, 'ext-engine')}",
            f"POST {url(EVENTS)}",
        }
    assert_rbac_covers(k)


@pytest.mark.asyncio
async def test_a_repeated_series_is_no_phantom_load_and_a_conflicting_one_is_reported(
    cluster, servers
):
    k, clock = cluster, Clock(T0)
    spec = service("dup", {"minReplicas": 1, "maxReplicas": 4, "targetQueueDepth": 4})
    engine = await servers()
    series = f'{RUNNING}{{model_name="kvfleet-tiny-random-llama"}}'
    async with operator(k, clock):
        await create(k, spec)
        await eventually(lambda: deployment_replicas_of(k, "dup") == 1)
        pod = await add_pod(k, "dup", "engine", engine)
        # On target: 4 requests on one replica, the running series said three times.
        engine.load(running=4)
        engine.extra = f"{series} 4\n{series} 4.0\n"
        await steps(engine, 3)
        assert deployment_replicas_of(k, "dup") == 1
        assert "lastScaleDecision" not in status_of(k, "dup")
        assert status_of(k, "dup")["autoscaling"]["unreachablePods"] == []
        # The same series with another value: the pod's answer is unusable, and says why.
        engine.extra = f"{series} 40\n"
        await steps(engine)
        autoscaling = status_of(k, "dup")["autoscaling"]
        assert autoscaling["unreachablePods"] == [pod]
        assert autoscaling["unreachableReasons"][pod] == f"{RUNNING}: one series is both 4 and 40"
        assert deployment_replicas_of(k, "dup") == 1
    assert_rbac_covers(k)


@pytest.mark.asyncio
async def test_scale_up_waits_for_the_scale_up_window_of_the_spec(cluster, servers):
    k, clock = cluster, Clock(T0)
    spec = service("burst", {"minReplicas": 1, "maxReplicas": 4, "targetQueueDepth": 4,
                             "scaleUpStabilizationSeconds": 60})  # fmt: skip
    engine = await servers()
    async with operator(k, clock):
        await create(k, spec)
        await eventually(lambda: deployment_replicas_of(k, "burst") == 1)
        await add_pod(k, "burst", "engine", engine)
        await steps(engine)  # idle: 1 is recommended at T0

        # 16 in flight on one replica asks for 4, held while the 1 of T0 is inside 60 s. As
        # above, the clock moves only once the steps see the new load.
        engine.load(running=4, waiting=12)
        await steps(engine)
        for t in (0, 30, 59):
            clock.now = T0 + t
            await steps(engine)
            assert deployment_replicas_of(k, "burst") == 1, f"scaled up at {t}s"
            assert "lastScaleDecision" not in status_of(k, "burst")
        clock.now = T0 + 61
        await eventually(lambda: deployment_replicas_of(k, "burst") == 4)
        last = status_of(k, "burst")["lastScaleDecision"]
        assert (last["from"], last["to"]) == (1, 4)
    assert_rbac_covers(k)


@pytest.mark.asyncio
async def test_a_latency_target_scales_on_the_intervals_ttft(cluster, servers):
    k, clock = cluster, Clock(T0)
    spec = service("slo", {"minReplicas": 1, "maxReplicas": 4, "targetQueueDepth": 100,
                           "latencyTarget": {"metric": "ttft", "targetSeconds": 0.5}})  # fmt: skip
    engine = await servers()
    async with operator(k, clock):
        await create(k, spec)
        await eventually(lambda: deployment_replicas_of(k, "slo") == 1)
        await add_pod(k, "slo", "engine", engine)
        engine.load(running=2)
        # Many slow first tokens long ago (before the operator's first look), then only fast
        # ones: the interval's p90 is under the target, whatever the engine's lifetime says.
        engine.ttft = (0.0, 0.0, 1000.0)
        await steps(engine)
        engine.ttft = (50.0, 50.0, 1050.0)
        await steps(engine)
        assert deployment_replicas_of(k, "slo") == 1

        # Now every first token of the interval takes 0.1-1 s: p90 0.91 s against 0.5 s.
        count = 1050.0
        for _ in range(3):
            count += 100
            engine.ttft = (50.0, count - 1000, count)
            await steps(engine, 1)
        await eventually(lambda: deployment_replicas_of(k, "slo") == 2)
        last = status_of(k, "slo")["lastScaleDecision"]
        assert (last["from"], last["to"], last["signal"]) == (1, 2, "latency")
        assert last["reason"].startswith("p90 TTFT 0.9")
        assert 0.85 < last["metrics"]["latencySeconds"] < 0.95
    assert_rbac_covers(k)
