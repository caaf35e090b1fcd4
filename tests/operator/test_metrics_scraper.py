"""The metrics scraper against real HTTP servers: parsing, pod targets, timeouts and failures."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
import pytest_asyncio
from aiohttp import web

from kvfleet.operator.metrics_scraper import Scraper, Target, ready_targets
from kvfleet.operator.scaling_policy import PodMetrics
from kvfleet.telemetry.metric_names import KV_CACHE_USAGE, RUNNING, WAITING
from kvfleet.telemetry.metric_names import ROUTER_HELD_REQUESTS as HELD_REQUESTS
from kvfleet.telemetry.metrics_reader import ScrapeError, SeriesSums, bucket_key, parse_samples

ENGINE_TEXT = """\
# HELP vllm:num_requests_running Requests in the running batch.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="tiny"} 3.0
# HELP vllm:num_requests_waiting Requests waiting to be scheduled.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="tiny"} 5.0
# HELP vllm:kv_cache_usage_perc Fraction of KV-cache blocks in use (0..1).
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{model_name="tiny"} 0.25
# HELP vllm:prompt_tokens_total Prompt tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{model_name="tiny"} 1234.0
"""


def test_parse_reads_the_engine_gauges_and_sums_series():
    assert parse_samples(ENGINE_TEXT.splitlines(), (RUNNING, WAITING, KV_CACHE_USAGE)) == {
        RUNNING: 3.0,
        WAITING: 5.0,
        KV_CACHE_USAGE: 0.25,
    }
    two_models = (
        'vllm:num_requests_running{model_name="a"} 1\nvllm:num_requests_running{model_name="b"} 2\n'
    )
    assert parse_samples(two_models.splitlines(), (RUNNING, WAITING)) == {RUNNING: 3.0}
    router = f"# TYPE {HELD_REQUESTS} gauge\n{HELD_REQUESTS} 7\n"
    assert parse_samples(router.splitlines(), (HELD_REQUESTS,)) == {HELD_REQUESTS: 7.0}


def test_parse_rejects_what_is_not_the_exposition_format():
    with pytest.raises(ScrapeError) as e:
        parse_samples(["<html>502 Bad Gateway</html>"], (RUNNING,))
    assert e.value.reason == "unparsable"


def test_a_repeated_series_counts_once():
    # The engine: one series said three times is 8 requests, not 24.
    lines = [
        f'{RUNNING}{{model_name="m",rank="0"}} 8',
        f'{RUNNING}{{rank="0",model_name="m"}} 8.0',  # the same labels in another order
        f'{RUNNING}{{model_name="m",rank="0"}} 8',
        f'{RUNNING}{{model_name="other",rank="0"}} 1',  # another series: summed
        'h_bucket{le="1.0",model_name="m"} 5',
        'h_bucket{le="1.0",model_name="m"} 5',
        'h_bucket{le="+Inf",model_name="m"} 7',
    ]
    assert parse_samples(lines, (RUNNING, "h_bucket")) == {
        RUNNING: 9.0,
        bucket_key("h", "1.0"): 5.0,
        bucket_key("h", "+Inf"): 7.0,
    }


def test_a_series_repeated_with_another_value_is_a_bad_answer():
    lines = [f'{RUNNING}{{model_name="m"}} 8', f'{RUNNING}{{model_name="m"}} 16']
    with pytest.raises(ScrapeError) as e:
        parse_samples(lines, (RUNNING,))
    assert e.value.reason == "conflicting_series"
    assert str(e.value) == f"{RUNNING}: one series is both 8 and 16"


def test_series_are_counted_once_across_chunks_and_bounded():
    sums = SeriesSums((RUNNING, WAITING), max_series=3)
    sums.add([f"{RUNNING} 8", f'{WAITING}{{model_name="a"}} 1'])
    sums.add([f"{RUNNING} 8", f'{WAITING}{{model_name="b"}} 2'])  # the next chunk repeats one
    assert sums.sums == {RUNNING: 8.0, WAITING: 3.0}
    with pytest.raises(ScrapeError) as e:
        sums.add([f"{RUNNING} 9"])
    assert e.value.reason == "conflicting_series"
    with pytest.raises(ScrapeError) as e:
        sums.add([f'{WAITING}{{model_name="c"}} 0'])
    assert e.value.reason == "too_many_series"


def pod(name: str, ip: str | None = "10.0.0.1", ready: bool = True, **extra) -> dict:
    return {
        "metadata": {"name": name, **extra.get("metadata", {})},
        "spec": extra.get("spec", {"containers": [{"name": "engine"}]}),
        "status": {
            **({"podIP": ip} if ip else {}),
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


def test_targets_are_ready_pods_on_their_http_port():
    ported = {"containers": [{"name": "engine", "ports": [{"name": "http", "containerPort": 9}]}]}
    pods = [
        pod("b", spec=ported),
        pod("a"),
        pod("starting", ready=False),
        pod("no-ip", ip=None),
        pod("going", metadata={"deletionTimestamp": "2025-01-01T00:00:00Z"}),
        pod("v6", ip="fd00::1"),
    ]
    assert ready_targets(pods, 8000) == [
        Target("a", "http://10.0.0.1:8000/metrics"),
        Target("b", "http://10.0.0.1:9/metrics"),
        Target("v6", "http://[fd00::1]:8000/metrics"),
    ]


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@pytest_asyncio.fixture
async def serve() -> AsyncIterator[Callable[[Handler], Awaitable[str]]]:
    """Start an HTTP server answering /metrics with a handler; returns its /metrics URL."""
    runners: list[web.AppRunner] = []

    async def start(handler: Handler) -> str:
        app = web.Application()
        app.router.add_get("/metrics", handler)
        runner = web.AppRunner(app, shutdown_timeout=0.1)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        port = runner.addresses[0][1]
        return f"http://127.0.0.1:{port}/metrics"

    yield start
    for runner in runners:
        await runner.cleanup()


def text(body: str, status: int = 200) -> Handler:
    async def handler(_: web.Request) -> web.Response:
        return web.Response(text=body, status=status)

    return handler


async def hang(_: web.Request) -> web.Response:
    await asyncio.sleep(30)
    return web.Response(text=ENGINE_TEXT)


@pytest.mark.asyncio
async def test_engines_answer_or_are_reported_unanswered(serve):
    targets = [
        Target("good", await serve(text(ENGINE_TEXT))),
        Target("slow", await serve(hang)),
        Target("error", await serve(text("oops", status=500))),
        Target("garbage", await serve(text("<html>\n"))),
        Target("partial", await serve(text(ENGINE_TEXT.split("# HELP vllm:kv")[0]))),
        Target("refused", "http://127.0.0.1:1/metrics"),
    ]
    loop = asyncio.get_running_loop()
    started = loop.time()
    async with Scraper(timeout=0.5) as scraper:
        metrics = await scraper.engines(targets)
    # Concurrent, each bounded by its timeout: the hanging pod costs one timeout, not more.
    assert loop.time() - started < 3
    assert metrics[0] == PodMetrics("good", running=3.0, waiting=5.0, kv_cache_usage=0.25)
    assert metrics[0].in_flight == 8.0
    assert [m.pod for m in metrics if not m.answered] == [
        "slow",
        "error",
        "garbage",
        "partial",
        "refused",
    ]
    assert {m.pod: m.error for m in metrics[1:]} == {
        "slow": "no metrics within 0.5s",
        "error": "/metrics answered 500",
        "garbage": f"metrics lack {RUNNING}, {WAITING}, {KV_CACHE_USAGE}",
        "partial": f"metrics lack {KV_CACHE_USAGE}",
        "refused": metrics[-1].error,
    }
    assert metrics[-1].error.startswith("no metrics: ClientConnectorError")


@pytest.mark.asyncio
async def test_held_requests_are_summed_over_routers(serve):
    targets = [
        Target("r1", await serve(text(f"{HELD_REQUESTS} 2\n"))),
        Target("r2", await serve(text(f"{HELD_REQUESTS} 3\n"))),
        # A router whose gauge has no series yet holds nothing; a silent one is reported.
        Target("r3", await serve(text("# nothing held yet\n"))),
        Target("r4", await serve(hang)),
    ]
    async with Scraper(timeout=0.5) as scraper:
        held, silent = await scraper.held_requests(targets)
    assert (held, tuple(silent)) == (5.0, ("r4",))
    assert silent["r4"] == "no metrics within 0.5s"
