"""The router's load from the engines' own /metrics: the estimate between scrapes, the slack
rule, and a router in front of fake engines that report load from other routers' traffic, or
answer /metrics with hostile bodies."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from kvfleet.router.engine_load import (
    MAX_BODY_BYTES,
    MAX_SERIES,
    EngineReport,
    estimated_load,
    has_free_slots,
    report_of,
)
from kvfleet.router.main import parse_args, settings_from
from kvfleet.router.proxy import Balancer, Router, build_app
from kvfleet.router.settings import RouterSettings
from kvfleet.telemetry.metric_names import KV_CACHE_USAGE, MAX_NUM_SEQS, RUNNING, WAITING
from kvfleet.telemetry.metrics_reader import ScrapeError
from tests.support.servers import serving

INTERVAL = 0.05

# ------------------------------------------------------------------------------------------
# The estimate and the slack rule (pure)
# ------------------------------------------------------------------------------------------


def test_without_a_report_the_load_is_the_own_count() -> None:
    assert estimated_load(3, None) == 3
    assert not has_free_slots(0, None)


def test_the_estimate_adds_own_requests_started_and_finished_since_the_scrape() -> None:
    report = EngineReport(running=10, waiting=5, max_num_seqs=16, own_at_scrape=2)
    assert estimated_load(2, report) == 15  # as scraped
    assert estimated_load(6, report) == 19  # four more started since
    assert estimated_load(0, report) == 13  # both of ours finished since
    # Never below what this router alone has there (the engine's numbers lag).
    stale = EngineReport(running=0, waiting=0, max_num_seqs=16, own_at_scrape=0)
    assert estimated_load(4, stale) == 4


def test_free_slots_need_an_empty_queue_and_a_batch_below_its_size() -> None:
    def free(own: int, running: int, waiting: int, batch: int | None, at: int = 0) -> bool:
        return has_free_slots(own, EngineReport(running, waiting, batch, at))

    assert free(0, 7, 0, 8)
    assert not free(0, 8, 0, 8)  # the batch is full
    assert not free(1, 7, 0, 8)  # one of ours started since and fills it
    assert free(0, 7, 0, 8, at=1)  # one of ours finished since
    assert not free(0, 1, 1, 8)  # something waits: the engine is not starting requests at once
    assert not free(0, 0, 0, None)  # an engine that does not say its batch size


def sample_lines(**values: float) -> list[str]:
    names = {"running": RUNNING, "waiting": WAITING, "batch": MAX_NUM_SEQS, "kv": KV_CACHE_USAGE}
    return [f'{names[k]}{{model_name="m"}} {v}' for k, v in values.items()]


def test_parse_sums_series_and_checks_values() -> None:
    lines = [*sample_lines(running=3, waiting=2, batch=64), f'{RUNNING}{{model_name="n"}} 4']
    assert report_of(lines, 5) == EngineReport(7, 2, 64, 5)
    assert report_of(sample_lines(running=1, waiting=0), 0).max_num_seqs is None
    assert report_of(sample_lines(running=1, waiting=0, kv=0.25), 0).kv_usage == 0.25
    assert report_of(sample_lines(running=1, waiting=0), 0).kv_usage is None
    # A series said twice counts once: the engine's 3 running requests are not 6.
    twice = [*sample_lines(running=3, waiting=2), *sample_lines(running=3)]
    assert report_of(twice, 0) == EngineReport(3, 2, None, 0)
    bad = [
        (sample_lines(running=1), "missing"),
        (sample_lines(running=-1, waiting=0), "out_of_range"),
        (sample_lines(running=math.nan, waiting=0), "out_of_range"),
        (sample_lines(running=1e12, waiting=0), "out_of_range"),
        (sample_lines(running=1, waiting=0, batch=math.inf), "out_of_range"),
        (sample_lines(running=1, waiting=0, kv=1.5), "out_of_range"),  # a fraction of the cache
        ([f'{RUNNING}{{model_name="m"}} many'], "unparsable"),
        ([*sample_lines(running=3, waiting=0), *sample_lines(running=4)], "conflicting_series"),
    ]
    for lines, reason in bad:
        with pytest.raises(ScrapeError) as e:
            report_of(lines, 0)
        assert e.value.reason == reason, lines


def test_the_balancer_counts_the_fleet_and_lets_free_engines_take_their_keys() -> None:
    b = Balancer()
    b.set_endpoints(["a", "b", "c"])
    key = next(f"k{i}" for i in range(1000) if b.ring.home(f"k{i}") == "a")
    # Another router's traffic fills "a": its requests are far over the mean.
    b.report("a", EngineReport(running=8, waiting=30, max_num_seqs=8, own_at_scrape=0))
    for ep in ("b", "c"):
        b.report(ep, EngineReport(running=0, waiting=0, max_num_seqs=8, own_at_scrape=0))
    assert b.load() == {"a": 38, "b": 0, "c": 0}
    assert b.choose(key) != "a" and b.choose(None) != "a"
    # A failed scrape of "a" leaves only this router's own count there: "a" is idle again.
    b.report("a", None)
    assert b.load()["a"] == 0 and b.choose(key) == "a"
    # Reports of an endpoint that left (scraped as it went) are dropped.
    b.set_endpoints(["b", "c"])
    b.report("a", EngineReport(1, 0, 8, 0))
    assert set(b.reports) == {"b", "c"}


def test_settings_and_flag() -> None:
    base = ["--endpoints", "e:1"]
    assert settings_from(parse_args(base)).engine_load_interval == 1.0
    assert RouterSettings().engine_load_interval == 1.0
    off = parse_args([*base, "--engine-load-interval", "0"])
    assert settings_from(off).engine_load_interval == 0
    assert Router(settings_from(off)).poller is None
    for bad in ("-1", "nan", "inf"):
        with pytest.raises(SystemExit):
            parse_args([*base, "--engine-load-interval", bad])


# ------------------------------------------------------------------------------------------
# A router in front of fake engines that report their load
# ------------------------------------------------------------------------------------------


class Engine:
    """Answers chat requests after ``hold`` seconds; its /metrics reports the requests it is
    running plus ``others`` (running, waiting) from other routers' traffic, or, with
    ``hostile``, a body that must not hurt the router."""

    def __init__(self, name: str, hold: float = 0.0, hostile: str | None = None) -> None:
        self.name, self.hold, self.hostile = name, hold, hostile
        self.others: tuple[int, int] = (0, 0)
        self.batch = 8
        self.active = 0
        self.scrapes = 0
        self.full = False  # answers 429 queue_full, whatever its /metrics said a moment ago

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/metrics", self.metrics)
        return app

    async def chat(self, request: web.Request) -> web.Response:
        await request.read()
        if self.full:
            error = {"message": "queue full", "type": "x", "param": None, "code": "queue_full"}
            return web.json_response({"error": error}, status=429, headers={"Retry-After": "1"})
        self.active += 1
        try:
            await asyncio.sleep(self.hold)
        finally:
            self.active -= 1
        return web.json_response({"engine": self.name})

    async def metrics(self, request: web.Request) -> web.StreamResponse:
        self.scrapes += 1
        if self.hostile is not None:
            return await self._hostile(request)
        running, waiting = self.others
        text = (
            f"# HELP {RUNNING} Requests in the running batch.\n# TYPE {RUNNING} gauge\n"
            f'{RUNNING}{{model_name="m"}} {self.active + running}\n'
            f'{WAITING}{{model_name="m"}} {waiting}\n'
            f'{MAX_NUM_SEQS}{{model_name="m"}} {self.batch}\n'
            # Names the wanted ones prefix: not read.
            f'{RUNNING}_total{{model_name="m"}} 999\n'
        )
        return web.Response(text=text)

    async def _hostile(self, request: web.Request) -> web.StreamResponse:
        good = "\n".join(sample_lines(running=0, waiting=0, batch=8)) + "\n"
        resp = web.StreamResponse()
        match self.hostile:
            case "endless":  # valid comment lines without end, as fast as they go
                await resp.prepare(request)
                while True:
                    await resp.write(b"# filler filler filler filler\n" * 4096)
            case "huge":  # a valid exposition, padded past the byte limit
                await resp.prepare(request)
                await resp.write(b"# pad\n" * (MAX_BODY_BYTES // 5) + good.encode())
            case "long_line":
                await resp.prepare(request)
                await resp.write(b"x" * 100_000)
            case "slow":  # the numbers come, long after the deadline
                await resp.prepare(request)
                await asyncio.sleep(30)
                await resp.write(good.encode())
            case "not_utf8":
                await resp.prepare(request)
                await resp.write(good.encode() + b"\xff\xfe\xfd\n")
            case "garbage":
                await resp.prepare(request)
                await resp.write(f'{RUNNING}{{model_name="m" 1 2 3 }}}}\n{WAITING} x\n'.encode())
            case "series":
                await resp.prepare(request)
                await resp.write(
                    "".join(f'{RUNNING}{{i="{i}"}} 0\n' for i in range(MAX_SERIES + 1)).encode()
                )
            case "status":
                return web.Response(status=500, text="no")
            case _:
                raise AssertionError(self.hostile)
        await resp.write_eof()
        return resp


@asynccontextmanager
async def fleet(
    *engines: Engine, interval: float = INTERVAL
) -> AsyncIterator[tuple[Router, str, list[str]]]:
    async with contextlib.AsyncExitStack() as stack:
        addrs = [await stack.enter_async_context(serving(e.app())) for e in engines]
        router = Router(RouterSettings(engine_load_interval=interval))
        router.set_endpoints(addrs)
        url = await stack.enter_async_context(serving(build_app(router)))
        yield router, f"http://{url}", addrs


async def until(condition: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


def sessions_homed_at(router: Router, endpoint: str, n: int) -> list[str]:
    ring = router.balancer.ring
    return [f"s{i}" for i in range(10_000) if ring.home(f"session:s{i}") == endpoint][:n]


async def chat(s: aiohttp.ClientSession, url: str, session_id: str) -> str:
    async with s.post(
        f"{url}/v1/chat/completions",
        json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
        headers={"x-session-id": session_id},
    ) as r:
        assert r.status == 200, await r.text()
        return (await r.json())["engine"]


def spilled(router: Router) -> float:
    return router.metrics.registry.get_sample_value("kvfleet_router_spilled_total") or 0.0


def load_failures(router: Router, endpoint: str, reason: str) -> float:
    labels = {"endpoint": endpoint, "reason": reason}
    value = router.metrics.registry.get_sample_value(
        "kvfleet_router_engine_load_failures_total", labels
    )
    return value or 0.0


@pytest.mark.asyncio
async def test_an_engine_deep_in_other_routers_traffic_gets_no_keyed_requests() -> None:
    busy, b, c = Engine("busy"), Engine("b"), Engine("c")
    busy.others = (8, 40)  # a full batch and a queue, all from other routers
    async with fleet(busy, b, c) as (router, url, addrs), aiohttp.ClientSession() as s:
        await until(lambda: len(router.balancer.reports) == 3)
        assert router.balancer.load()[addrs[0]] == 48
        served = [await chat(s, url, sid) for sid in sessions_homed_at(router, addrs[0], 10)]
        assert "busy" not in served and spilled(router) == 10
        async with s.get(f"{url}/metrics") as r:
            text = await r.text()
        assert f'kvfleet_router_engine_load{{endpoint="{addrs[0]}"}} 48.0' in text
        # Its queue drains: its keys come home.
        busy.others = (0, 0)
        await until(lambda: router.balancer.load()[addrs[0]] == 0)
        assert await chat(s, url, sessions_homed_at(router, addrs[0], 1)[0]) == "busy"


@pytest.mark.asyncio
async def test_a_full_engines_429_still_goes_to_another_engine() -> None:
    """Its last report said free slots: the walk passes it by on the retry all the same."""
    full, b, c = Engine("full"), Engine("b"), Engine("c")
    full.full = True
    async with fleet(full, b, c) as (router, url, addrs), aiohttp.ClientSession() as s:
        await until(lambda: len(router.balancer.reports) == 3)
        assert addrs[0] in router.balancer.free()
        for sid in sessions_homed_at(router, addrs[0], 3):
            assert await chat(s, url, sid) in ("b", "c")
        assert router.metrics.registry.get_sample_value("kvfleet_router_retries_total") == 3


async def burst(url: str, session_id: str, n: int) -> Counter[str]:
    """n requests of one session at once."""
    async with aiohttp.ClientSession() as s:
        return Counter(await asyncio.gather(*(chat(s, url, session_id) for _ in range(n))))


@pytest.mark.asyncio
async def test_at_low_load_a_key_stays_home_while_its_engine_has_free_slots() -> None:
    engines = [Engine(name, hold=0.3) for name in "abc"]
    async with fleet(*engines) as (router, url, addrs):
        await until(lambda: len(router.balancer.reports) == 3)
        sid = sessions_homed_at(router, addrs[0], 1)[0]
        # Six at once on a batch of eight: by the bound alone (6 requests over 3 engines) all
        # but the first two would spill to cold caches.
        assert await burst(url, sid, 6) == {"a": 6}
        assert spilled(router) == 0
        # Past the batch size the home engine would queue them: the bound decides again.
        served = await burst(url, sid, 12)
        assert served["a"] < 12 and spilled(router) > 0
    # Without the engines' numbers (the old behaviour) the same burst spills.
    async with fleet(*engines, interval=0) as (router, url, addrs):
        sid = sessions_homed_at(router, addrs[0], 1)[0]
        assert (await burst(url, sid, 6))["a"] < 6 and spilled(router) > 0


HOSTILE = {
    "endless": "too_large",
    "huge": "too_large",
    "long_line": "too_large",
    "slow": "timeout",
    "not_utf8": "not_utf8",
    "garbage": "unparsable",
    "series": "too_many_series",
    "status": "http_status",
}


@pytest.mark.asyncio
async def test_hostile_metrics_leave_the_router_serving_on_its_own_counts() -> None:
    engines = [Engine(mode, hostile=mode) for mode in HOSTILE]
    async with fleet(*engines) as (router, url, addrs), aiohttp.ClientSession() as s:
        await until(lambda: all(e.scrapes >= 2 for e in engines))
        # The event loop stays free while eight hostile scrapes run every 50 ms.
        worst = 0.0
        for _ in range(20):
            started = time.monotonic()
            async with s.get(f"{url}/health") as r:
                assert r.status == 200
            worst = max(worst, time.monotonic() - started)
        assert worst < 0.5
        await until(
            lambda: all(
                load_failures(router, addr, reason) >= 1
                for addr, reason in zip(addrs, HOSTILE.values(), strict=True)
            )
        )
        assert router.balancer.reports == {}
        by_engine = {addr: e.name for addr, e in zip(addrs, engines, strict=True)}
        for addr in addrs:
            sid = sessions_homed_at(router, addr, 1)[0]
            assert await chat(s, url, sid) == by_engine[addr]
        assert router.balancer.load() == dict.fromkeys(addrs, 0)
