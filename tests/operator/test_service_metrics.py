"""The operator's own series about the services it serves, which the chart's alerts read
(charts/kvfleet/templates/prometheusrule.yaml): replicas desired and ready, what the built-in
autoscaler asks for against maxReplicas, and reconciles that fail."""

from __future__ import annotations

import contextlib
import copy
import re
from collections.abc import AsyncIterator

import prometheus_client
import pytest
from aiohttp import web

import kvfleet.operator.main  # noqa: F401  (registers the operator's metrics)
from kvfleet.engine.config import EngineArgs
from kvfleet.engine.metrics import EngineMetrics
from kvfleet.operator.main import build_registry, build_settings
from kvfleet.operator.resources import common_labels
from kvfleet.operator.scaling_policy import (
    Observation,
    PodMetrics,
    ScalingMemory,
    ScalingPolicy,
    decide,
)
from tests.support.engine import idle_stats
from tests.support.kmock import (
    CONFIG,
    DEMO,
    DEPLOYMENTS,
    ISVCS,
    NS,
    PODS,
    ROOT,
    APIServer,
    Fault,
    api,
    create,
    eventually,
    kube_for,
    run_operator,
    url,
)
from tests.support.servers import serving

T0 = 1_750_000_000.0
SERVICE = f"{NS}/llm"


def sample(name: str, **labels: str) -> float | None:
    return prometheus_client.REGISTRY.get_sample_value(name, labels)


def replicas(kind: str) -> float | None:
    return sample(f"kvfleet_operator_{kind}_replicas", inferenceservice=SERVICE)


def test_the_decision_says_what_the_signals_wanted_beyond_the_bound():
    policy = ScalingPolicy(min_replicas=1, max_replicas=2, target_queue_depth=2)
    busy = [PodMetrics("e0", running=2, waiting=10, kv_cache_usage=0.5)]
    decision = decide(policy, Observation(1, busy), ScalingMemory(last_active=T0), T0)
    assert decision.replicas == 2 and decision.wanted == 6
    assert decision.wanted > policy.max_replicas  # what the at-maxReplicas alert reads
    calm = [PodMetrics("e0", running=1, waiting=0, kv_cache_usage=0.1)]
    assert decide(policy, Observation(1, calm), ScalingMemory(last_active=T0), T0).wanted == 1


@contextlib.asynccontextmanager
async def engine_metrics(waiting: int) -> AsyncIterator[int]:
    """An engine's /metrics as the engine exports it, with `waiting` requests queued; yields its
    port."""
    stats = idle_stats(num_requests_waiting=waiting)
    metrics = EngineMetrics(EngineArgs(model="unused", max_num_seqs=16), "smollm2-135m-instruct")
    metrics.collect_state(lambda: stats)

    async def scrape(_: web.Request) -> web.Response:
        return web.Response(body=prometheus_client.generate_latest(metrics.registry))

    app = web.Application()
    app.router.add_get("/metrics", scrape)
    async with serving(app) as address:
        yield int(address.rsplit(":", 1)[1])


async def add_ready_engine_pod(k: APIServer, port: int) -> None:
    await api(k, "post", url(PODS), {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "llm-engine-0", "namespace": NS,
                     "labels": common_labels("llm", "engine")},
        "spec": {"containers": [{"name": "engine", "image": "x",
                                 "ports": [{"name": "http", "containerPort": port}]}]},
        "status": {"podIP": "127.0.0.1", "phase": "Running",
                   "conditions": [{"type": "Ready", "status": "True"}]},
    })  # fmt: skip


async def mark_engine_ready(k: APIServer) -> None:
    deploy = k.live(DEPLOYMENTS, NS, "llm-engine")
    assert deploy is not None
    status = {"observedGeneration": deploy["metadata"]["generation"], "replicas": 1,
              "updatedReplicas": 1, "readyReplicas": 1, "availableReplicas": 1}  # fmt: skip
    await api(k, "patch", url(DEPLOYMENTS, "llm-engine", "status"), {"status": status})


@contextlib.asynccontextmanager
async def operator(k: APIServer) -> AsyncIterator[None]:
    settings = build_settings()
    registry = build_registry(settings, CONFIG, debounce=0.02, backoff=0.2,
                              autoscale_interval=0.25, scrape_timeout=0.5,
                              kube=kube_for(k))  # fmt: skip
    async with run_operator(registry, settings):
        yield


@pytest.mark.asyncio
async def test_replica_gauges_follow_the_service_and_go_with_it(cluster):
    k = cluster
    spec = copy.deepcopy(DEMO)
    spec["spec"]["autoscaling"] = {"minReplicas": 1, "maxReplicas": 1, "targetQueueDepth": 1}
    async with operator(k), engine_metrics(waiting=5) as port:
        await create(k, spec, "llm")
        await eventually(lambda: replicas("desired") == 1 and replicas("ready") == 0)
        await mark_engine_ready(k)
        await eventually(lambda: replicas("ready") == 1)
        # Five queued on one replica, one per replica wanted, at most one allowed.
        await add_ready_engine_pod(k, port)
        await eventually(lambda: replicas("wanted") == 5 and replicas("max") == 1)

        await api(k, "delete", url(ISVCS, "llm"))
        await eventually(
            lambda: all(replicas(kind) is None for kind in ("desired", "ready", "wanted", "max"))
        )


@pytest.mark.asyncio
async def test_a_failing_reconcile_is_counted_by_cause(cluster):
    k = cluster

    def failures(reason: str) -> float:
        value = sample("kvfleet_operator_reconcile_failures_total", reason=reason)
        assert value is not None  # labelled from the start
        return value

    before = failures("ApplyFailed")
    k.inject(Fault("PATCH", url(DEPLOYMENTS, "llm-engine"), 422, times=None))
    async with operator(k):
        await create(k, DEMO, "llm")
        await eventually(lambda: failures("ApplyFailed") >= before + 2)
    assert failures("NameConflict") >= 0 and failures("Error") >= 0


def test_every_operator_metric_is_documented():
    doc = (ROOT / "docs" / "metrics.md").read_text()
    tabled = set(re.findall(r"^\| `(kvfleet_operator_\w+)", doc, re.M))
    registered = {
        family.name + ("_total" if family.type == "counter" else "")
        for family in prometheus_client.REGISTRY.collect()
        if family.name.startswith("kvfleet_operator_")
    }
    assert registered and tabled == registered
