"""The reverse proxy in front of the engines (the `kvfleet-router` process; CLI in main.py).

A request's routing key (routing_key.py) picks an engine by consistent hashing with bounded
loads (hash_ring.py) over the ready endpoints (endpoints.py), so that a conversation keeps
landing where its prefix is cached; requests without a key go to the least-loaded engine.
An engine's load is the whole fleet's, from its own /metrics (engine_load.py), where it reports
one; an engine with free batch slots and nothing queued is never over the bound.
Responses, streams included, are relayed chunk by chunk as they arrive.

Retries: a request goes to a second engine only when the first certainly did no work on it,
and only before anything was sent to the client: the connection could not be made (refused,
connect timeout: the request was never sent), or the engine refused it with a 429 or 503 that
carries Retry-After (draining, queue full, refusing at admission). Nothing else is retried: not
a 4xx or 500 (the request is at fault, and another engine would say the same), not a 503
without Retry-After (the engine died with the request in it), not a connection that broke
after the request was sent (the engine may have died processing it). Replaying a request that
killed one engine would kill the next: one hostile request must not take the fleet down.
When the retry is refused too (every engine full), its 429 or 503 reaches the client with its
Retry-After. Once bytes went out a failure cuts the client connection (the client sees a
broken stream).

Circuit breaker (breaker.py): an engine that fails ``--breaker-failures`` times in a row
(connection errors, 502/503/504 without Retry-After, broken streams) leaves the ring for a
backoff, then a ``/health`` probe lets it back. While every engine is ejected, all are used.

Hostile clients: the router reads and parses the body itself, bounded (request_body.py, with the
parser the engine uses, kvfleet.protocol.json_body): size, nesting depth, number lengths,
Unicode, Content-Encoding, header bytes; each refusal is a 4xx in the OpenAI error shape, as is
an unknown route. Request heads must arrive within the keep-alive timeout of the connection
opening (or of the previous response), bodies within ``--body-timeout``; idle connections close
after ``--keepalive-timeout``.

While no engine is ready, requests are held up to ``--hold-timeout`` seconds;
``kvfleet_router_held_requests`` is what the autoscaler reads to scale from zero. Past the
timeout the answer is 503 with Retry-After.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Iterable,
    Iterator,
    Mapping,
)
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import aiohttp
from aiohttp import web
from multidict import CIMultiDict
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from kvfleet.protocol.json_body import (
    OFF_LOOP_BYTES,
    RequestRefused,
    check_content_encoding,
    check_headers,
)
from kvfleet.router.breaker import BreakerPolicy, Breakers
from kvfleet.router.engine_load import (
    EngineLoadPoller,
    EngineReport,
    estimated_load,
    has_free_slots,
)
from kvfleet.router.hash_ring import HashRing
from kvfleet.router.request_body import (
    BodyLimits,
    check_content_length,
    parse_json_body,
    too_large,
)
from kvfleet.router.routing_key import (
    REASONS,
    KeyPolicy,
    PromptTokenizer,
    RoutingKey,
    routing_key,
)
from kvfleet.telemetry.http import SPAN, echo_request_id, observe_requests
from kvfleet.telemetry.logs import REQUEST_ID, REQUEST_ID_HEADER
from kvfleet.telemetry.tracing import Tracing

logger = logging.getLogger("kvfleet.router")
# One line per proxied request (method, path, status, seconds).
access_logger = logging.getLogger("kvfleet.router.access")

# RFC 9110 7.6.1: meaningful for one connection only, never forwarded.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)
# Set by the client library for the upstream request itself.
_NOT_FORWARDED_UP = frozenset({"host", "content-length"})
RETRY_AFTER_S = 5
VNODES = 160


def forwarded_headers(
    headers: Iterable[tuple[str, str]], also_drop: frozenset[str] = frozenset()
) -> CIMultiDict[str]:
    """Headers minus hop-by-hop ones, including any the Connection header names."""
    pairs = list(headers)
    named = {
        token.strip().lower()
        for name, value in pairs
        if name.lower() == "connection"
        for token in value.split(",")
    }
    drop = HOP_BY_HOP | named | also_drop
    return CIMultiDict((k, v) for k, v in pairs if k.lower() not in drop)


def may_retry(attempt: int, alternatives: int) -> bool:
    """Whether a failure that is safe to retry is retried: once, elsewhere."""
    return attempt == 0 and alternatives > 0


def refused(status: int, headers: Mapping[str, str]) -> bool:
    """An engine's refusal before doing any work (draining, queue full, not admitting): these,
    and only these responses, are safe to send to another engine."""
    return status in (429, 503) and "Retry-After" in headers


def engine_failed(status: int, headers: Mapping[str, str]) -> bool:
    """A response that counts against the engine's breaker: a gateway-class 5xx without
    Retry-After (503 engine_dead: the engine died with the request in it). A 500 is the engine
    failing one request alone while it goes on; counting those would let whoever can provoke
    one eject healthy engines."""
    return status in (502, 503, 504) and "Retry-After" not in headers


class Balancer:
    """The ready endpoints, the requests in flight on each, the engines' own reports of their
    load (engine_load.py), and the choice of an endpoint."""

    def __init__(self, load_factor: float = 1.25, vnodes: int = VNODES) -> None:
        self.ring = HashRing(vnodes=vnodes, load_factor=load_factor)
        self.in_flight: dict[str, int] = {}
        self.reports: dict[str, EngineReport] = {}

    @property
    def endpoints(self) -> tuple[str, ...]:
        return self.ring.endpoints

    def set_endpoints(self, endpoints: Iterable[str]) -> None:
        self.ring.set_endpoints(endpoints)
        # Requests still running on a departed endpoint keep their count until they end.
        self.in_flight = {
            ep: n for ep, n in self.in_flight.items() if n or ep in self.ring.endpoints
        }
        for ep in self.ring.endpoints:
            self.in_flight.setdefault(ep, 0)
        self.reports = {ep: r for ep, r in self.reports.items() if ep in self.ring.endpoints}

    def report(self, endpoint: str, report: EngineReport | None) -> None:
        """An engine's scraped load; None (a failed scrape) falls back to the own count."""
        if report is None:
            self.reports.pop(endpoint, None)
        elif endpoint in self.ring.endpoints:  # not one that left while it was scraped
            self.reports[endpoint] = report

    def load(self) -> dict[str, int]:
        """Per endpoint, the requests the bound counts: the whole fleet's where its engine
        reports them, this router's own elsewhere."""
        return {ep: estimated_load(n, self.reports.get(ep)) for ep, n in self.in_flight.items()}

    def free(self) -> frozenset[str]:
        """The endpoints that would start one more request at once (never over the bound)."""
        return frozenset(
            ep for ep, r in self.reports.items() if has_free_slots(self.in_flight.get(ep, 0), r)
        )

    def choose(self, key: str | None, exclude: frozenset[str] = frozenset()) -> str | None:
        """``exclude``: endpoints this request failed on and those the breaker ejected."""
        if key is None:
            return self.ring.least_loaded(self.load(), exclude)
        return self.ring.choose(key, self.load(), exclude, self.free())

    def acquire(self, endpoint: str) -> None:
        self.in_flight[endpoint] = self.in_flight.get(endpoint, 0) + 1

    def release(self, endpoint: str) -> None:
        self.in_flight[endpoint] -= 1
        if not self.in_flight[endpoint] and endpoint not in self.ring.endpoints:
            del self.in_flight[endpoint]


class _InFlightCollector(Collector):
    def __init__(self, balancer: Balancer, breakers: Breakers) -> None:
        self.balancer = balancer
        self.breakers = breakers

    def collect(self) -> Iterator[GaugeMetricFamily]:
        g = GaugeMetricFamily(
            "kvfleet_router_in_flight",
            "Requests in flight per engine endpoint.",
            labels=["endpoint"],
        )
        for ep, n in sorted(self.balancer.in_flight.items()):
            g.add_metric([ep], n)
        yield g
        g = GaugeMetricFamily(
            "kvfleet_router_engine_load",
            "Requests per engine endpoint that the load bound counts: the engine's scraped "
            "running + waiting, plus this router's requests started since, less those finished "
            "since; this router's own in-flight count where the engine's report is missing.",
            labels=["endpoint"],
        )
        for ep, n in sorted(self.balancer.load().items()):
            g.add_metric([ep], n)
        yield g
        yield GaugeMetricFamily(
            "kvfleet_router_ready_endpoints",
            "Engine endpoints the router sends to.",
            value=len(self.balancer.endpoints),
        )
        yield GaugeMetricFamily(
            "kvfleet_router_ejected_endpoints",
            "Engine endpoints out of the ring by their circuit breaker (backoff or probe).",
            value=len(self.breakers.ejected()),
        )


class RouterMetrics:
    def __init__(self, balancer: Balancer, breakers: Breakers, prefix_key_mode: str) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("kvfleet_router_requests", "Requests by routing reason.",
                                ["reason"], registry=r)  # fmt: skip
        for reason in REASONS:
            self.requests.labels(reason)
        self.upstream_errors = Counter(
            "kvfleet_router_upstream_errors",
            "Upstream failures: connect (request never sent; retried), refused (429/503 with "
            "Retry-After; retried), no_response (connection broke after the request was sent; "
            "not retried), status (5xx passed on), stream (broken after bytes went out).",
            ["endpoint", "kind"],
            registry=r,
        )
        self.retries = Counter("kvfleet_router_retries", "Requests retried on another engine.",
                               registry=r)  # fmt: skip
        self.ejections = Counter(
            "kvfleet_router_engine_ejections",
            "Times an engine was taken out of the ring by its circuit breaker.",
            ["endpoint"],
            registry=r,
        )
        self.rejected = Counter(
            "kvfleet_router_rejected_requests",
            "Requests the router refused itself, by error code (bounded parsing, slow body).",
            ["code"],
            registry=r,
        )
        self.spilled = Counter(
            "kvfleet_router_spilled",
            "Keyed requests sent past their home engine (the one holding their prefix) because "
            "it was over the load bound; many means a load factor too tight for the traffic.",
            registry=r,
        )
        self.engine_load_failures = Counter(
            "kvfleet_router_engine_load_failures",
            "Scrapes of an engine's /metrics whose load was not used, by reason; until the next "
            "good one the router counts only its own requests there.",
            ["endpoint", "reason"],
            registry=r,
        )
        self.held = Gauge(
            "kvfleet_router_held_requests",
            "Requests waiting for a ready engine (scale-from-zero signal).",
            registry=r,
        )
        self.hold_timeouts = Counter("kvfleet_router_hold_timeouts",
                                     "Held requests answered 503 at the hold timeout.",
                                     registry=r)  # fmt: skip
        self.added_latency = Histogram(
            "kvfleet_router_added_latency_seconds",
            "Router time per request: receipt to upstream request sent, less time held, plus "
            "upstream response headers to client response headers.",
            buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1),
            registry=r,
        )
        mode = Gauge("kvfleet_router_prefix_key_mode",
                     "1 for the prefix-key mode in use: tokens, or the characters stand-in.",
                     ["mode"], registry=r)  # fmt: skip
        for m in ("tokens", "characters"):
            mode.labels(m).set(1 if m == prefix_key_mode else 0)
        r.register(_InFlightCollector(balancer, breakers))


@dataclass(frozen=True)
class RouterSettings:
    policy: KeyPolicy = field(default_factory=KeyPolicy)
    load_factor: float = 1.25
    hold_timeout_s: float = 120.0
    body: BodyLimits = field(default_factory=BodyLimits)
    breaker: BreakerPolicy = field(default_factory=BreakerPolicy)
    probe_timeout_s: float = 5.0
    # Idle keep-alive connections close after this; it is also the time a client has to send
    # a complete request head after connecting or after its previous response.
    keepalive_timeout_s: float = 15.0
    body_timeout_s: float = 30.0
    # Seconds between scrapes of the engines' own load (engine_load.py); 0: own counts only.
    engine_load_interval_s: float = 1.0


@dataclass
class _Failure:
    kind: str
    detail: str
    retryable: bool


def _error(
    status: int,
    message: str,
    err_type: str,
    headers: Mapping[str, str] | None = None,
    code: str | None = None,
    param: str | None = None,
) -> web.Response:
    """An error in the engine's (OpenAI's) shape, so clients handle it the same way."""
    return web.json_response(
        {"error": {"message": message, "type": err_type, "param": param, "code": code}},
        status=status,
        headers=headers,
    )


_ERROR_TYPES = {404: "not_found_error", 405: "invalid_request_error", 408: "timeout_error",
                413: "invalid_request_error"}  # fmt: skip


@web.middleware
async def json_errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Every error the router answers itself is OpenAI-style JSON, unknown routes included."""
    try:
        check_headers(request.raw_headers)
        return await handler(request)
    except RequestRefused as e:
        request.app[ROUTER].metrics.rejected.labels(e.code).inc()
        response = _error(e.status, e.message, "invalid_request_error", code=e.code,
                          param=e.param)  # fmt: skip
    except web.HTTPException as e:
        if e.status < 400:
            raise
        headers = {"Allow": e.headers["Allow"]} if "Allow" in e.headers else None
        response = _error(e.status, e.reason, _ERROR_TYPES.get(e.status, "invalid_request_error"),
                          headers, code=e.reason.lower().replace(" ", "_"))  # fmt: skip
    if response.status in (408, 413):
        # The rest of the body is still on the way: the connection cannot carry another request.
        response.force_close()
    return response


class Router:
    def __init__(
        self,
        settings: RouterSettings,
        tokenizer: PromptTokenizer | None = None,
        tracing: Tracing | None = None,
    ) -> None:
        self.settings = settings
        self.tokenizer = tokenizer
        self.tracing = tracing
        self.balancer = Balancer(settings.load_factor)
        self.breakers = Breakers(settings.breaker)
        self.metrics = RouterMetrics(
            self.balancer, self.breakers, "tokens" if tokenizer else "characters"
        )
        self.session: aiohttp.ClientSession | None = None
        self._ready = asyncio.Event()
        self._probes: set[asyncio.Task[None]] = set()
        self.poller = (
            EngineLoadPoller(
                settings.engine_load_interval_s,
                lambda: self.balancer.endpoints,
                lambda ep: self.balancer.in_flight.get(ep, 0),
                self.balancer.report,
                lambda ep, reason: self.metrics.engine_load_failures.labels(ep, reason).inc(),
            )
            if settings.engine_load_interval_s > 0
            else None
        )

    def set_endpoints(self, endpoints: Iterable[str]) -> None:
        self.balancer.set_endpoints(endpoints)
        self.breakers.retain(self.balancer.endpoints)
        if self.balancer.endpoints:
            self._ready.set()
        else:
            self._ready.clear()

    async def _start_session(self, _app: web.Application) -> AsyncIterator[None]:
        trace = aiohttp.TraceConfig()
        trace.on_request_headers_sent.append(_mark_sent)
        # No total or read timeout: a stream lasts as long as generation does; the client's
        # own timeout and disconnect bound it. auto_decompress off: bytes pass through as sent.
        # Pooled connections are dropped after 2 s idle, before any engine's keep-alive timeout
        # can close them under a request: a request on a connection the engine closed counts
        # as sent, and is not retried.
        self.session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, connect=10),
            auto_decompress=False,
            trace_configs=[trace],
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=2.0),
        )
        poll = asyncio.create_task(self.poller.run()) if self.poller is not None else None
        yield
        for task in self._probes:
            task.cancel()
        if poll is not None:
            poll.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await poll
        await self.session.close()

    async def _read_body(self, request: web.Request) -> bytes:
        limits = self.settings.body
        check_content_encoding(request.headers.get("Content-Encoding"))
        check_content_length(request.content_length, limits)
        try:
            async with asyncio.timeout(self.settings.body_timeout_s):
                return await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise too_large(limits.max_bytes) from None  # a chunked body past the limit
        except TimeoutError:
            raise RequestRefused(
                408,
                f"the request body did not arrive within {self.settings.body_timeout_s:g} s",
                "body_timeout",
            ) from None

    async def _parse(self, body: bytes) -> Any:
        if len(body) <= OFF_LOOP_BYTES:
            return parse_json_body(body, self.settings.body)
        return await asyncio.to_thread(parse_json_body, body, self.settings.body)

    async def _key(self, request: web.Request, parsed: Any) -> RoutingKey:
        policy = self.settings.policy
        if self.tokenizer is None:
            return routing_key(request.headers, parsed, policy)
        # Tokenizing a long conversation takes milliseconds: keep it off the event loop.
        return await asyncio.to_thread(routing_key, request.headers, parsed, policy, self.tokenizer)

    def _excluded(self, tried: frozenset[str]) -> frozenset[str]:
        """Endpoints this request must not go to: those it failed on, and the ejected ones,
        unless every endpoint is ejected (then an ejected engine is better than none)."""
        ejected = self.breakers.ejected()
        if set(self.balancer.endpoints) <= ejected:
            return tried
        return tried | ejected

    def _failed(self, endpoint: str) -> None:
        if self.breakers.failure(endpoint):
            self._ejected(endpoint)

    def _ejected(self, endpoint: str) -> None:
        self.metrics.ejections.labels(endpoint).inc()
        logger.warning("engine %s ejected by its circuit breaker", endpoint)

    def _start_probes(self) -> None:
        for endpoint in self.breakers.due_probes():
            task = asyncio.create_task(self._probe(endpoint))
            self._probes.add(task)
            task.add_done_callback(self._probes.discard)

    async def _probe(self, endpoint: str) -> None:
        assert self.session is not None
        try:
            async with self.session.get(
                f"http://{endpoint}/health",
                timeout=aiohttp.ClientTimeout(total=self.settings.probe_timeout_s),
                trace_request_ctx={},
            ) as r:
                healthy = r.status == 200
        except (aiohttp.ClientError, TimeoutError):
            healthy = False
        if self.breakers.probe_result(endpoint, healthy):
            self._ejected(endpoint)
        elif healthy:
            logger.info("engine %s back in the ring after a healthy probe", endpoint)

    async def _hold(self, key: str | None, deadline: float) -> tuple[str | None, float]:
        """Wait for an endpoint up to the deadline; the endpoint (or None) and the time held."""
        start = time.monotonic()
        self.metrics.held.inc()
        try:
            while (endpoint := self.balancer.choose(key, self._excluded(frozenset()))) is None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._ready.wait(), remaining)
        finally:
            self.metrics.held.dec()
        return endpoint, time.monotonic() - start

    async def proxy(self, request: web.Request) -> web.StreamResponse:
        received = time.monotonic()
        body = await self._read_body(request)
        rk = await self._key(request, await self._parse(body))
        self.metrics.requests.labels(rk.reason).inc()
        self._start_probes()
        held = 0.0
        tried: frozenset[str] = frozenset()
        failure: _Failure | None = None
        for attempt in range(2):
            excluded = self._excluded(tried)
            endpoint = self.balancer.choose(rk.key, excluded)
            if (
                attempt == 0
                and rk.key is not None
                and endpoint not in (None, self.balancer.ring.home(rk.key))
            ):
                self.metrics.spilled.inc()
            if endpoint is None and not tried:
                endpoint, held = await self._hold(rk.key, received + self.settings.hold_timeout_s)
                if endpoint is None:
                    self.metrics.hold_timeouts.inc()
                    return _error(503, "no engine became ready in time", "service_unavailable",
                                  {"Retry-After": str(RETRY_AFTER_S)})  # fmt: skip
            if endpoint is None:
                break
            tried |= {endpoint}
            if attempt:
                self.metrics.retries.inc()
            if (span := request.get(SPAN)) is not None:
                span.add_event("upstream", {"server.address": endpoint, "attempt": attempt})
            alternatives = len(set(self.balancer.endpoints) - self._excluded(tried))
            result = await self._forward(
                request, body, endpoint, may_retry(attempt, alternatives), received + held
            )
            if not isinstance(result, _Failure):
                return result
            failure = result
            logger.warning("%s %s on %s: %s", request.method, request.path, endpoint, result.detail)
            if not result.retryable:
                break
        assert failure is not None
        return _error(502, f"upstream engine failed: {failure.detail}", "upstream_error")

    async def _forward(
        self,
        request: web.Request,
        body: bytes,
        endpoint: str,
        retry_allowed: bool,
        started: float,
    ) -> web.StreamResponse | _Failure:
        assert self.session is not None
        headers = forwarded_headers(request.headers.items(), _NOT_FORWARDED_UP)
        # The engine logs under the same request id, and continues the router's trace.
        if (request_id := REQUEST_ID.get()) is not None:
            headers[REQUEST_ID_HEADER] = request_id
        if self.tracing is not None:
            self.tracing.inject(headers)
        marks: dict[str, float] = {}
        self.balancer.acquire(endpoint)
        try:
            try:
                upstream = await self.session.request(
                    request.method,
                    f"http://{endpoint}{request.rel_url}",
                    headers=headers,
                    data=body or None,
                    allow_redirects=False,
                    trace_request_ctx=marks,
                )
            except (aiohttp.ClientConnectionError, TimeoutError) as e:
                self._failed(endpoint)
                detail = f"{type(e).__name__}: {e}"
                if "sent" in marks:
                    # The engine may have read the request and died of it: never replayed.
                    self.metrics.upstream_errors.labels(endpoint, "no_response").inc()
                    return _Failure("no_response", detail, retryable=False)
                self.metrics.upstream_errors.labels(endpoint, "connect").inc()
                return _Failure("connect", detail, retryable=True)
            try:
                return await self._relay(request, upstream, endpoint, retry_allowed, started, marks)
            finally:
                # Closing (not releasing) an unfinished response drops the connection, which is
                # how the engine learns that the client went away and aborts the generation.
                if not upstream.content.is_eof():
                    upstream.close()
                upstream.release()
        finally:
            self.balancer.release(endpoint)

    async def _relay(
        self,
        request: web.Request,
        upstream: aiohttp.ClientResponse,
        endpoint: str,
        retry_allowed: bool,
        started: float,
        marks: dict[str, float],
    ) -> web.StreamResponse | _Failure:
        if refused(upstream.status, upstream.headers):
            if retry_allowed:
                self.metrics.upstream_errors.labels(endpoint, "refused").inc()
                return _Failure("refused", f"HTTP {upstream.status} with Retry-After", True)
        elif engine_failed(upstream.status, upstream.headers):
            self._failed(endpoint)
        else:
            self.breakers.success(endpoint)
        if upstream.status >= 500:
            self.metrics.upstream_errors.labels(endpoint, "status").inc()
        headers_in = time.monotonic()
        response = web.StreamResponse(
            status=upstream.status,
            reason=upstream.reason,
            headers=forwarded_headers(upstream.headers.items()),
        )
        await response.prepare(request)
        sent = marks.get("sent", headers_in)
        self.metrics.added_latency.observe((sent - started) + (time.monotonic() - headers_in))
        try:
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
        except aiohttp.ClientError as e:
            self.metrics.upstream_errors.labels(endpoint, "stream").inc()
            self._failed(endpoint)
            logger.warning("stream from %s broke after the response began: %s", endpoint, e)
            # No terminating chunk: the client must see a broken response, not a short one.
            if request.transport is not None:
                request.transport.close()
            return response
        await response.write_eof()
        return response

    async def health(self, _request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "endpoints": len(self.balancer.endpoints)})

    async def metrics_handler(self, _request: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(self.metrics.registry),
            headers={"Content-Type": CONTENT_TYPE_LATEST},
        )


async def _mark_sent(_session: aiohttp.ClientSession, ctx: SimpleNamespace, _params: Any) -> None:
    ctx.trace_request_ctx["sent"] = time.monotonic()


ROUTER = web.AppKey("router", Router)


def build_app(router: Router) -> web.Application:
    # Request bodies are read whole (for the key and for a retry), up to the body limit.
    quiet = ("/health", "/metrics")
    app = web.Application(
        client_max_size=router.settings.body.max_bytes,
        middlewares=[observe_requests(router.tracing, access_logger, quiet), json_errors],
    )
    app.on_response_prepare.append(echo_request_id)
    app[ROUTER] = router
    app.cleanup_ctx.append(router._start_session)
    app.router.add_get("/health", router.health)
    app.router.add_get("/metrics", router.metrics_handler)
    for path in ("/v1/{tail:.*}", "/tokenize", "/detokenize"):
        app.router.add_route("*", path, router.proxy)
    return app


def build_runner(router: Router) -> web.AppRunner:
    """The app with the router's connection settings: handler_cancellation, so that a client
    hanging up cancels its handler, which drops the upstream connection, which aborts the
    generation on the engine; the keep-alive timeout, which also bounds how long a request
    head may take; no decompression (compressed bodies are refused before reading); a short
    lingering_time, the time the unread rest of a refused body (408, 413) is drained before the
    close: aiohttp's 10 s would let a slow client hold the connection on."""
    return web.AppRunner(
        build_app(router),
        handler_cancellation=True,
        access_log=None,
        keepalive_timeout=router.settings.keepalive_timeout_s,
        auto_decompress=False,
        lingering_time=1.0,
    )
