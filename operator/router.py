"""``kvfleet-router``: the reverse proxy in front of the engines.

A request's routing key (routing_key.py) picks an engine by consistent hashing with bounded
loads (hash_ring.py) over the ready endpoints (endpoints.py), so that a conversation keeps
landing where its prefix is cached; requests without a key go to the least-loaded engine.
Responses, streams included, are relayed chunk by chunk as they arrive.

Failures: a connection error, or a 5xx status, before anything was sent to the client is retried
once on another engine (nothing was generated for the client yet, so nothing is duplicated).
Once bytes went out the failure is passed on (the connection is cut, so the client sees a broken
stream) and never retried. While no engine is ready, requests are held up to ``--hold-timeout``
seconds; ``kvfleet_router_held_requests`` is what the autoscaler reads to scale from zero. Past
the timeout the answer is 503 with Retry-After.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import AsyncIterator, Iterable, Iterator, Sequence
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

from kvfleet.operator.endpoints import (
    EndpointSliceWatcher,
    KubeAPI,
    in_cluster_namespace,
    parse_static,
)
from kvfleet.operator.hash_ring import HashRing
from kvfleet.operator.routing_key import (
    REASONS,
    KeyPolicy,
    PromptTokenizer,
    RoutingKey,
    routing_key,
)

logger = logging.getLogger("kvfleet.router")

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
    """Whether a failure before the first byte to the client is retried: once, elsewhere."""
    return attempt == 0 and alternatives > 0


def retryable_status(status: int) -> bool:
    return status >= 500


class Balancer:
    """The ready endpoints, the requests in flight on each, and the choice of an endpoint."""

    def __init__(self, load_factor: float = 1.25, vnodes: int = VNODES) -> None:
        self.load_factor = load_factor
        self.vnodes = vnodes
        self.ring = HashRing(vnodes=vnodes, load_factor=load_factor)
        self.in_flight: dict[str, int] = {}

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

    def choose(self, key: str | None, exclude: frozenset[str] = frozenset()) -> str | None:
        ring = self.ring
        if exclude & set(ring.endpoints):
            # Retries only: a ring without the failed endpoints walks on exactly as the full
            # ring would past them (same vnode positions), under the same load bound.
            ring = HashRing(vnodes=self.vnodes, load_factor=self.load_factor)
            ring.set_endpoints(set(self.ring.endpoints) - exclude)
        if key is None:
            return ring.least_loaded(self.in_flight)
        return ring.choose(key, self.in_flight)

    def acquire(self, endpoint: str) -> None:
        self.in_flight[endpoint] = self.in_flight.get(endpoint, 0) + 1

    def release(self, endpoint: str) -> None:
        self.in_flight[endpoint] -= 1
        if not self.in_flight[endpoint] and endpoint not in self.ring.endpoints:
            del self.in_flight[endpoint]


class _InFlightCollector(Collector):
    def __init__(self, balancer: Balancer) -> None:
        self.balancer = balancer

    def collect(self) -> Iterator[GaugeMetricFamily]:
        g = GaugeMetricFamily(
            "kvfleet_router_in_flight",
            "Requests in flight per engine endpoint.",
            labels=["endpoint"],
        )
        for ep, n in sorted(self.balancer.in_flight.items()):
            g.add_metric([ep], n)
        yield g
        yield GaugeMetricFamily(
            "kvfleet_router_ready_endpoints",
            "Engine endpoints the router sends to.",
            value=len(self.balancer.endpoints),
        )


class RouterMetrics:
    def __init__(self, balancer: Balancer, prefix_key_mode: str) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("kvfleet_router_requests", "Requests by routing reason.",
                                ["reason"], registry=r)  # fmt: skip
        for reason in REASONS:
            self.requests.labels(reason)
        self.upstream_errors = Counter(
            "kvfleet_router_upstream_errors",
            "Upstream failures: connect (no response), status (5xx before the first byte, "
            "retried), stream (broken after bytes went to the client).",
            ["endpoint", "kind"],
            registry=r,
        )
        self.retries = Counter("kvfleet_router_retries", "Requests retried on another engine.",
                               registry=r)  # fmt: skip
        self.spilled = Counter(
            "kvfleet_router_spilled",
            "Keyed requests sent past their home engine (the one holding their prefix) because "
            "it was over the load bound; many means a load factor too tight for the traffic.",
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
        r.register(_InFlightCollector(balancer))


@dataclass(frozen=True)
class RouterSettings:
    policy: KeyPolicy = field(default_factory=KeyPolicy)
    load_factor: float = 1.25
    hold_timeout_s: float = 120.0


@dataclass
class _Failure:
    kind: str
    detail: str
    status: int = 502


def _error(
    status: int, message: str, err_type: str, headers: dict[str, str] | None = None
) -> web.Response:
    """An error in the engine's (OpenAI's) shape, so clients handle it the same way."""
    return web.json_response(
        {"error": {"message": message, "type": err_type, "param": None, "code": None}},
        status=status,
        headers=headers,
    )


class Router:
    def __init__(self, settings: RouterSettings, tokenizer: PromptTokenizer | None = None) -> None:
        self.settings = settings
        self.tokenizer = tokenizer
        self.balancer = Balancer(settings.load_factor)
        self.metrics = RouterMetrics(self.balancer, "tokens" if tokenizer else "characters")
        self.session: aiohttp.ClientSession | None = None
        self._ready = asyncio.Event()

    def set_endpoints(self, endpoints: Iterable[str]) -> None:
        self.balancer.set_endpoints(endpoints)
        if self.balancer.endpoints:
            self._ready.set()
        else:
            self._ready.clear()

    async def _start_session(self, _app: web.Application) -> AsyncIterator[None]:
        trace = aiohttp.TraceConfig()
        trace.on_request_headers_sent.append(_mark_sent)
        # No total or read timeout: a stream lasts as long as generation does; the client's
        # own timeout and disconnect bound it. auto_decompress off: bytes pass through as sent.
        self.session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, connect=10),
            auto_decompress=False,
            trace_configs=[trace],
            connector=aiohttp.TCPConnector(limit=0),
        )
        yield
        await self.session.close()

    async def _key(self, request: web.Request, body: bytes) -> RoutingKey:
        policy = self.settings.policy
        if self.tokenizer is None:
            return routing_key(request.headers, body, policy)
        # Tokenizing a long conversation takes milliseconds: keep it off the event loop.
        return await asyncio.to_thread(routing_key, request.headers, body, policy, self.tokenizer)

    async def _hold(self, key: str | None, deadline: float) -> tuple[str | None, float]:
        """Wait for an endpoint up to the deadline; the endpoint (or None) and the time held."""
        start = time.monotonic()
        self.metrics.held.inc()
        try:
            while (endpoint := self.balancer.choose(key)) is None:
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
        body = await request.read()
        rk = await self._key(request, body)
        self.metrics.requests.labels(rk.reason).inc()
        held = 0.0
        tried: frozenset[str] = frozenset()
        failure: _Failure | None = None
        for attempt in range(2):
            endpoint = self.balancer.choose(rk.key, tried)
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
            alternatives = len(set(self.balancer.endpoints) - tried)
            result = await self._forward(
                request, body, endpoint, may_retry(attempt, alternatives), received + held
            )
            if not isinstance(result, _Failure):
                return result
            failure = result
            logger.warning("%s %s on %s: %s", request.method, request.path, endpoint, result.detail)
        assert failure is not None
        return _error(failure.status, f"upstream engine failed: {failure.detail}", "upstream_error")

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
                self.metrics.upstream_errors.labels(endpoint, "connect").inc()
                return _Failure("connect", f"{type(e).__name__}: {e}")
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
        if retryable_status(upstream.status) and retry_allowed:
            self.metrics.upstream_errors.labels(endpoint, "status").inc()
            return _Failure("status", f"HTTP {upstream.status}", upstream.status)
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
    # Request bodies are read whole (for the key and for a retry); chat histories can be long.
    app = web.Application(client_max_size=64 << 20)
    app[ROUTER] = router
    app.cleanup_ctx.append(router._start_session)
    app.router.add_get("/health", router.health)
    app.router.add_get("/metrics", router.metrics_handler)
    for path in ("/v1/{tail:.*}", "/tokenize", "/detokenize"):
        app.router.add_route("*", path, router.proxy)
    return app


class EngineTokenizer:
    """Prompt tokens computed by the engine's own code (chat template included), from a local
    HF tokenizer directory."""

    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer

        from kvfleet.engine.server.chat import render_chat
        from kvfleet.engine.server.protocol import ChatMessage

        self._tok = AutoTokenizer.from_pretrained(path)
        self._render = render_chat
        self._message = ChatMessage

    def chat(
        self,
        messages: list[Any],
        add_generation_prompt: bool,
        template_kwargs: dict[str, Any] | None,
    ) -> list[int]:
        parsed = [self._message.model_validate(m) for m in messages]
        return self._render(self._tok, parsed, add_generation_prompt, template_kwargs)

    def text(self, prompt: str) -> list[int]:
        return self._tok(prompt).input_ids


def load_tokenizer(path: str | None) -> PromptTokenizer | None:
    if path is None:
        logger.info("prefix keys from characters (no --tokenizer): about 4 characters a token")
        return None
    try:
        tokenizer = EngineTokenizer(path)
    except (ImportError, OSError, ValueError) as e:
        logger.warning("tokenizer %s cannot be loaded (%s): prefix keys from characters", path, e)
        return None
    logger.info("prefix keys from tokens: tokenizer %s, engine chat template", path)
    return tokenizer


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvfleet-router", description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8080)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--engine-service", help="watch this Service's EndpointSlices")
    src.add_argument("--endpoints", type=parse_static, help="static host:port,host:port list")
    p.add_argument("--namespace", help="of the engine Service (default: the pod's namespace)")
    p.add_argument("--engine-port", type=int, default=8000)
    p.add_argument("--session-header", default="x-session-id")
    p.add_argument("--use-user-field", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--prefix-affinity", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--prefix-length", type=int, default=256, help="prompt tokens in the key")
    p.add_argument("--load-factor", type=float, default=1.25)
    p.add_argument("--hold-timeout", type=float, default=120.0,
                   help="seconds a request waits for a ready engine")  # fmt: skip
    p.add_argument("--tokenizer", help="local HF tokenizer directory for token prefix keys")
    p.add_argument("--log-level", default="INFO")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = build_parser()
    ns = p.parse_args(argv)
    if ns.prefix_length < 1 or ns.load_factor < 1 or ns.hold_timeout < 0:
        p.error("need --prefix-length >= 1, --load-factor >= 1, --hold-timeout >= 0")
    return ns


def settings_from(ns: argparse.Namespace) -> RouterSettings:
    return RouterSettings(
        policy=KeyPolicy(
            session_header=ns.session_header,
            use_user_field=ns.use_user_field,
            prefix_affinity=ns.prefix_affinity,
            prefix_length=ns.prefix_length,
        ),
        load_factor=ns.load_factor,
        hold_timeout_s=ns.hold_timeout,
    )


async def serve(ns: argparse.Namespace) -> int:
    router = Router(settings_from(ns), load_tokenizer(ns.tokenizer))
    watch: asyncio.Task[None] | None = None
    if ns.endpoints is not None:
        router.set_endpoints(ns.endpoints)
    else:
        namespace = ns.namespace or in_cluster_namespace()
        if not namespace:
            raise SystemExit("--namespace is required outside a cluster")
        try:
            api = KubeAPI.in_cluster()
        except RuntimeError as e:
            raise SystemExit(f"--engine-service needs the Kubernetes API: {e}") from None
        watcher = EndpointSliceWatcher(
            api, namespace, ns.engine_service, ns.engine_port, router.set_endpoints
        )
        watch = asyncio.create_task(watcher.run())
    # handler_cancellation: a client hanging up cancels its handler, which drops the upstream
    # connection, which aborts the generation on the engine.
    runner = web.AppRunner(build_app(router), handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, ns.host, ns.port).start()
    logger.info("routing on %s:%d", ns.host, ns.port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    if watch is not None:
        watch.cancel()
    # Requests in flight finish (up to aiohttp's shutdown timeout) before the sessions close.
    await runner.cleanup()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    ns = parse_args(argv)
    logging.basicConfig(level=ns.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")  # fmt: skip
    return asyncio.run(serve(ns))


if __name__ == "__main__":
    raise SystemExit(main())
