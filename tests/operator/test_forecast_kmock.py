"""Scaling ahead under the real kopf runtime against kmock: two services, one with scaleAhead
and one without, see the same rising load; the one that learned its engines' start time from
its pod scales up that much earlier, and keeps the start time in its status.

Time: the loop runs every INTERVAL real seconds; the load and the decisions' times follow a fake
clock the test moves in steps of STEP seconds, each held for a few loop intervals."""

from __future__ import annotations

import copy
import datetime
from collections.abc import Callable
from typing import Any

import pytest
from aiohttp import web

from kvfleet.operator.main import build_registry, build_settings
from kvfleet.operator.resources import common_labels
from tests.support.kmock import (
    CONFIG,
    DEMO,
    DEPLOYMENTS,
    ISVCS,
    NS,
    PODS,
    APIServer,
    api,
    assert_rbac_covers,
    create,
    eventually,
    kube_for,
    run_operator,
    url,
)
from tests.support.servers import serving

INTERVAL = 0.1
STEP = 5.0
T0 = 1_750_000_000.0
START_SECONDS = 20.0


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def gauges(in_flight: Callable[[], float], scrapes: list[float]) -> web.Application:
    """An engine's /metrics with `in_flight()` requests running; counts its scrapes."""

    async def metrics(_: web.Request) -> web.Response:
        scrapes.append(1)
        label = '{model_name="m"}'
        body = "".join(
            f"# TYPE {name} gauge\n{name}{label} {value}\n"
            for name, value in (
                ("vllm:num_requests_running", in_flight()),
                ("vllm:num_requests_waiting", 0.0),
                ("vllm:kv_cache_usage_perc", 0.1),
            )
        )
        return web.Response(text=body, content_type="text/plain")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    return app


async def add_engine(k: APIServer, isvc: str, port: int) -> None:
    """A Ready engine pod of `isvc` that took START_SECONDS from its creation to Ready."""
    name = f"{isvc}-engine-0"
    await api(k, "post", url(PODS), {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NS, "labels": common_labels(isvc, "engine")},
        "spec": {"containers": [{"name": "engine", "image": "x",
                                 "ports": [{"name": "http", "containerPort": port}]}]},
    })  # fmt: skip
    created = datetime.datetime.fromisoformat(
        k.live(PODS, NS, name)["metadata"]["creationTimestamp"]
    )
    ready = created + datetime.timedelta(seconds=START_SECONDS)
    await api(k, "patch", url(PODS, name, "status"), {"status": {
        "podIP": "127.0.0.1", "phase": "Running",
        "conditions": [{"type": "Ready", "status": "True",
                        "lastTransitionTime": ready.isoformat()}],
    }})  # fmt: skip


def service(name: str, scale_ahead: bool) -> dict[str, Any]:
    body = copy.deepcopy(DEMO)
    body["metadata"] = {"name": name}
    body["spec"]["autoscaling"] = {"minReplicas": 1, "maxReplicas": 4, "targetQueueDepth": 4,
                                   "scaleAhead": scale_ahead}  # fmt: skip
    return body


def status_of(k: APIServer, isvc: str) -> dict[str, Any]:
    return (k.live(ISVCS, NS, isvc) or {}).get("status") or {}


def deployment_replicas_of(k: APIServer, isvc: str) -> int | None:
    deploy = k.live(DEPLOYMENTS, NS, f"{isvc}-engine")
    return deploy["spec"]["replicas"] if deploy else None


@pytest.mark.asyncio
async def test_a_rising_load_scales_up_one_start_time_earlier_with_scale_ahead(cluster):
    k, clock = cluster, Clock(T0)

    # 1 request in flight until T0, then 0.1 more each second: 4.4 (target 4 per replica, 10%
    # tolerance) at 34 s; 4.4 one start time (20 s) ahead at 14 s.
    def load() -> float:
        return 1 + 0.1 * (clock.now - T0)

    settings = build_settings()
    registry = build_registry(
        settings, CONFIG, debounce=0.02, backoff=0.2, autoscale_interval=INTERVAL,
        scrape_timeout=0.5, clock=clock, kube=kube_for(k),
    )  # fmt: skip
    scrapes: dict[str, list[float]] = {"ahead": [], "plain": []}
    async with (
        serving(gauges(load, scrapes["ahead"])) as ahead_at,
        serving(gauges(load, scrapes["plain"])) as plain_at,
        run_operator(registry, settings),
    ):
        for name, at in (("ahead", ahead_at), ("plain", plain_at)):
            await create(k, service(name, scale_ahead=name == "ahead"))
            await eventually(lambda name=name: deployment_replicas_of(k, name) == 1)
            await add_engine(k, name, int(at.rsplit(":", 1)[1]))
        # The start time is learned from the pod and kept in status.
        for name in scrapes:
            learned = await eventually(
                lambda name=name: (
                    status_of(k, name).get("autoscaling", {}).get("engineStartSeconds")
                )
            )
            assert learned == pytest.approx(START_SECONDS, abs=0.5)

        async def hold() -> None:
            """A few steps of each service at the clock's time."""
            for seen in scrapes.values():
                target = len(seen) + 3
                await eventually(lambda seen=seen, target=target: len(seen) >= target)

        first_up: dict[str, float] = {}
        for i in range(10):
            clock.now = T0 + i * STEP
            await hold()
            for name in scrapes:
                if name not in first_up and (status_of(k, name).get("desiredReplicas") or 1) > 1:
                    first_up[name] = clock.now - T0
        assert first_up["ahead"] <= 20, first_up  # 15 s on time, one step's slack
        assert first_up["plain"] >= 35, first_up
        assert first_up["plain"] - first_up["ahead"] >= START_SECONDS - STEP
        last = status_of(k, "ahead")["lastScaleDecision"]
        assert (last["from"], last["to"], last["signal"]) == (1, 2, "forecast")
        assert last["metrics"]["forecastHorizonSeconds"] == pytest.approx(START_SECONDS, abs=0.5)
        assert "forecast:" in last["reason"] and "(the engine start time)" in last["reason"]
        assert status_of(k, "plain")["lastScaleDecision"]["signal"] == "queueDepth"
        await eventually(lambda: deployment_replicas_of(k, "ahead") == 2)
    assert_rbac_covers(k)
