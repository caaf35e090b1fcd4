"""The reverse proxy in front of the engines (the `kvfleet-router` process; CLI in main.py).

A request's routing key (routing_key.py) picks an engine by consistent hashing with bounded
loads (hash_ring.py) over the ready endpoints (endpoints.py), so that a conversation keeps
landing where its prefix is cached; requests without a key go to the least-loaded engine.
Responses, streams included, are relayed chunk by chunk. A request goes to a second engine only
when the first certainly did no work on it and nothing was sent to the client yet: replaying a
request that killed one engine would kill the next. Bodies are read and bounded here
(request_body.py), engines that keep failing leave the ring (breaker.py), and requests are held
while no engine is ready. docs/routing.md is the reference: which failures are retried,
timeouts, the breaker, hostile clients.
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
    Coroutine,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
)
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, TypeVar

import aiohttp
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
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

from kvfleet.protocol.block_hash import lora_extra_key, prompt_block_hashes
from kvfleet.protocol.json_body import (
    OFF_LOOP_BYTES,
    RequestRefused,
    check_content_encoding,
    check_headers,
)
from kvfleet.router.adapter_placement import (
    REASONS as PLACEMENT_REASONS,
)
from kvfleet.router.adapter_placement import (
    AdapterUsage,
    EngineAdapters,
    Placement,
    place,
)
from kvfleet.router.breaker import Breakers
from kvfleet.router.engine_load import (
    EngineLoadPoller,
    EngineReport,
    estimated_load,
    has_free_slots,
)
from kvfleet.router.fetched_tokenizer import (
    FETCH_FAILURES,
    Fetched,
    FetchFailed,
    fetch_from,
    fetch_tokenizer,
)
from kvfleet.router.hash_ring import HashRing
from kvfleet.router.kv_index import KvIndex
from kvfleet.router.kv_subscriber import RESYNC_REASONS, KvSubscriber
from kvfleet.router.prefix_score import EngineState, Scored, ranked
from kvfleet.router.request_body import (
    check_content_length,
    parse_json_body,
    too_large,
)
from kvfleet.router.routing_key import (
    LEAST_LOADED,
    LEAST_LOADED_PATHS,
    REASONS,
    PromptTokenizer,
    RoutingKey,
    prompt_tokens,
    routing_key,
)
from kvfleet.router.settings import RouterSettings
from kvfleet.router.sse import EventFramer, error_events, is_event_stream
from kvfleet.telemetry.http import (
    SPAN,
    JsonErrorsRunner,
    echo_request_id,
    observe_requests,
    openai_error,
)
from kvfleet.telemetry.logs import REQUEST_ID, REQUEST_ID_HEADER
from kvfleet.telemetry.metric_names import (
    ROUTER_HELD_REQUESTS,
    ROUTER_KV_EVENTS_APPLIED,
    ROUTER_KV_INDEXED_BLOCKS,
    ROUTER_KV_RESYNCS,
    ROUTER_KV_STALE_ENGINES,
    ROUTER_PREFIX_SCORING,
)
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
# Set by the client library for the upstream request itself; and Expect, which the router
# answered (expect()): it sends the engine a body it already holds.
_NOT_FORWARDED_UP = frozenset({"host", "content-length", "expect"})
RETRY_AFTER_S = 5
VNODES = 160
T = TypeVar("T")


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


# What reading an engine's answer may raise: aiohttp's client errors (connection, status line,
# headers, framing: ClientResponseError wraps the parser's), the parser's own where it surfaces
# unwrapped, and timeouts (the router's, and aiohttp's connect timeout, a TimeoutError too).
UPSTREAM_ERRORS = (aiohttp.ClientError, HttpProcessingError, TimeoutError)


@dataclass(frozen=True)
class UpstreamFailure:
    """A request that got no usable answer from an engine: ``kind`` labels the metric,
    ``detail`` is for the log (it names the engine), the rest is the client's answer."""

    kind: str
    detail: str
    retryable: bool
    status: int
    code: str
    message: str
    headers: Mapping[str, str] | None = None

    @property
    def timed_out(self) -> bool:
        return self.kind == "timeout"

    def response(self) -> web.Response:
        return openai_error(self.status, self.message, "upstream_error", self.code,
                            headers=self.headers)  # fmt: skip


def upstream_failure(error: BaseException, sent: bool, timeout_s: float) -> UpstreamFailure:
    """What an exception from an engine, before its response began, means. Before the request
    was sent, any failure is a connection that could not be made, safe to retry elsewhere; after
    it, none is (the engine may have read the request and died of it)."""
    detail = f"{type(error).__name__}: {error}"
    if not sent:
        return UpstreamFailure("connect", detail, True, 502, "upstream_unreachable",
                               "the engine could not be reached")  # fmt: skip
    if isinstance(error, TimeoutError):
        return UpstreamFailure("timeout", detail, False, 504, "upstream_timeout",
                               f"the engine did not answer within {timeout_s:g} s")  # fmt: skip
    if isinstance(error, aiohttp.ClientConnectionError):
        return UpstreamFailure("no_response", detail, False, 502, "upstream_disconnected",
                               "the engine closed the connection without answering")  # fmt: skip
    return UpstreamFailure("protocol", detail, False, 502, "upstream_protocol_error",
                           "the engine's answer was not valid HTTP")  # fmt: skip


@dataclass(frozen=True)
class PreciseChoice:
    """Where precise prefix scoring sent a request, and why: ``cached`` (an engine that holds
    some of its prompt, by its events), ``uncached`` (no candidate holds any: the load decided)
    or ``approximate`` (an engine whose view is stale, scored as approximate routing sees it)."""

    endpoint: str
    decision: str


PRECISE_DECISIONS = ("cached", "uncached", "approximate", "fallback")


def decision_of(chosen: Scored, live: frozenset[str]) -> str:
    if chosen.endpoint not in live:
        return "approximate"
    return "cached" if chosen.cached_blocks > 0 else "uncached"


# How long the router counts an adapter as held by the engine it just sent the adapter's
# request to, to load: until the engine's next reports show it, the following requests go
# there too instead of loading it on yet another engine.
LOADING_S = 5.0


class Balancer:
    """The ready endpoints, the requests in flight on each, the engines' own reports of their
    load and adapters (engine_load.py), and the choice of an endpoint."""

    def __init__(
        self,
        load_factor: float = 1.25,
        vnodes: int = VNODES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ring = HashRing(vnodes=vnodes, load_factor=load_factor)
        self.in_flight: dict[str, int] = {}
        self.reports: dict[str, EngineReport] = {}
        self.clock = clock
        self.usage = AdapterUsage()
        # Per endpoint: the adapters sent there to load, and until when they count as held.
        self.loading: dict[str, dict[str, float]] = {}

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
        self.loading = {ep: a for ep, a in self.loading.items() if ep in self.ring.endpoints}
        self.usage.prune(self.clock(), frozenset(self.ring.endpoints))

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

    def ranking(
        self,
        key: str | None,
        hashes: Sequence[bytes],
        index: KvIndex,
        live: frozenset[str],
        exclude: frozenset[str] = frozenset(),
    ) -> list[Scored] | None:
        """The endpoints not excluded, by precise prefix score (prefix_score.py) of a prompt's
        block hashes, best first; None where the rule does not apply: a prompt without a full
        block, or no endpoint with a live view of its cache (``live``: approximate routing
        decides)."""
        if not hashes:
            return None
        order = self.ring.walk(key if key is not None else hashes[0].hex(), exclude)
        if not live.intersection(order):
            return None
        load = self.load()
        cap = self.ring.capacity(load, exclude)
        states: dict[str, EngineState] = {}
        for ep in order:
            report = self.reports.get(ep)
            if ep in live:
                cached = index.longest_prefix(ep, hashes).blocks
            else:  # as approximate routing sees it: all of it at the key's home, none elsewhere
                cached = float(len(hashes)) if ep == order[0] else 0.0
            states[ep] = EngineState(
                cached_blocks=cached,
                requests=load.get(ep, 0),
                batch=(report.max_num_seqs if report and report.max_num_seqs else cap),
                kv_usage=(report.kv_usage or 0.0) if report else 0.0,
                assumed=ep not in live,
            )
        return ranked(order, states, len(hashes))

    def choose_precise(
        self, ranking: Sequence[Scored], live: frozenset[str], exclude: frozenset[str]
    ) -> PreciseChoice:
        """The best-ranked endpoint within the load bound (or with a free batch slot); the
        bound guarantees one (hash_ring.HashRing.capacity)."""
        load = self.load()
        cap = self.ring.capacity(load, exclude)
        free = self.free()
        top = next(s for s in ranking if s.endpoint in free or load.get(s.endpoint, 0) + 1 <= cap)
        return PreciseChoice(top.endpoint, decision_of(top, live))

    def holdings(self) -> dict[str, EngineAdapters]:
        """Per endpoint, the adapters it holds as reported, with those sent there to load in
        the last LOADING_S seconds counted in its GPU slots."""
        now = self.clock()
        held = {ep: r.adapters for ep, r in self.reports.items() if r.adapters is not None}
        for ep, sent in self.loading.items():
            fresh = frozenset(a for a, until in sent.items() if until > now)
            if fresh:
                was = held.get(ep) or EngineAdapters()
                held[ep] = EngineAdapters(was.gpu | fresh, was.cpu - fresh, was.max_loras)
        return held

    def serves_adapter(self, name: str) -> bool:
        """Whether an engine reports holding an adapter of this name (or was just sent it):
        the requests that adapter placement routes. Any other model name (the base model's,
        an adapter no engine holds yet, an unknown one) is routed by its key alone, and an
        engine answers an unknown one with 404."""
        return any(h.holds(name) for h in self.holdings().values())

    def place(
        self,
        adapter: str,
        key: str | None,
        exclude: frozenset[str] = frozenset(),
        preferred: Sequence[str] | None = None,
    ) -> Placement | None:
        """The endpoint for a request naming an adapter (adapter_placement.py); the choice
        counts as a recent request there, and a load there is remembered for LOADING_S.
        ``preferred``: precise prefix scoring's ranking, which orders the holders."""
        now = self.clock()
        placement = place(
            adapter,
            key if key is not None else f"adapter:{adapter}",
            self.ring,
            self.load(),
            self.holdings(),
            lambda ep, name: self.usage.of(ep, name, now),
            exclude,
            self.free(),
            preferred,
        )
        if placement is not None:
            self.usage.add(placement.endpoint, adapter, now)
            if placement.reason.startswith("load_"):
                self.loading.setdefault(placement.endpoint, {})[adapter] = now + LOADING_S
        return placement

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


class _KvIndexCollector(Collector):
    def __init__(self, balancer: Balancer, index: KvIndex) -> None:
        self.balancer = balancer
        self.index = index

    def collect(self) -> Iterator[GaugeMetricFamily]:
        live = self.index.live(self.balancer.clock())
        yield GaugeMetricFamily(
            ROUTER_KV_STALE_ENGINES,
            "Ready engines without a live view of their KV cache (no snapshot yet, or no line "
            "from their KV events within --kv-events-stale-after): their requests are scored "
            "as approximate routing sees them.",
            value=len([ep for ep in self.balancer.endpoints if ep not in live]),
        )
        g = GaugeMetricFamily(
            ROUTER_KV_INDEXED_BLOCKS,
            "KV blocks indexed per engine endpoint, GPU and host memory together.",
            labels=["endpoint"],
        )
        for ep in sorted(self.index.engines()):
            g.add_metric([ep], self.index.size(ep))
        yield g


class RouterMetrics:
    def __init__(self, balancer: Balancer, breakers: Breakers, prefix_key_mode: str) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.prefix_scoring = Counter(
            ROUTER_PREFIX_SCORING,
            "Requests routed with --prefix-scoring precise, by decision: cached (to an engine "
            "that holds part of the prompt, by its KV events), uncached (no engine holds any; "
            "the load decided), approximate (to an engine whose view is stale), fallback (no "
            "live view or no full prompt block: the hash ring decided).",
            ["decision"],
            registry=r,
        )
        for decision in PRECISE_DECISIONS:
            self.prefix_scoring.labels(decision)
        self.kv_events_applied = Counter(
            ROUTER_KV_EVENTS_APPLIED, "KV events from the engines applied to the index.",
            registry=r,
        )  # fmt: skip
        self.kv_resyncs = Counter(
            ROUTER_KV_RESYNCS,
            "KV event streams opened again from a snapshot, by reason: connect (not reached or "
            "not 200), closed, silent (no line within --kv-events-stale-after), gap (a sequence "
            "number skipped), new_engine (a restarted engine), invalid (a line not of the wire "
            "format, or too long).",
            ["reason"],
            registry=r,
        )
        for reason in RESYNC_REASONS:
            self.kv_resyncs.labels(reason)
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
        self.adapter_placements = Counter(
            "kvfleet_router_adapter_placements",
            "Requests naming a LoRA adapter, by where they went: resident_gpu or resident_cpu "
            "(an engine holding it in a GPU slot or host memory, within the load bound), "
            "load_free_slot (an engine with a free GPU slot loads it) or load_evict (an engine "
            "loads it in place of its least used adapter); many load_evict means too few GPU "
            "slots (--max-loras) for the adapters in use.",
            ["reason"],
            registry=r,
        )
        for reason in PLACEMENT_REASONS:
            self.adapter_placements.labels(reason)
        self.engine_load_failures = Counter(
            "kvfleet_router_engine_load_failures",
            "Scrapes of an engine's /metrics whose load was not used, by reason; until the next "
            "good one the router counts only its own requests there.",
            ["endpoint", "reason"],
            registry=r,
        )
        self.held = Gauge(
            ROUTER_HELD_REQUESTS,
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
        self.tokenizer_fetch_failures = Counter(
            "kvfleet_router_tokenizer_fetch_failures",
            "Failed fetches of the engines' tokenizer (GET /tokenizer, when the router has no "
            "--tokenizer), by reason: connect, status (not 200), too_large, invalid (not a "
            "bundle), load (transformers could not load it). Until one succeeds, prefix scoring "
            "is approximate.",
            ["reason"],
            registry=r,
        )
        for reason in FETCH_FAILURES:
            self.tokenizer_fetch_failures.labels(reason)
        self._mode = Gauge("kvfleet_router_prefix_key_mode",
                           "1 for the prefix-key mode in use: tokens, or the characters "
                           "stand-in.", ["mode"], registry=r)  # fmt: skip
        self.set_prefix_key_mode(prefix_key_mode)
        r.register(_InFlightCollector(balancer, breakers))

    def set_prefix_key_mode(self, prefix_key_mode: str) -> None:
        for m in ("tokens", "characters"):
            self._mode.labels(m).set(1 if m == prefix_key_mode else 0)


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
        response = openai_error(e.status, e.message, "invalid_request_error", e.code, e.param)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        headers = {"Allow": e.headers["Allow"]} if "Allow" in e.headers else None
        response = openai_error(e.status, e.reason,
                                _ERROR_TYPES.get(e.status, "invalid_request_error"),
                                e.reason.lower().replace(" ", "_"), headers=headers)  # fmt: skip
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
        *,
        fetch_tokenizer: bool = False,
        engine_api_key: str | None = None,
    ) -> None:
        """``fetch_tokenizer``: without a tokenizer, fetch the engines' own for precise
        scoring (fetched_tokenizer.py); ``engine_api_key``: the key the router's own requests
        to the engines carry (KV events, the tokenizer), never a client's."""
        self.settings = settings
        self.tokenizer = tokenizer
        self.tracing = tracing
        self.engine_headers = (
            {"Authorization": f"Bearer {engine_api_key}"} if engine_api_key else {}
        )
        self.balancer = Balancer(settings.load_factor)
        self.breakers = Breakers(settings.breaker)
        self.metrics = RouterMetrics(
            self.balancer, self.breakers, "tokens" if tokenizer else "characters"
        )
        # Precise prefix scoring needs the prompt's tokens: without a tokenizer the router keys
        # on characters and follows no engine's events, until it has fetched the engines' one.
        self.index: KvIndex | None = None
        self.subscriber: KvSubscriber | None = None
        precise = settings.prefix_scoring == "precise"
        self.fetch_tokenizer = precise and tokenizer is None and fetch_tokenizer
        # The fetched tokenizer's ETag, and one check of a new engine's at a time.
        self._tokenizer_etag: str | None = None
        self._tokenizer_check = asyncio.Lock()
        if precise and (tokenizer is not None or self.fetch_tokenizer):
            self.index = KvIndex(settings.kv_events_stale_after, settings.kv_index_max_blocks)
            self.subscriber = KvSubscriber(
                self.index,
                self.metrics.kv_events_applied.inc,
                lambda reason: self.metrics.kv_resyncs.labels(reason).inc(),
                headers=self.engine_headers,
                on_new_engine=self._engine_started,
            )
            self.metrics.registry.register(_KvIndexCollector(self.balancer, self.index))
        if tokenizer is None:
            logger.info(
                "prefix keys from characters (about 4 a token), prefix scoring approximate: %s",
                "until the engines' tokenizer is fetched" if self.fetch_tokenizer
                else "no tokenizer",
            )  # fmt: skip
        self.session: aiohttp.ClientSession | None = None
        self._ready = asyncio.Event()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._health_checks: dict[str, asyncio.Task[bool]] = {}
        self.poller = (
            EngineLoadPoller(
                settings.engine_load_interval,
                lambda: self.balancer.endpoints,
                lambda ep: self.balancer.in_flight.get(ep, 0),
                self.balancer.report,
                lambda ep, reason: self.metrics.engine_load_failures.labels(ep, reason).inc(),
            )
            if settings.engine_load_interval > 0
            else None
        )

    def set_endpoints(self, endpoints: Iterable[str]) -> None:
        self.balancer.set_endpoints(endpoints)
        self.breakers.retain(self.balancer.endpoints)
        if self.subscriber is not None:
            self.subscriber.set_endpoints(self.balancer.endpoints)
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
        if self.subscriber is not None and self.tokenizer is not None:
            self.subscriber.start()
        if self.fetch_tokenizer:
            self._background(self._fetch_tokenizer())
        yield
        if self.subscriber is not None:
            await self.subscriber.close()
        for task in list(self._tasks):
            task.cancel()
        if poll is not None:
            poll.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await poll
        await self.session.close()

    async def _fetch_tokenizer(self) -> None:
        fetched = await fetch_tokenizer(
            lambda: self.balancer.endpoints,
            self._ready,
            self.engine_headers,
            self.settings.tokenized_chars,
            lambda reason: self.metrics.tokenizer_fetch_failures.labels(reason).inc(),
        )
        self._use_tokenizer(fetched)
        self.metrics.set_prefix_key_mode("tokens")
        if self.subscriber is not None:
            self.subscriber.start()

    def _use_tokenizer(self, fetched: Fetched) -> None:
        self.tokenizer = fetched.tokenizer
        self._tokenizer_etag = fetched.etag

    def _engine_started(self, endpoint: str) -> None:
        if self.fetch_tokenizer and self._tokenizer_etag is not None:
            self._background(self._check_tokenizer(endpoint))

    async def _check_tokenizer(self, endpoint: str) -> None:
        """Whether a new engine's tokenizer is the one fetched: one that is not replaces it."""
        async with self._tokenizer_check, aiohttp.ClientSession() as session:
            try:
                fetched = await fetch_from(session, endpoint, self.engine_headers,
                                           self.settings.tokenized_chars,
                                           self._tokenizer_etag)  # fmt: skip
            except FetchFailed as e:
                self.metrics.tokenizer_fetch_failures.labels(e.reason).inc()
                logger.warning("tokenizer of the new engine at %s: %s", endpoint, e)
                return
            if fetched is not None:
                logger.warning("the engines' tokenizer changed: now the one of %s", endpoint)
                self._use_tokenizer(fetched)

    async def _read_body(self, request: web.Request) -> bytes:
        limits = self.settings.body
        check_content_encoding(request.headers.get("Content-Encoding"))
        check_content_length(request.content_length, limits)
        try:
            async with asyncio.timeout(self.settings.body_timeout):
                return await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise too_large(limits.max_bytes) from None  # a chunked body past the limit
        except TimeoutError:
            raise RequestRefused(
                408,
                f"the request body did not arrive within {self.settings.body_timeout:g} s",
                "body_timeout",
            ) from None

    async def expect(self, request: web.Request) -> None:
        """``Expect: 100-continue`` gets its 100 only for a body the router will read: one
        declared over the limit is refused (413) by the handler at once, before the client sends
        it. Other expectations are ignored, as RFC 9110 allows, rather than answered with
        aiohttp's plain-text 417."""
        declared = request.content_length
        if (
            request.version == aiohttp.HttpVersion11
            and request.headers.get("Expect", "").lower() == "100-continue"
            and (declared is None or declared <= self.settings.body.max_bytes)
        ):
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            # As aiohttp's own handler does: the response proper has not begun.
            request.writer.output_size = 0

    async def _parse(self, body: bytes) -> Any:
        if len(body) <= OFF_LOOP_BYTES:
            return parse_json_body(body, self.settings.body)
        return await asyncio.to_thread(parse_json_body, body, self.settings.body)

    async def _key(
        self, request: web.Request, parsed: Any, adapter: str | None
    ) -> tuple[RoutingKey, list[bytes]]:
        """The request's routing key, and its prompt's block hashes (adapter: its extra key)
        where precise prefix scoring is on; tokenized once for both."""
        if request.path in LEAST_LOADED_PATHS:
            return LEAST_LOADED, []
        policy = self.settings.policy
        tokenizer = self.tokenizer
        if tokenizer is None:
            return routing_key(request.headers, parsed, policy), []
        # Tokenizing a long conversation takes milliseconds: keep it off the event loop.
        return await asyncio.to_thread(self._tokenized, request.headers, parsed, adapter, tokenizer)

    def _tokenized(
        self,
        headers: Mapping[str, str],
        parsed: Any,
        adapter: str | None,
        tokenizer: PromptTokenizer,
    ) -> tuple[RoutingKey, list[bytes]]:
        tokens: list[int] | None = None
        if self.index is not None and isinstance(parsed, dict):
            # One the template or tokenizer rejects is one the engine rejects, with its error.
            with contextlib.suppress(Exception):
                tokens = prompt_tokens(parsed, tokenizer)
        rk = routing_key(headers, parsed, self.settings.policy, tokenizer, tokens)
        if not tokens:
            return rk, []
        extra = lora_extra_key(adapter) if adapter is not None else None
        try:
            scored = tokens[: self.settings.prefix_scoring_tokens]
            return rk, prompt_block_hashes(scored, extra)
        except (TypeError, ValueError, OverflowError):  # a client's token ids that are no ids
            return rk, []

    def _excluded(self, tried: frozenset[str]) -> frozenset[str]:
        """Endpoints this request must not go to: those it failed on, and the ejected ones,
        unless every endpoint is ejected (then an ejected engine is better than none)."""
        ejected = self.breakers.ejected()
        if set(self.balancer.endpoints) <= ejected:
            return tried
        return tried | ejected

    def _failed(self, endpoint: str, timed_out: bool = False) -> None:
        """Count a failure against the engine's breaker. A timeout counts only when the
        engine's /health fails too: an engine that is slow because it is busy (a long queue,
        a long generation) is not broken, and a client that asks for a long generation must not
        be able to eject it. The check runs in the background, one per engine at a time, each
        timeout that waits on it counting on its own."""
        if not timed_out:
            if self.breakers.failure(endpoint):
                self._ejected(endpoint)
            return
        check = self._health_checks.get(endpoint)
        if check is None:
            check = self._background(self._healthy(endpoint))
            self._health_checks[endpoint] = check
            check.add_done_callback(lambda _: self._health_checks.pop(endpoint, None))

        def counted(task: asyncio.Task[bool]) -> None:
            if not task.cancelled() and not task.result():
                self._failed(endpoint)

        check.add_done_callback(counted)

    def _ejected(self, endpoint: str) -> None:
        self.metrics.ejections.labels(endpoint).inc()
        logger.warning("engine %s ejected by its circuit breaker", endpoint)

    def _background(self, work: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        """A task of the router's own, cancelled when it stops."""
        task = asyncio.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _start_probes(self) -> None:
        for endpoint in self.breakers.due_probes():
            self._background(self._probe(endpoint))

    async def _healthy(self, endpoint: str) -> bool:
        """Whether the engine's /health answers 200 within the probe timeout."""
        assert self.session is not None
        try:
            async with self.session.get(
                f"http://{endpoint}/health",
                timeout=aiohttp.ClientTimeout(total=self.settings.probe_timeout),
                trace_request_ctx={},
            ) as r:
                return r.status == 200
        except UPSTREAM_ERRORS:
            return False

    async def _probe(self, endpoint: str) -> None:
        healthy = await self._healthy(endpoint)
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
        parsed = await self._parse(body)
        model = parsed.get("model") if isinstance(parsed, dict) else None
        adapter = model if isinstance(model, str) and self.balancer.serves_adapter(model) else None
        rk, hashes = await self._key(request, parsed, adapter)
        self.metrics.requests.labels(rk.reason).inc()
        self._start_probes()
        # A stream's headers come at once: its wait for them is bounded as its silences are.
        first_byte_s = self.settings.upstream_first_byte_timeout
        if isinstance(parsed, dict) and parsed.get("stream") is True:
            first_byte_s = min(first_byte_s, self.settings.upstream_idle_timeout)
        held = 0.0
        tried: frozenset[str] = frozenset()
        failure: UpstreamFailure | None = None
        for attempt in range(2):
            excluded = self._excluded(tried)
            ranking: list[Scored] | None = None
            live: frozenset[str] = frozenset()
            if self.index is not None and request.path not in LEAST_LOADED_PATHS:
                live = self.index.live(self.balancer.clock())
                ranking = self.balancer.ranking(rk.key, hashes, self.index, live, excluded)
                if ranking is None and attempt == 0:
                    self.metrics.prefix_scoring.labels("fallback").inc()
            if adapter is not None:
                preferred = [s.endpoint for s in ranking] if ranking else None
                placement = self.balancer.place(adapter, rk.key, excluded, preferred)
                endpoint = placement.endpoint if placement is not None else None
                if placement is not None:
                    self.metrics.adapter_placements.labels(placement.reason).inc()
            elif ranking:
                choice = self.balancer.choose_precise(ranking, live, excluded)
                endpoint = choice.endpoint
                self.metrics.prefix_scoring.labels(choice.decision).inc()
                logger.debug("precise prefix scoring: %s to %s", choice.decision, endpoint)
            else:
                endpoint = self.balancer.choose(rk.key, excluded)
                if (
                    attempt == 0
                    and rk.key is not None
                    and endpoint not in (None, self.balancer.ring.home(rk.key))
                ):
                    self.metrics.spilled.inc()
            if endpoint is None and not tried:
                endpoint, held = await self._hold(rk.key, received + self.settings.hold_timeout)
                if endpoint is None:
                    self.metrics.hold_timeouts.inc()
                    return openai_error(503, "no engine became ready in time",
                                        "service_unavailable",
                                        headers={"Retry-After": str(RETRY_AFTER_S)})  # fmt: skip
            if endpoint is None:
                break
            tried |= {endpoint}
            if attempt:
                self.metrics.retries.inc()
            if (span := request.get(SPAN)) is not None:
                span.add_event("upstream", {"server.address": endpoint, "attempt": attempt})
            alternatives = len(set(self.balancer.endpoints) - self._excluded(tried))
            result = await self._forward(
                request,
                body,
                endpoint,
                may_retry(attempt, alternatives),
                received + held,
                first_byte_s,
            )
            if not isinstance(result, UpstreamFailure):
                return result
            failure = result
            logger.warning("%s %s on %s: %s", request.method, request.path, endpoint, result.detail)
            if not result.retryable:
                break
        assert failure is not None
        return failure.response()

    async def _forward(
        self,
        request: web.Request,
        body: bytes,
        endpoint: str,
        retry_allowed: bool,
        started: float,
        first_byte_s: float,
    ) -> web.StreamResponse | UpstreamFailure:
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
                async with asyncio.timeout(first_byte_s):
                    upstream = await self.session.request(
                        request.method,
                        f"http://{endpoint}{request.rel_url}",
                        headers=headers,
                        data=body or None,
                        allow_redirects=False,
                        trace_request_ctx=marks,
                    )
            except UPSTREAM_ERRORS as e:
                failure = upstream_failure(e, "sent" in marks, first_byte_s)
                self.metrics.upstream_errors.labels(endpoint, failure.kind).inc()
                self._failed(endpoint, failure.timed_out)
                return failure
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
    ) -> web.StreamResponse | UpstreamFailure:
        if refused(upstream.status, upstream.headers) and retry_allowed:
            self.metrics.upstream_errors.labels(endpoint, "refused").inc()
            return UpstreamFailure("refused", f"HTTP {upstream.status} with Retry-After", True,
                                   503, "upstream_refused", "the engines refused the request",
                                   {"Retry-After": str(RETRY_AFTER_S)})  # fmt: skip
        failed = engine_failed(upstream.status, upstream.headers)
        if failed:
            self._failed(endpoint)
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
        sse = is_event_stream(upstream.headers.get("Content-Type", ""))
        events = EventFramer() if sse else None
        while True:
            # Only reading the engine is guarded: a write that fails is the client gone, which
            # says nothing about the engine (the handler is cancelled, or the error ends it).
            try:
                async with asyncio.timeout(self.settings.upstream_idle_timeout):
                    chunk = await upstream.content.readany()
            except UPSTREAM_ERRORS as e:
                silent = isinstance(e, TimeoutError) and _connected(upstream)
                if not failed:
                    self._failed(endpoint, silent)
                await self._broken(request, response, endpoint, e, silent, events)
                return response
            if not chunk:
                break
            if events is not None:
                chunk = events.feed(chunk)
            if chunk:
                await response.write(chunk)
        if events is not None and (rest := events.flush()):
            await response.write(rest)
        await response.write_eof()
        # An answer counts for the engine once it is whole: a stream that breaks is a failure.
        if not failed:
            self.breakers.success(endpoint)
        return response

    async def _broken(
        self,
        request: web.Request,
        response: web.StreamResponse,
        endpoint: str,
        error: BaseException,
        silent: bool,
        events: EventFramer | None,
    ) -> None:
        """End a response whose engine failed after it began (``silent``: it sent nothing for
        the idle timeout): an event stream as the engine ends a failed one; anything else cut
        short, without its final chunk."""
        self.metrics.upstream_errors.labels(endpoint, "stream").inc()
        logger.warning("stream from %s broke after the response began: %s: %s",
                       endpoint, type(error).__name__, error)  # fmt: skip
        if events is None or not events.at_boundary:
            # The client must see a broken response, not a short one.
            if request.transport is not None:
                request.transport.close()
            return
        if silent:
            code = "upstream_timeout"
            message = f"the engine sent nothing for {self.settings.upstream_idle_timeout:g} s"
        else:
            code, message = "upstream_stream_broken", "the engine's stream broke off"
        error_body = {"message": message, "type": "upstream_error", "param": None, "code": code}
        await response.write(error_events({"error": error_body}))
        await response.write_eof()

    async def health(self, _request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "endpoints": len(self.balancer.endpoints)})

    async def metrics_handler(self, _request: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(self.metrics.registry),
            headers={"Content-Type": CONTENT_TYPE_LATEST},
        )


def _connected(upstream: aiohttp.ClientResponse) -> bool:
    """Whether the engine's connection is still open. aiohttp's C parser drops a body it finds
    malformed mid-way (a bad chunk) without telling its reader, and closes the connection: the
    reader then waits out the idle timeout, and a closed connection says the engine was not
    merely silent but broke the stream."""
    return upstream.connection is not None and not upstream.connection.closed


async def _mark_sent(_session: aiohttp.ClientSession, ctx: SimpleNamespace, _params: Any) -> None:
    ctx.trace_request_ctx["sent"] = time.monotonic()


ROUTER = web.AppKey("router", Router)

# The engines' adapter endpoints change what an engine serves for every tenant and read paths of
# its file system: the operator calls them on each engine directly (spec.adapters), and a client
# never reaches them through the router, whatever its key.
ENGINE_ADMIN_PATHS = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")


async def not_routed(request: web.Request) -> web.Response:
    return openai_error(
        404,
        f"{request.path} is not served through the router: an InferenceService's adapters are "
        "its spec.adapters, which the operator loads into its engines",
        "invalid_request_error",
        "not_found",
    )


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
    for path in ENGINE_ADMIN_PATHS:
        app.router.add_route("*", path, not_routed)
    for path in ("/v1/{tail:.*}", "/tokenize", "/detokenize"):
        app.router.add_route("*", path, router.proxy, expect_handler=router.expect)
    return app


def build_runner(router: Router) -> web.AppRunner:
    """The app with the router's connection settings: handler_cancellation, so that a client
    hanging up cancels its handler, which drops the upstream connection, which aborts the
    generation on the engine; the keep-alive timeout, which also bounds how long a request
    head may take; no decompression (compressed bodies are refused before reading); a short
    lingering_time, the time the unread rest of a refused body (408, 413) is drained before the
    close: aiohttp's 10 s would let a slow client hold the connection on. A request aiohttp
    cannot parse is answered in the OpenAI error shape too (JsonErrorsRunner)."""
    return JsonErrorsRunner(
        build_app(router),
        handler_cancellation=True,
        access_log=None,
        keepalive_timeout=router.settings.keepalive_timeout,
        auto_decompress=False,
        lingering_time=1.0,
    )
