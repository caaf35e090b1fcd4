"""Metrics are untrusted input: hostile /metrics bodies and values from fake pods on loopback.

Each bad pod must count as unreachable with its reason (and in the operator's failure counter),
never as a reason to scale, never stop the other pods' signals, and never cost the operator
more than a few MiB; 200 services x 3 pods are scraped within one interval.
"""

from __future__ import annotations

import asyncio
import math
import resource
import tracemalloc
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
import pytest_asyncio
from aiohttp import web
from prometheus_client import REGISTRY

from kvfleet.operator.metrics_scraper import MAX_BODY_BYTES, Scraper, Target
from kvfleet.operator.scaling_policy import (
    Observation,
    PodMetrics,
    ScalingMemory,
    ScalingPolicy,
    decide,
)
from kvfleet.telemetry.metric_names import KV_CACHE_USAGE, RUNNING, WAITING
from kvfleet.telemetry.metric_names import ROUTER_HELD_REQUESTS as HELD_REQUESTS

MiB = 2**20
INTERVAL = 10.0  # the autoscaler's default interval
POLICY = ScalingPolicy(min_replicas=1, max_replicas=10, target_queue_depth=4,
                       scale_down_stabilization_s=0)  # fmt: skip


def exposition(running: str = "0", waiting: str = "0", kv: str = "0.1") -> str:
    return (
        f'{RUNNING}{{model_name="m"}} {running}\n'
        f'{WAITING}{{model_name="m"}} {waiting}\n'
        f'{KV_CACHE_USAGE}{{model_name="m"}} {kv}\n'
    )


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@pytest_asyncio.fixture
async def pods() -> AsyncIterator[Callable[[dict[str, Handler]], Awaitable[list[Target]]]]:
    """Serve each named pod's handler at /<name>/metrics of one server; returns their targets."""
    runners: list[web.AppRunner] = []

    async def start(handlers: dict[str, Handler]) -> list[Target]:
        async def route(request: web.Request) -> web.StreamResponse:
            return await handlers[request.match_info["pod"]](request)

        app = web.Application()
        app.router.add_get("/{pod}/metrics", route)
        runner = web.AppRunner(app, shutdown_timeout=0.1)
        await runner.setup()
        # Every pod of the scale test connects at once.
        await web.TCPSite(runner, "127.0.0.1", 0, backlog=1024).start()
        runners.append(runner)
        port = runner.addresses[0][1]
        return [Target(name, f"http://127.0.0.1:{port}/{name}/metrics") for name in handlers]

    yield start
    for runner in runners:
        await runner.cleanup()


def answer(body: str | bytes, delay: float = 0.0) -> Handler:
    async def handler(_: web.Request) -> web.Response:
        await asyncio.sleep(delay)
        return web.Response(body=body.encode() if isinstance(body, str) else body)

    return handler


def stream(chunk: bytes, count: float, pause: float = 0.0, tail: bytes = b"") -> Handler:
    """A body of ``count`` copies of chunk (math.inf: endless) then tail, generated as it is
    sent."""

    async def handler(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        sent = 0
        try:
            while sent < count:
                await response.write(chunk)
                sent += 1
                await asyncio.sleep(pause)
            await response.write(tail)
        except (ConnectionError, RuntimeError):
            pass  # the scraper hung up: what these tests want
        return response

    return handler


def failures(reason: str) -> float:
    labels = {"reason": reason}
    return REGISTRY.get_sample_value("kvfleet_operator_scrape_failures_total", labels) or 0.0


# 1 MiB of lines the scraper must read through, none of them wanted (64-byte lines).
FILLER = (b"# " + b"." * 61 + b"\n") * 16384


# -- values ---------------------------------------------------------------------------------

HOSTILE_VALUES = {
    "nan-running": exposition(running="NaN"),
    "inf-waiting": exposition(waiting="+Inf"),
    "negative-waiting": exposition(waiting="-32"),
    "kv-50": exposition(kv="50"),
    "kv-minus-inf": exposition(kv="-Inf"),
    "huge-running": exposition(running="1e308"),
}


@pytest.mark.asyncio
async def test_impossible_values_make_a_pod_unreachable_with_the_reason(pods):
    before = failures("out_of_range")
    targets = await pods({name: answer(body) for name, body in HOSTILE_VALUES.items()})
    async with Scraper(timeout=2.0) as scraper:
        metrics = await scraper.engines(targets)
    assert not any(m.answered for m in metrics)
    errors = {m.pod: m.error for m in metrics}
    assert errors == {
        "nan-running": f"{RUNNING}: nan is outside [0, 1e+06]",
        "inf-waiting": f"{WAITING}: inf is outside [0, 1e+06]",
        "negative-waiting": f"{WAITING}: -32 is outside [0, 1e+06]",
        "kv-50": f"{KV_CACHE_USAGE}: 50 is outside [0, 1]",
        "kv-minus-inf": f"{KV_CACHE_USAGE}: -inf is outside [0, 1]",
        "huge-running": f"{RUNNING}: 1e+308 is outside [0, 1e+06]",
    }
    assert failures("out_of_range") - before == len(HOSTILE_VALUES)


@pytest.mark.parametrize("body", HOSTILE_VALUES.values(), ids=HOSTILE_VALUES.keys())
@pytest.mark.asyncio
async def test_one_bad_pod_never_stops_the_good_pods_driving_the_decision(pods, body):
    # The case: a sibling has 32 requests in flight against a target of 4.
    targets = await pods({"bad": answer(body), "busy": answer(exposition(running="32"))})
    async with Scraper(timeout=2.0) as scraper:
        metrics = await scraper.engines(targets)
    d = decide(POLICY, Observation(2, metrics), ScalingMemory(), 1000.0)
    assert d.replicas > 2, d.reason  # scaled up for the busy pod, never down for the bad one
    assert d.unanswered == ("bad",)
    assert "outside" in d.problems["bad"]


@pytest.mark.asyncio
async def test_a_routers_impossible_held_count_is_not_counted(pods):
    targets = await pods(
        {
            "r-nan": answer(f"{HELD_REQUESTS} NaN\n"),
            "r-neg": answer(f"{HELD_REQUESTS} -5\n"),
            "r-ok": answer(f"{HELD_REQUESTS} 3\n"),
        }
    )
    async with Scraper(timeout=2.0) as scraper:
        held, failed = await scraper.held_requests(targets)
    assert held == 3.0
    assert failed == {
        "r-nan": f"{HELD_REQUESTS}: nan is outside [0, 1e+06]",
        "r-neg": f"{HELD_REQUESTS}: -5 is outside [0, 1e+06]",
    }


@pytest.mark.asyncio
async def test_a_repeated_series_counts_once_and_a_conflicting_one_is_a_bad_answer(pods):
    # The engine repeats its running series: 8 requests must not read as 24.
    before = failures("conflicting_series")
    once = exposition(running="8")
    conflicting = once + f'{RUNNING}{{model_name="m"}} 16\n'
    targets = await pods(
        {
            "once": answer(once),
            "repeated": answer(once * 3),
            # Each repeat a MiB apart, so in a chunk of its own.
            "repeated-apart": stream(once.encode() + FILLER, 3),
            "conflicting": answer(conflicting),
            "conflicting-apart": stream(FILLER, 1, tail=conflicting.encode()),
        }
    )
    async with Scraper(timeout=5.0) as scraper:
        metrics = {m.pod: m for m in await scraper.engines(targets)}
    single = decide(POLICY, Observation(1, [metrics["once"]]), ScalingMemory(), 1000.0)
    assert metrics["once"].running == 8.0
    for name in ("repeated", "repeated-apart"):
        assert metrics[name] == PodMetrics(name, 8.0, 0.0, 0.1)
        d = decide(POLICY, Observation(1, [metrics[name]]), ScalingMemory(), 1000.0)
        assert (d.replicas, d.signals) == (single.replicas, single.signals)
    for name in ("conflicting", "conflicting-apart"):
        assert not metrics[name].answered
        assert metrics[name].error == f"{RUNNING}: one series is both 8 and 16"
        d = decide(
            POLICY, Observation(1, [metrics[name], metrics["once"]]), ScalingMemory(), 1000.0
        )
        assert d.unanswered == (name,) and "both 8 and 16" in d.problems[name]
    assert failures("conflicting_series") - before == 2


BAD_PODS = {
    "nan": PodMetrics("nan", math.nan, 0.0, 0.1),
    "inf": PodMetrics("inf", 0.0, math.inf, 0.1),
    "negative": PodMetrics("negative", 0.0, -32.0, 0.1),
    "kv-50": PodMetrics("kv-50", 0.0, 0.0, 50.0),
    "huge": PodMetrics("huge", 1e308, 0.0, 0.1),
}


@pytest.mark.parametrize("bad", BAD_PODS.values(), ids=BAD_PODS.keys())
def test_decide_rejects_impossible_values_at_its_boundary(bad):
    # Built directly, bypassing the scraper: decide must not raise, nor scale on them.
    busy = PodMetrics("busy", 32.0, 0.0, 0.1)
    d = decide(POLICY, Observation(2, [bad, busy]), ScalingMemory(), 1000.0)
    assert d.unanswered == (bad.pod,) and "outside" in d.problems[bad.pod]
    assert d.replicas > 2
    idle = PodMetrics("idle", 0.0, 0.0, 0.0)
    held = decide(POLICY, Observation(2, [bad, idle]), ScalingMemory(), 1000.0)
    assert held.replicas == 2  # held, not down
    assert decide(POLICY, Observation(2, [bad]), ScalingMemory(), 1000.0).replicas == 2


@pytest.mark.parametrize("held", [math.nan, math.inf, -math.inf, -3.0])
def test_decide_ignores_an_impossible_held_count(held):
    d = decide(
        ScalingPolicy(min_replicas=0),
        Observation(0, [], held_requests=held),
        ScalingMemory(),
        1000.0,
    )
    assert d.replicas == 0 and d.signals["held"] == 0.0


# -- bodies ---------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_bodies_that_are_not_utf8_or_not_metrics_are_reasons(pods):
    before = {r: failures(r) for r in ("not_utf8", "unparsable", "missing")}
    targets = await pods(
        {
            "latin1": answer(exposition().encode() + b'x{label="caf\xe9"} 1\n'),
            "binary": answer(bytes(range(256)) * 16),
            "broken-sample": answer(exposition(running="three")),
            "html": answer("<html>502 Bad Gateway</html>\n"),
            "good": answer(exposition(running="2")),
        }
    )
    async with Scraper(timeout=2.0) as scraper:
        metrics = await scraper.engines(targets)
    errors = {m.pod: m.error for m in metrics}
    assert errors.pop("good") is None
    assert errors["latin1"].startswith("metrics body is not UTF-8")
    assert errors["binary"].startswith("metrics body is not UTF-8")
    assert errors["broken-sample"].startswith("unreadable metrics")
    assert errors["html"].startswith("metrics lack")
    assert failures("not_utf8") - before["not_utf8"] == 2
    assert failures("unparsable") - before["unparsable"] == 1
    assert failures("missing") - before["missing"] == 1


@pytest.mark.asyncio
async def test_a_100_mb_body_and_an_endless_stream_are_cut_at_the_limit(pods):
    loop = asyncio.get_running_loop()
    targets = await pods(
        {
            "100mb": stream(FILLER, 100),
            "endless": stream(FILLER, math.inf),
            "one-line": stream(b"#" * MiB, math.inf),  # no newline ever
            "good": answer(exposition(running="2")),
        }
    )
    started = loop.time()
    async with Scraper(timeout=5.0) as scraper:
        metrics = await scraper.engines(targets)
    assert loop.time() - started < 5.0  # cut at the size limit, well before the deadline
    errors = {m.pod: m.error for m in metrics}
    assert errors == {
        "100mb": f"metrics body over {MAX_BODY_BYTES} bytes",
        "endless": f"metrics body over {MAX_BODY_BYTES} bytes",
        "one-line": "a metrics line over 65536 characters",
        "good": None,
    }


@pytest.mark.asyncio
async def test_a_slow_endless_stream_is_cut_at_the_deadline(pods):
    loop = asyncio.get_running_loop()
    targets = await pods({"drip": stream(b"# x\n", math.inf, pause=0.01)})
    started = loop.time()
    async with Scraper(timeout=0.5) as scraper:
        (metrics,) = await scraper.engines(targets)
    assert 0.5 <= loop.time() - started < 2.0
    assert metrics.error == "no metrics within 0.5s"


@pytest.mark.asyncio
async def test_a_1_gb_body_is_reported_too_large_in_a_few_mib(pods):
    """The chart's memory limit is 512Mi; the 1 GB body is generated as it is sent, and the
    measure includes the fake server's own allocations, so it bounds the scraper's from above."""
    targets = await pods({"huge": stream(FILLER, 1024), "good": answer(exposition())})
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    tracemalloc.start()
    try:
        async with Scraper(timeout=20.0) as scraper:
            metrics = await scraper.engines(targets)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    rss_growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss_before
    assert metrics[0].error == f"metrics body over {MAX_BODY_BYTES} bytes"
    assert metrics[1].answered
    assert peak < 16 * MiB, f"peak {peak / MiB:.1f} MiB"
    assert rss_growth < 64 * MiB, f"RSS grew {rss_growth / MiB:.1f} MiB"


@pytest.mark.asyncio
async def test_memory_is_bounded_by_the_stream_not_the_body(pods):
    """With the size limit lifted, a 1 GiB body is read through in a few MiB: only wanted lines
    are kept, a chunk at a time, and a series said 1024 times is remembered once."""
    tail = f"{WAITING} 0\n{KV_CACHE_USAGE} 0.5\n".encode()
    targets = await pods({"big": stream(FILLER + f"{RUNNING} 1\n".encode(), 1024, tail=tail)})
    tracemalloc.start()
    try:
        async with Scraper(timeout=60.0, max_body_bytes=2**31) as scraper:
            (metrics,) = await scraper.engines(targets)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert metrics == PodMetrics("big", running=1.0, waiting=0.0, kv_cache_usage=0.5)
    assert peak < 16 * MiB, f"peak {peak / MiB:.1f} MiB"


# -- scale ----------------------------------------------------------------------------------


async def scrape_services(scraper: Scraper, targets: list[Target]) -> list[PodMetrics]:
    """As the autoscaler does: one concurrent scrape per service of 3 pods."""
    services = [targets[i : i + 3] for i in range(0, len(targets), 3)]
    results = await asyncio.gather(*(scraper.engines(pods) for pods in services))
    return [m for service in results for m in service]


@pytest.mark.asyncio
async def test_200_services_of_3_pods_answering_in_1s_within_one_interval(pods):
    # The case: pods answering in 1.0 s with a 2 s timeout.
    slow = answer(exposition(running="1"), delay=1.0)
    targets = [
        t for server in range(4) for t in await pods({f"s{server}-{i}": slow for i in range(150)})
    ]
    assert len(targets) == 600
    loop = asyncio.get_running_loop()
    started = loop.time()
    async with Scraper(timeout=2.0) as scraper:
        metrics = await scrape_services(scraper, targets)
    elapsed = loop.time() - started
    assert [m.error for m in metrics if not m.answered] == []
    assert elapsed < INTERVAL / 2, f"{elapsed:.1f}s"
    # Fewer slots than pods: the waves queue, but waiting for a slot is not the pod's timeout.
    started = loop.time()
    async with Scraper(timeout=2.0, max_concurrent=100, slot_wait=INTERVAL) as scraper:
        metrics = await scrape_services(scraper, targets)
    assert [m.error for m in metrics if not m.answered] == []
    assert 6.0 <= loop.time() - started < INTERVAL + 2


@pytest.mark.asyncio
async def test_the_wait_for_a_slot_has_its_own_deadline(pods):
    before = failures("no_slot")
    targets = await pods({f"p{i}": answer(exposition(), delay=0.5) for i in range(3)})
    async with Scraper(timeout=2.0, max_concurrent=1, slot_wait=0.2) as scraper:
        metrics = await scraper.engines(targets)
    assert [m.error for m in metrics].count("no scrape slot within 0.2s") == 2
    assert sum(m.answered for m in metrics) == 1
    assert failures("no_slot") - before == 2
