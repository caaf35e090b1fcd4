"""The router against hostile requests and failing engines (issues 15 and 35): it retries only
what no engine worked on, ejects failing engines and probes them back, answers engines that speak
garbage, break off or fall silent with a 502/504 or an error event and ejects them, parses bodies
within bounds and answers every refusal, malformed HTTP included, with an OpenAI-style error, and
times out slow clients."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import re
import time
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from kvfleet.protocol.json_body import nesting_exceeds
from kvfleet.router.breaker import BreakerPolicy, Breakers, State
from kvfleet.router.proxy import Router, build_runner
from kvfleet.router.request_body import BodyLimits
from kvfleet.router.settings import RouterSettings
from kvfleet.router.sse import DONE
from tests.support.servers import running, serving

CHAT = "/v1/chat/completions"


class Engine:
    """A fake engine; ``mode`` decides its answer to every generation request."""

    def __init__(self, mode: str = "ok") -> None:
        self.mode = mode
        self.hits = 0
        self.healthy = True
        self.health_checks = 0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/{tail:.*}", self.handle)
        app.router.add_get("/health", self.health)
        return app

    def served(self) -> AbstractAsyncContextManager[str]:
        return serving(self.app())

    async def health(self, _request: web.Request) -> web.Response:
        self.health_checks += 1
        return web.json_response({}, status=200 if self.healthy else 503)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.hits += 1
        await request.read()
        match self.mode:
            case "ok":
                return web.json_response({"engine": id(self)})
            case "dead":  # the engine died with this request in it
                return _err(503, "engine_dead")
            case "500":
                return _err(500, "request_failed")
            case "400":
                return _err(400, "invalid_request")
            case "draining":
                return _err(503, "draining", {"Retry-After": "2"})
            case "full":
                return _err(429, "queue_full", {"Retry-After": "3"})
            case "drop":  # read the request, then vanish without an answer
                assert request.transport is not None
                request.transport.close()
                await asyncio.sleep(1)
            case "slow":  # busy: a long generation, while its /health answers
                await asyncio.sleep(10)
        raise AssertionError(self.mode)


def _err(status: int, code: str, headers: dict[str, str] | None = None) -> web.Response:
    body = {"error": {"message": code, "type": "x", "param": None, "code": code}}
    return web.json_response(body, status=status, headers=headers)


@asynccontextmanager
async def routed(router: Router) -> AsyncIterator[str]:
    """The router with its own runner settings (deadlines, keep-alive); yields its URL."""
    async with running(build_runner(router)) as addr:
        yield f"http://{addr}"


class RawEngine:
    """An engine that speaks raw bytes: ``reply`` to each generation request (None: it reads the
    request and never answers), then, a moment later, ``tail`` (None: silence), then it hangs
    up; ``health`` likewise to /health (None: never answers, as a hung engine). Anything else
    (the router's scrape of /metrics) gets the reply too, but only POSTs count as hits."""

    def __init__(
        self, reply: bytes | None, tail: bytes | None = b"", health: bytes | None = None
    ) -> None:
        self.reply, self.tail, self.health = reply, tail, health
        self.hits = 0
        self._stop = asyncio.Event()
        self._connections: set[asyncio.Task[Any]] = set()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            if length := re.search(rb"(?i)\r\ncontent-length: *(\d+)", head):
                await reader.readexactly(int(length[1]))
            self.hits += head.startswith(b"POST ")
            if head.startswith(b"GET /health "):
                reply, tail = self.health, b""
            else:
                reply, tail = self.reply, self.tail
            for part in (reply, tail):
                if part is None:
                    await self._stop.wait()
                    return
                if part is tail:
                    await asyncio.sleep(0.05)
                writer.write(part)
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()
            self._connections.discard(task)

    @asynccontextmanager
    async def served(self) -> AsyncIterator[str]:
        server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        try:
            yield f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
        finally:
            self._stop.set()
            server.close()
            await asyncio.gather(*self._connections)
            await server.wait_closed()


@asynccontextmanager
async def fleet(
    *engines: Engine | RawEngine, **settings: Any
) -> AsyncIterator[tuple[Router, str, list[str]]]:
    async with contextlib.AsyncExitStack() as stack:
        addrs = [await stack.enter_async_context(e.served()) for e in engines]
        router = Router(RouterSettings(prefix_length=32, **settings))
        router.set_endpoints(addrs)
        yield router, await stack.enter_async_context(routed(router)), addrs


def session_for(router: Router, endpoint: str) -> dict[str, str]:
    """Headers that send a request to ``endpoint`` first."""
    sid = next(f"s{i}" for i in range(1000) if router.balancer.choose(f"session:s{i}") == endpoint)
    return {"x-session-id": sid}


def assert_openai_error(body: Any, code: str | None = None) -> None:
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and "Traceback" not in body["error"]["message"]
    if code is not None:
        assert body["error"]["code"] == code


async def post(url: str, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    """One chat request through the router: its status and JSON body."""
    async with (
        aiohttp.ClientSession() as s,
        s.post(f"{url}{CHAT}", json={"messages": []}, headers=headers) as r,
    ):
        return r.status, await r.json()


def counter(router: Router, name: str, **labels: str) -> float:
    return router.metrics.registry.get_sample_value(name, labels) or 0.0


# ------------------------------------------------------------------------------------------
# Retries: only what no engine worked on (the "fleet kill")
# ------------------------------------------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize(("mode", "status"), [("dead", 503), ("500", 500), ("drop", 502)])
async def test_a_request_an_engine_died_on_or_failed_is_not_replayed(
    mode: str, status: int
) -> None:
    """Replaying a request that killed one engine would kill the next: the first engine's
    answer (or a 502 for a connection broken after the request was sent) goes to the client."""
    first, second = Engine(mode), Engine()
    async with fleet(first, second) as (router, url, addrs):
        status_got, body = await post(url, session_for(router, addrs[0]))
    assert status_got == status
    assert_openai_error(body)
    assert (first.hits, second.hits) == (1, 0)
    assert counter(router, "kvfleet_router_retries_total") == 0


@pytest.mark.asyncio
async def test_refusals_with_retry_after_are_retried_once() -> None:
    for mode in ("draining", "full"):
        refusing, spare = Engine(mode), Engine()
        async with fleet(refusing, spare) as (router, url, addrs):
            assert (await post(url, session_for(router, addrs[0])))[0] == 200
        assert (refusing.hits, spare.hits) == (1, 1), mode
        assert counter(router, "kvfleet_router_retries_total") == 1


@pytest.mark.asyncio
async def test_when_every_engine_is_full_the_429_reaches_the_client() -> None:
    engines = [Engine("full") for _ in range(3)]
    async with fleet(*engines) as (router, url, _), aiohttp.ClientSession() as s:
        r = await s.post(f"{url}{CHAT}", json={"messages": []})
        assert r.status == 429 and r.headers["Retry-After"] == "3"
        assert_openai_error(await r.json(), "queue_full")
    # One retry, no more: a full fleet is not walked engine by engine.
    assert sorted(e.hits for e in engines) == [0, 1, 1]
    # Full engines are alive: nothing is ejected.
    assert not router.breakers.ejected()


@pytest.mark.asyncio
async def test_a_refused_connection_is_retried_once() -> None:
    live = Engine()
    async with fleet(live) as (router, url, addrs), aiohttp.ClientSession() as s:
        dead = "127.0.0.1:1"
        router.set_endpoints([*addrs, dead])
        async with s.post(f"{url}{CHAT}", json={}, headers=session_for(router, dead)) as r:
            assert r.status == 200
    assert live.hits == 1
    assert counter(router, "kvfleet_router_upstream_errors_total",
                   endpoint=dead, kind="connect") == 1  # fmt: skip


# ------------------------------------------------------------------------------------------
# Circuit breaker: the state machine (no I/O) and live
# ------------------------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_breaker_ejects_after_consecutive_failures_only() -> None:
    clock = Clock()
    b = Breakers(BreakerPolicy(failures=3, backoff_s=1, max_backoff_s=8, jitter=0), clock)
    assert not b.failure("a") and not b.failure("a")
    b.success("a")  # the run is broken: counting starts again
    assert not b.failure("a") and not b.failure("a")
    assert b.ejected() == frozenset()
    assert b.failure("a")
    assert b.ejected() == {"a"} and b.state("a") is State.OPEN
    # Ejected, further failures and successes of requests already running change nothing.
    assert not b.failure("a")
    b.success("a")
    assert b.state("a") is State.OPEN


def test_breaker_backoff_doubles_is_capped_and_probes_let_it_back() -> None:
    clock = Clock()
    b = Breakers(BreakerPolicy(failures=1, backoff_s=1, max_backoff_s=4, jitter=0), clock)
    b.failure("a")
    waits = []
    for _ in range(5):
        start = clock.now
        while not b.due_probes():
            assert "a" in b.ejected()
            clock.now += 0.25
        waits.append(clock.now - start)
        assert b.state("a") is State.PROBING and "a" in b.ejected()
        assert b.due_probes() == []  # one probe at a time
        assert b.probe_result("a", healthy=False)  # ejected again, for longer
    assert waits == [1, 2, 4, 4, 4]
    while not b.due_probes():
        clock.now += 0.25
    assert not b.probe_result("a", healthy=True)
    assert b.state("a") is State.CLOSED and b.ejected() == frozenset()
    # Back in, a new failure starts again from the first backoff only after a success.
    b.success("a")
    b.failure("a")
    start = clock.now
    while not b.due_probes():
        clock.now += 0.25
    assert clock.now - start == 1


def test_breaker_jitter_shortens_the_backoff_and_departed_endpoints_are_forgotten() -> None:
    clock = Clock()
    policy = BreakerPolicy(failures=1, backoff_s=10, max_backoff_s=10, jitter=0.5)
    b = Breakers(policy, clock, rng=lambda: 1.0)
    b.failure("a")
    clock.now += 5
    assert b.due_probes() == ["a"]  # 10 s shortened by the whole jitter fraction
    b.failure("b")
    b.retain(["a"])
    assert b.ejected() == {"a"} and b.state("b") is State.CLOSED
    assert not b.probe_result("b", healthy=False)  # a probe of a departed endpoint is moot
    with pytest.raises(ValueError):
        BreakerPolicy(failures=0)
    with pytest.raises(ValueError):
        BreakerPolicy(jitter=1.0)


async def probed(router: Router, endpoint: str) -> None:
    """Wait for the health probe a request started to finish."""
    deadline = time.monotonic() + 10
    while router.breakers.state(endpoint) is State.PROBING and time.monotonic() < deadline:
        await asyncio.sleep(0.01)


@pytest.mark.asyncio
async def test_a_failing_engine_is_ejected_then_probed_back() -> None:
    failing, spare = Engine("dead"), Engine()
    breaker = {"breaker_failures": 3, "breaker_backoff": 0.3, "breaker_max_backoff": 1.0,
               "breaker_jitter": 0.0}  # fmt: skip
    async with (
        fleet(failing, spare, **breaker) as (router, url, addrs),
        aiohttp.ClientSession() as s,
    ):
        headers = session_for(router, addrs[0])

        async def post() -> int:
            async with s.post(f"{url}{CHAT}", json={}, headers=headers) as r:
                await r.read()
                return r.status

        assert [await post() for _ in range(3)] == [503, 503, 503]
        assert router.breakers.ejected() == {addrs[0]}
        # Out of the ring: its requests go to the spare, the failing engine sees none.
        assert [await post() for _ in range(3)] == [200, 200, 200]
        assert (failing.hits, spare.hits) == (3, 3)
        metrics = await (await s.get(f"{url}/metrics")).text()
        assert f'kvfleet_router_engine_ejections_total{{endpoint="{addrs[0]}"}} 1.0' in metrics
        assert "kvfleet_router_ejected_endpoints 1.0" in metrics
        # After the backoff a request triggers a /health probe; unhealthy: ejected again.
        failing.healthy = False
        await asyncio.sleep(0.35)
        assert await post() == 200
        await probed(router, addrs[0])
        assert failing.health_checks == 1 and router.breakers.ejected() == {addrs[0]}
        # Recovered: the next probe (after a doubled backoff) lets it back in.
        failing.mode, failing.healthy = "ok", True
        await asyncio.sleep(0.65)
        await post()
        await probed(router, addrs[0])
        assert failing.health_checks == 2 and router.breakers.ejected() == frozenset()
        hits = failing.hits
        assert await post() == 200 and failing.hits == hits + 1
    assert counter(router, "kvfleet_router_engine_ejections_total", endpoint=addrs[0]) == 2


@pytest.mark.asyncio
async def test_with_every_engine_ejected_the_router_still_tries_them() -> None:
    """The breaker must not turn a fleet-wide hiccup into a total outage."""
    engine = Engine("dead")
    breaker = {"breaker_failures": 1, "breaker_backoff": 60.0, "breaker_max_backoff": 60.0}
    async with fleet(engine, **breaker) as (router, url, _):
        assert [(await post(url))[0] for _ in range(2)] == [503, 503]
        assert router.breakers.ejected() and engine.hits == 2


# ------------------------------------------------------------------------------------------
# Engines that answer garbage, break off mid-stream, or fall silent
# ------------------------------------------------------------------------------------------

NOT_HTTP: dict[str, bytes] = {
    "garbage": b"\x00\x01\x02 garbage\r\n\r\n",
    "an invalid status line": b"HTTP/1.1 2x0 OK\r\nContent-Length: 2\r\n\r\n{}",
    "HTTP/0.9 (a body, no head)": b'{"choices": []}',
    "Content-Length and Transfer-Encoding": (
        b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
    ),
    "a 200 KB header": (
        b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * 200_000 + b"\r\nContent-Length: 2\r\n\r\n{}"
    ),
    "5,000 headers": (
        b"HTTP/1.1 200 OK\r\n"
        + b"".join(b"X-H%d: v\r\n" % i for i in range(5000))
        + b"Content-Length: 2\r\n\r\n{}"
    ),
}
# Three failures in a row eject; no probe brings an engine back during a test.
# A router setting: engines ejected at the third failure in a row, for a minute.
EJECT_AT_3 = {"breaker_failures": 3, "breaker_backoff": 60.0, "breaker_max_backoff": 60.0}


async def ejected(router: Router, endpoint: str) -> None:
    """Wait for the endpoint's ejection: a timeout counts only once the health check that it
    started has failed."""
    deadline = time.monotonic() + 5
    while endpoint not in router.breakers.ejected():
        assert time.monotonic() < deadline, "not ejected"
        await asyncio.sleep(0.01)


@pytest.mark.asyncio
@pytest.mark.parametrize("case", list(NOT_HTTP))
async def test_an_engine_answering_garbage_gets_502s_and_is_ejected(case: str) -> None:
    raw, spare = RawEngine(NOT_HTTP[case]), Engine()
    async with (
        fleet(raw, spare, **EJECT_AT_3) as (router, url, addrs),
        aiohttp.ClientSession() as s,
    ):
        headers = session_for(router, addrs[0])
        for _ in range(3):
            async with s.post(f"{url}{CHAT}", json={"messages": []}, headers=headers) as r:
                assert r.status == 502 and r.content_type == "application/json"
                body = await r.json()
            assert_openai_error(body, "upstream_protocol_error")
            # What went wrong, not where: the engine's address and bytes are for the log.
            assert addrs[0] not in body["error"]["message"]
        assert router.breakers.ejected() == {addrs[0]}
        # Never replayed on the spare (the engine may have read it); once ejected, the spare.
        assert (raw.hits, spare.hits) == (3, 0)
        async with s.post(f"{url}{CHAT}", json={"messages": []}, headers=headers) as r:
            assert r.status == 200 and spare.hits == 1
    assert counter(router, "kvfleet_router_upstream_errors_total",
                   endpoint=addrs[0], kind="protocol") == 3  # fmt: skip
    assert counter(router, "kvfleet_router_retries_total") == 0


SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
)
FIRST_EVENT = b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


# What follows the first event of a stream, and the error event's code.
BROKEN_STREAMS: dict[str, tuple[bytes | None, str]] = {
    "the connection closes": (b"", "upstream_stream_broken"),
    "a bad chunk": (b"zz\r\ndata: x\n\n\r\n", "upstream_stream_broken"),
    "a chunk shorter than it said": (b"ff\r\ndata: {", "upstream_stream_broken"),
    # The half event is held back: the error event follows whole events only.
    "an event cut in half": (chunk(b'data: {"choices":'), "upstream_stream_broken"),
    "silence": (None, "upstream_timeout"),
}


@pytest.mark.asyncio
@pytest.mark.parametrize("case", list(BROKEN_STREAMS))
async def test_a_stream_that_breaks_ends_with_an_error_event_and_counts_as_a_failure(
    case: str,
) -> None:
    """A broken stream ends as the engine ends one that fails: its events so far, an error
    event, ``data: [DONE]``, and a clean end of the response; three in a row eject the engine
    (a broken stream once counted as a success, so none ever did)."""
    tail, code = BROKEN_STREAMS[case]
    raw, spare = RawEngine(SSE_HEAD + chunk(FIRST_EVENT), tail), Engine()
    settings = {**EJECT_AT_3, "upstream_idle_timeout": 0.3, "probe_timeout": 0.2}
    async with (
        fleet(raw, spare, **settings) as (router, url, addrs),
        aiohttp.ClientSession() as s,
    ):
        headers = session_for(router, addrs[0])
        for _ in range(3):
            start = time.monotonic()
            async with s.post(f"{url}{CHAT}", json={"messages": [], "stream": True},
                              headers=headers) as r:  # fmt: skip
                assert r.status == 200 and r.content_type == "text/event-stream"
                body = await r.read()  # the response ends cleanly: no ClientPayloadError
            assert time.monotonic() - start < 2
            assert body.startswith(FIRST_EVENT) and body.endswith(b"\n\n" + DONE)
            event = body.removeprefix(FIRST_EVENT).removesuffix(DONE)
            assert event.startswith(b"data: ") and event.count(b"\n\n") == 1
            assert_openai_error(json.loads(event[6:]), code)
        await ejected(router, addrs[0])
        assert (raw.hits, spare.hits) == (3, 0)
    assert counter(router, "kvfleet_router_upstream_errors_total",
                   endpoint=addrs[0], kind="stream") == 3  # fmt: skip


@pytest.mark.asyncio
async def test_a_body_that_is_not_an_event_stream_is_cut_not_ended() -> None:
    """A JSON body cannot carry an error: the client must see it broken, never short."""
    json_head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
    raw = RawEngine(json_head + b'{"choices": [', b"")
    async with fleet(raw, **EJECT_AT_3) as (router, url, addrs), aiohttp.ClientSession() as s:
        with pytest.raises(aiohttp.ClientPayloadError):
            async with s.post(f"{url}{CHAT}", json={"messages": []}) as r:
                assert r.status == 200
                await r.read()
        assert router.breakers.state(addrs[0]) is State.CLOSED  # one failure of three


@pytest.mark.asyncio
async def test_an_engine_that_never_answers_times_out_and_is_ejected() -> None:
    """Accepting connections and answering nothing, not even /health: each request fails in
    bounded time, a stream's within the idle timeout (its headers come at once from a live
    engine), and the engine is ejected."""
    raw, spare = RawEngine(None), Engine()
    settings = {**EJECT_AT_3, "upstream_first_byte_timeout": 0.8, "upstream_idle_timeout": 0.2,
                "probe_timeout": 0.2}  # fmt: skip
    async with (
        fleet(raw, spare, **settings) as (router, url, addrs),
        aiohttp.ClientSession() as s,
    ):
        headers = session_for(router, addrs[0])
        for stream, limit in ((False, 0.8), (True, 0.2), (False, 0.8)):
            start = time.monotonic()
            async with s.post(f"{url}{CHAT}", json={"messages": [], "stream": stream},
                              headers=headers) as r:  # fmt: skip
                assert r.status == 504 and r.content_type == "application/json"
                assert_openai_error(await r.json(), "upstream_timeout")
            assert limit <= time.monotonic() - start < limit + 0.5
        await ejected(router, addrs[0])
        assert (raw.hits, spare.hits) == (3, 0)
        async with s.post(f"{url}{CHAT}", json={"messages": []}, headers=headers) as r:
            assert r.status == 200 and spare.hits == 1
    assert counter(router, "kvfleet_router_upstream_errors_total",
                   endpoint=addrs[0], kind="timeout") == 3  # fmt: skip


@pytest.mark.asyncio
async def test_a_busy_engine_whose_health_answers_is_not_ejected_by_timeouts() -> None:
    """A timeout on an engine that is busy, not broken (its /health answers), fails the request
    but not the engine: a client that asks for long generations must not eject it."""
    busy = Engine("slow")
    settings = {**EJECT_AT_3, "upstream_first_byte_timeout": 0.2}
    async with fleet(busy, **settings) as (router, url, addrs):
        for i in range(3):
            status, body = await post(url)
            assert status == 504
            assert_openai_error(body, "upstream_timeout")
            deadline = time.monotonic() + 5
            while busy.health_checks <= i:
                assert time.monotonic() < deadline, "no health check"
                await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)  # the last check's verdict
        assert router.breakers.ejected() == frozenset()
        # Unhealthy, the same timeouts do eject it.
        busy.healthy = False
        for _ in range(3):
            assert (await post(url))[0] == 504
        await ejected(router, addrs[0])


# ------------------------------------------------------------------------------------------
# Bounded parsing: each refusal a 4xx in the OpenAI shape, before any engine sees it
# ------------------------------------------------------------------------------------------

HOSTILE_BODIES: dict[str, tuple[bytes, int, str]] = {
    "nested 5,000 deep": (b"[" * 5000 + b"]" * 5000, 400, "nesting_too_deep"),
    "nested 100,000 deep": (b'{"a":' * 100_000 + b"1" + b"}" * 100_000, 400, "nesting_too_deep"),
    "unbalanced nesting": (b"[" * 100_000, 400, "nesting_too_deep"),
    "5,000-digit integer": (
        b'{"prompt":"hi","seed":' + b"9" * 5000 + b"}",
        400,
        "number_too_long",
    ),
    "float overflow": (b'{"prompt":"hi","temperature":1e999}', 400, "number_out_of_range"),
    "NaN": (b'{"prompt":"hi","temperature":NaN}', 400, "invalid_json"),
    "lone surrogate in a prompt": (b'{"prompt":"a\\ud800b"}', 400, "invalid_unicode"),
    "lone surrogate in a chat message": (
        b'{"messages":[{"role":"user","content":"x\\udfffy"}]}',
        400,
        "invalid_unicode",
    ),
    "lone surrogate in a key": (b'{"\\udc00":1}', 400, "invalid_unicode"),
    "invalid UTF-8": (b'{"prompt":"\xff\xfe"}', 400, "invalid_unicode"),
    "not JSON": (b"prompt=hi", 400, "invalid_json"),
}


@pytest.mark.asyncio
@pytest.mark.parametrize("case", list(HOSTILE_BODIES))
async def test_hostile_bodies_are_refused_by_the_router(case: str) -> None:
    body, status, code = HOSTILE_BODIES[case]
    engine = Engine()
    async with fleet(engine) as (router, url, _), aiohttp.ClientSession() as s:
        for path in (CHAT, "/v1/completions", "/tokenize"):
            async with s.post(f"{url}{path}", data=body,
                              headers={"Content-Type": "application/json"}) as r:  # fmt: skip
                assert r.status == status, (path, await r.text())
                assert_openai_error(await r.json(), code)
        # The router stays up and serving.
        async with s.post(f"{url}{CHAT}", json={"messages": []}) as r:
            assert r.status == 200
    assert engine.hits == 1
    assert counter(router, "kvfleet_router_rejected_requests_total", code=code) == 3


def test_valid_unicode_and_deep_but_bounded_bodies_pass() -> None:
    limits = BodyLimits(max_depth=8)
    assert not nesting_exceeds(b"[" * 8 + b"]" * 8, limits.max_depth)
    assert nesting_exceeds(b"[" * 9 + b"]" * 9, limits.max_depth)
    # Brackets inside strings (escaped quotes included) are text, not structure.
    assert not nesting_exceeds(b'{"a":"[[[[[[[[[[\\"[[[[[[[["}', limits.max_depth)
    assert not nesting_exceeds(b'[{"a":[1,[2]]},[[[]]],{}]', 4)
    assert nesting_exceeds(b'[{"a":[1,[2]]},[[[]]],{}]', 3)


@pytest.mark.asyncio
async def test_a_surrogate_pair_and_a_long_valid_body_reach_the_engine() -> None:
    engine = Engine()
    async with fleet(engine) as (_, url, _addrs), aiohttp.ClientSession() as s:
        pair = b'{"prompt":"\\ud83d\\ude00 ok","seed":18446744073709551616}'
        big = json.dumps({"prompt": "[{" * 200_000, "max_tokens": 1}).encode()
        for body in (pair, big):
            async with s.post(f"{url}/v1/completions", data=body) as r:
                assert r.status == 200
    # Number ranges are the engine's to judge: the router only bounds the parsing cost.
    assert engine.hits == 2


@pytest.mark.asyncio
async def test_compressed_bodies_are_refused_not_decompressed() -> None:
    engine = Engine()
    async with fleet(engine) as (_, url, _addrs), aiohttp.ClientSession() as s:
        plain = b'{"prompt":"hi"}'
        for body, encoding in ((plain, "gzip"), (gzip.compress(plain), "gzip"), (plain, "br")):
            async with s.post(f"{url}/v1/completions", data=body,
                              headers={"Content-Encoding": encoding}) as r:  # fmt: skip
                assert r.status == 415
                assert_openai_error(await r.json(), "unsupported_content_encoding")
        async with s.post(f"{url}/v1/completions", data=plain,
                          headers={"Content-Encoding": "identity"}) as r:  # fmt: skip
            assert r.status == 200
    assert engine.hits == 1


@pytest.mark.asyncio
async def test_oversized_bodies_are_413() -> None:
    engine = Engine()
    async with fleet(engine, max_body_bytes=4096) as (_, url, _addrs), aiohttp.ClientSession() as s:
        big = json.dumps({"prompt": "x" * 5000}).encode()

        async def chunked() -> AsyncIterator[bytes]:
            yield big[:3000]
            yield big[3000:]

        for data in (big, chunked()):
            async with s.post(f"{url}/v1/completions", data=data) as r:
                assert r.status == 413
                assert_openai_error(await r.json(), "request_too_large")
    assert engine.hits == 0


async def raw_exchange(url: str, request: bytes, read_timeout: float = 5.0) -> bytes:
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(request)
    await writer.drain()
    try:
        return await asyncio.wait_for(reader.read(65536), read_timeout)
    finally:
        writer.close()


def status_and_json(raw: bytes) -> tuple[int, Any]:
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), json.loads(body)


@pytest.mark.asyncio
@pytest.mark.parametrize("header", [b"Authorization: Bearer \xff\xfe", b"X-Session-Id: \xc3("])
async def test_non_utf8_header_values_are_400(header: bytes) -> None:
    engine = Engine()
    async with fleet(engine) as (_, url, _addrs):
        body = b'{"prompt":"hi"}'
        raw = await raw_exchange(
            url,
            b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nConnection: close\r\n" + header
            + b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body,
        )  # fmt: skip
    status, payload = status_and_json(raw)
    assert status == 400
    assert_openai_error(payload, "invalid_header")
    assert engine.hits == 0


@pytest.mark.asyncio
async def test_unknown_routes_and_methods_are_json() -> None:
    async with fleet(Engine()) as (_, url, _addrs), aiohttp.ClientSession() as s:
        async with s.get(f"{url}/admin") as r:
            assert r.status == 404
            assert_openai_error(await r.json())
            assert (await r.json())["error"]["type"] == "not_found_error"
        async with s.post(f"{url}/health") as r:
            assert r.status == 405 and r.headers["Allow"] == "GET,HEAD"
            assert_openai_error(await r.json())


# ------------------------------------------------------------------------------------------
# Slow clients
# ------------------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_slow_request_head_is_cut_off() -> None:
    async with fleet(Engine(), keepalive_timeout=0.5) as (_, url, _addrs):
        host, port = url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        start = time.monotonic()
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: r\r\n")
        # One header byte every 100 ms: the head would never be complete.
        with contextlib.suppress(ConnectionError):
            for _ in range(50):
                writer.write(b"X")
                await writer.drain()
                if reader.at_eof():
                    break
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(reader.read(1), 0.1)
        assert reader.at_eof() or writer.is_closing()
        assert time.monotonic() - start < 2
        writer.close()


@pytest.mark.asyncio
async def test_a_slow_body_gets_408_and_the_connection_closes() -> None:
    engine = Engine()
    async with fleet(engine, body_timeout=0.3) as (_, url, _addrs):
        start = time.monotonic()
        raw = await raw_exchange(
            url,
            b'POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Length: 100\r\n\r\n{"prompt"',
        )
        elapsed = time.monotonic() - start
    status, payload = status_and_json(raw)
    assert status == 408 and 0.3 <= elapsed < 2
    assert b"Connection: close" in raw.split(b"\r\n\r\n")[0]
    assert_openai_error(payload, "body_timeout")
    assert engine.hits == 0


@pytest.mark.asyncio
async def test_idle_keep_alive_connections_are_closed() -> None:
    async with fleet(Engine(), keepalive_timeout=0.3) as (_, url, _addrs):
        host, port = url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"GET /health HTTP/1.1\r\nHost: r\r\n\r\n")
        assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
        start = time.monotonic()
        # The rest of the response, then nothing until the router hangs up.
        while await asyncio.wait_for(reader.read(65536), 3):
            pass
        assert 0.2 <= time.monotonic() - start < 2
        writer.close()


# ------------------------------------------------------------------------------------------
# Malformed HTTP from clients: JSON too, and a huge declared body refused at once
# ------------------------------------------------------------------------------------------

HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: r\r\n"
MALFORMED_REQUESTS: dict[str, tuple[bytes, str]] = {
    "Content-Length and Transfer-Encoding": (
        HEAD + b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        "malformed_request",
    ),
    "a bad chunk": (
        HEAD + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
        "malformed_request",
    ),
    "a Content-Length past 64 bits": (
        HEAD + b"Content-Length: 99999999999999999999999\r\n\r\n{}",
        "malformed_request",
    ),
    "not HTTP (a TLS hello)": (
        b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03\r\n\r\n",
        "malformed_request",
    ),
    "a 9,000-character path": (
        b"GET /v1/models/" + b"a" * 9000 + b" HTTP/1.1\r\nHost: r\r\n\r\n",
        "line_too_long",
    ),
    "a 20 KB header": (HEAD + b"X-Big: " + b"a" * 20_000 + b"\r\n\r\n", "line_too_long"),
    "5,000 headers": (
        HEAD + b"".join(b"X-H%d: v\r\n" % i for i in range(5000)) + b"\r\n",
        "malformed_request",
    ),
}


@pytest.mark.asyncio
@pytest.mark.parametrize("case", list(MALFORMED_REQUESTS))
async def test_malformed_requests_get_a_json_400(case: str) -> None:
    request, code = MALFORMED_REQUESTS[case]
    engine = Engine()
    async with fleet(engine) as (_, url, _addrs):
        raw = await raw_exchange(url, request)
    head = raw.partition(b"\r\n\r\n")[0].lower()
    status, payload = status_and_json(raw)
    assert status == 400 and b"content-type: application/json" in head
    assert_openai_error(payload, code)
    assert engine.hits == 0


@pytest.mark.asyncio
async def test_a_huge_declared_body_is_413_at_once() -> None:
    """Refused on its Content-Length, before a byte of it is read, and with ``Expect:
    100-continue`` without the 100 that would invite the client to send it."""
    engine = Engine()
    async with fleet(engine) as (_, url, _addrs):
        for expect in (b"", b"Expect: 100-continue\r\n"):
            start = time.monotonic()
            raw = await raw_exchange(
                url, HEAD + expect + b"Content-Length: 1000000000000000000\r\n\r\n", 2
            )
            assert time.monotonic() - start < 1
            assert b"100 Continue" not in raw
            status, payload = status_and_json(raw)
            assert status == 413
            assert_openai_error(payload, "request_too_large")
    assert engine.hits == 0


@pytest.mark.asyncio
async def test_expect_100_continue_for_a_body_within_the_limit() -> None:
    engine = Engine()
    body = b'{"prompt":"hi"}'
    async with fleet(engine) as (_, url, _addrs):
        host, port = url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(HEAD + b"Expect: 100-continue\r\nContent-Length: %d\r\n\r\n" % len(body))
        assert await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 2) == (
            b"HTTP/1.1 100 Continue\r\n\r\n"
        )
        writer.write(body)
        assert (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 2)).startswith(
            b"HTTP/1.1 200 "
        )
        writer.close()
        # An expectation the router does not know is ignored, not a plain-text 417.
        raw = await raw_exchange(
            url,
            HEAD + b"Connection: close\r\nExpect: something\r\nContent-Length: %d\r\n\r\n"
            % len(body) + body,
        )  # fmt: skip
        assert raw.startswith(b"HTTP/1.1 200 ")
    assert engine.hits == 2
