"""The aiohttp application: routes, auth, error shaping, health, metrics, graceful shutdown."""

from __future__ import annotations

import asyncio
import hmac
import logging
import signal
import socket
import time
from collections.abc import Awaitable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvfleet.engine.async_engine import AsyncEngine
from kvfleet.engine.config import EngineArgs
from kvfleet.engine.engine_core import EngineCore
from kvfleet.engine.metrics import EngineMetrics
from kvfleet.engine.server.adapters import (
    ADAPTERS,
    AdapterRegistry,
    load_lora_adapter,
    unload_lora_adapter,
)
from kvfleet.engine.server.chat import create_chat_completion, render_chat_served
from kvfleet.engine.server.completions import create_completion
from kvfleet.engine.server.embeddings import create_embedding
from kvfleet.engine.server.errors import APIError, error_response
from kvfleet.engine.server.kv_events import stream_kv_events
from kvfleet.engine.server.openai_requests import DetokenizeRequest, TokenizeRequest
from kvfleet.engine.server.openai_responses import (
    Detokenized,
    ModelCard,
    ModelList,
    Tokens,
    now,
)
from kvfleet.engine.server.responses import create_response, stored_response
from kvfleet.engine.server.serving import SERVING, ServingContext
from kvfleet.engine.server.settings import ServerSettings, resolve_api_key
from kvfleet.engine.server.tokenizer_bundle import (
    TOKENIZER_BUNDLE,
    TokenizerBundleCache,
    serve_tokenizer,
)
from kvfleet.engine.server.tools import TOOL_SETTINGS, ToolSettings, plan_prompt
from kvfleet.engine.server.validation import (
    BODY_BYTES,
    BODY_LIMIT,
    BODY_TIMEOUT,
    parse_body,
    refused,
)
from kvfleet.protocol.json_body import OFF_LOOP_BYTES, RequestRefused, check_content_encoding
from kvfleet.protocol.kv_events import PATH as KV_EVENTS_PATH
from kvfleet.protocol.tokenizer_bundle import PATH as TOKENIZER_PATH
from kvfleet.protocol.tool_prompt import parser_for_template
from kvfleet.telemetry.http import JsonErrorsRunner, echo_request_id, observe_requests
from kvfleet.telemetry.tracing import Tracing

logger = logging.getLogger(__name__)
# One line per API request (method, path, status, seconds), as uvicorn's access log.
access_logger = logging.getLogger("kvfleet.engine.access")

METRICS = web.AppKey("metrics", EngineMetrics)
STARTED = web.AppKey("started", int)

# Served even while draining or unauthenticated: probes and scrapers must keep working.
_OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})
# After the shutdown deadline has aborted what was left, how long its handlers get to send their
# error events before their connections are closed.
_ABORT_GRACE = 1.0
# serve()'s exit status when the engine loop was stuck in a step at shutdown and is left behind.
EXIT_ENGINE_STUCK = 1


@web.middleware
async def _errors(request: web.Request, handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except APIError as e:
        return e.response()
    except web.HTTPRequestEntityTooLarge as e:
        return error_response(
            413, f"the request body is too large: {e.text}", code="body_too_large"
        )
    except web.HTTPException as e:
        if e.status < 400:
            raise
        err_type = "not_found_error" if e.status == 404 else "invalid_request_error"
        message = f"{e.reason}: {request.method} {request.path}"
        return error_response(e.status, message, err_type, headers=_allow_header(e))
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:
        logger.exception("unhandled error serving %s %s", request.method, request.path)
        return error_response(500, "internal server error", "server_error")


def _allow_header(e: web.HTTPException) -> dict[str, str] | None:
    allow = e.headers.get("Allow")
    return {"Allow": allow} if allow else None


def _bearer_token(request: web.Request) -> bytes | None:
    """The token of an `Authorization: Bearer <token>` header, as raw bytes (a header that is
    not UTF-8 is just a wrong key). The scheme is case-insensitive (RFC 7235)."""
    for name, value in request.raw_headers:
        if name.lower() == b"authorization":
            scheme, _, token = value.strip().partition(b" ")
            if scheme.lower() == b"bearer":
                return token.strip()
            return None
    return None


def _gatekeeper(api_key: str | None):
    expected = api_key.encode() if api_key else None

    @web.middleware
    async def gate(request: web.Request, handler) -> web.StreamResponse:
        if request.path in _OPEN_PATHS:
            return await handler(request)
        if expected is not None:
            given = _bearer_token(request)
            if given is None or not hmac.compare_digest(given, expected):
                return error_response(401, "invalid or missing API key", "authentication_error",
                                      code="invalid_api_key",
                                      headers={"WWW-Authenticate": "Bearer"})  # fmt: skip
        if request.app[SERVING].draining:
            return error_response(503, "the server is shutting down", "service_unavailable",
                                  code="draining", headers={"Retry-After": "5"})  # fmt: skip
        try:
            check_content_encoding(request.headers.get("Content-Encoding"))
        except RequestRefused as e:
            return refused(e).response()
        return await handler(request)

    return gate


async def _health(request: web.Request) -> web.Response:
    """Liveness: 200 while the engine loop is idle or busy (a step within its bound), 503 when it
    is dead or stuck; the body says what the loop is doing, or why it is unhealthy."""
    engine: AsyncEngine = request.app[SERVING].engine
    if not engine.is_alive():
        reason = f"engine loop is dead: {engine.error}" if engine.error else "engine loop is dead"
        return web.json_response({"status": "unhealthy", "reason": reason}, status=503)
    verdict = engine.liveness()
    if verdict.healthy:
        return web.json_response({"status": "ok", "engine": verdict.reason})
    return web.json_response({"status": "unhealthy", "reason": verdict.reason}, status=503)


async def _ready(request: web.Request) -> web.Response:
    ctx: ServingContext = request.app[SERVING]
    if ctx.draining:
        return web.json_response({"status": "draining"}, status=503)
    if not ctx.engine.is_alive():
        return web.json_response({"status": "engine not running"}, status=503)
    return web.json_response({"status": "ready"})


async def _metrics(request: web.Request) -> web.Response:
    metrics: EngineMetrics = request.app[METRICS]
    body = await asyncio.to_thread(generate_latest, metrics.registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def _model_card(request: web.Request, name: str) -> ModelCard:
    ctx: ServingContext = request.app[SERVING]
    lora = ctx.adapters.get(name)
    # The root is the served name, never the model's path on the server's disk; an adapter's
    # is its folder (as vLLM shows it) and its parent the base model's served name.
    return ModelCard(
        id=name,
        created=request.app[STARTED],
        owned_by="kvfleet",
        root=ctx.model_name if lora is None else lora.lora_path,
        parent=None if lora is None else ctx.model_name,
        max_model_len=ctx.max_model_len,
    )


async def _models(request: web.Request) -> web.Response:
    ctx: ServingContext = request.app[SERVING]
    names = [*ctx.served_model_names, *ctx.adapters]
    models = ModelList(data=[_model_card(request, name) for name in names])
    return web.json_response(text=models.model_dump_json())


async def _model(request: web.Request) -> web.Response:
    """One model (the openai SDK's models.retrieve). Served names may hold a slash (org/name),
    which the SDK puts into the path as it is."""
    name = request.match_info["model"]
    request.app[SERVING].resolve_model(name)
    return web.json_response(text=_model_card(request, name).model_dump_json())


async def _tokenize(request: web.Request) -> web.Response:
    ctx: ServingContext = request.app[SERVING]
    req = await parse_body(request, TokenizeRequest)
    ctx.resolve_model(req.model)
    if req.messages is not None:
        # The prompt exactly as chat completions renders it, tools included.
        plan = await ctx.parse_off_loop(
            request[BODY_BYTES], OFF_LOOP_BYTES, plan_prompt, req.tools or [], req.messages
        )
        ids = await render_chat_served(
            ctx, req.messages, req.add_generation_prompt, req.chat_template_kwargs,
            (plan, request.app[TOOL_SETTINGS]),
        )  # fmt: skip
    else:
        ids = await ctx.tokenize(req.prompt or "", add_special_tokens=req.add_special_tokens)
    tokens = Tokens(count=len(ids), max_model_len=ctx.max_model_len, tokens=ids)
    return web.json_response(text=tokens.model_dump_json())


async def _detokenize(request: web.Request) -> web.Response:
    ctx: ServingContext = request.app[SERVING]
    req = await parse_body(request, DetokenizeRequest)
    ctx.resolve_model(req.model)
    vocab = ctx.engine.vocab_size
    bad = [t for t in req.tokens if t >= vocab]
    if bad:
        raise APIError(400, f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})",
                       param="tokens")  # fmt: skip
    if ctx.tokenizer is None:
        raise APIError(400, "this server runs without a tokenizer")
    detokenized = Detokenized(prompt=await ctx.decode(req.tokens))
    return web.json_response(text=detokenized.model_dump_json())


def build_app(
    engine: AsyncEngine,
    metrics: EngineMetrics,
    settings: ServerSettings,
    tracing: Tracing | None = None,
) -> web.Application:
    names = settings.served_model_name or [str(engine.model_config.path)]
    app = web.Application(
        middlewares=[
            observe_requests(tracing, access_logger, _OPEN_PATHS),
            _errors,
            _gatekeeper(resolve_api_key(settings)),
        ],
        client_max_size=settings.max_request_body_bytes,
    )
    app.on_response_prepare.append(echo_request_id)
    tokenizer = engine.tokenizer
    if settings.chat_template is not None and tokenizer is not None:
        tokenizer.chat_template = settings.chat_template
    template = tokenizer.chat_template if tokenizer is not None else None
    app[TOOL_SETTINGS] = ToolSettings(
        settings.tool_call_parser or parser_for_template(template),
        settings.enable_auto_tool_choice,
    )
    registry = AdapterRegistry(engine.lora_modules)
    app[ADAPTERS] = registry
    app[SERVING] = ServingContext(
        engine, names, settings.max_waiting_requests, adapters=registry.by_name
    )
    app[METRICS] = metrics
    app[TOKENIZER_BUNDLE] = TokenizerBundleCache(tokenizer, app[TOOL_SETTINGS].parser)
    app[STARTED] = now()
    app[BODY_TIMEOUT] = settings.body_timeout
    app[BODY_LIMIT] = settings.max_request_body_bytes
    app.router.add_get("/health", _health)
    app.router.add_get("/ready", _ready)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/v1/models/{model:.+}", _model)
    app.router.add_post("/v1/completions", create_completion)
    app.router.add_post("/v1/chat/completions", create_chat_completion)
    app.router.add_post("/v1/responses", create_response)
    app.router.add_route("*", "/v1/responses/{path:.+}", stored_response)
    app.router.add_post("/v1/embeddings", create_embedding)
    app.router.add_post("/tokenize", _tokenize)
    app.router.add_post("/detokenize", _detokenize)
    app.router.add_get(TOKENIZER_PATH, serve_tokenizer)
    if engine.kv_events is not None:
        app.router.add_get(KV_EVENTS_PATH, stream_kv_events)
    if settings.enable_runtime_lora_updating:
        app.router.add_post("/v1/load_lora_adapter", load_lora_adapter)
        app.router.add_post("/v1/unload_lora_adapter", unload_lora_adapter)
    return app


def create_engine(args: EngineArgs, settings: ServerSettings) -> tuple[AsyncEngine, EngineMetrics]:
    if settings.enable_runtime_lora_updating and not args.enable_lora:
        raise ValueError("--enable-runtime-lora-updating needs --enable-lora")
    core = EngineCore(args)
    names = settings.served_model_name or [str(core.model_config.path)]
    metrics = EngineMetrics(core.args, names[0])
    engine = AsyncEngine(
        core,
        stall_timeout=settings.health_stall_timeout,
        seconds_per_token=settings.health_seconds_per_token,
        on_step=metrics.on_step,
        on_abort=metrics.on_abort,
    )
    metrics.collect_state(engine.stats)
    metrics.collect_kv_events(engine.kv_events)
    metrics.collect_startup(core.startup)
    structured = core.structured
    metrics.collect_grammar(
        structured.stats if structured is not None else None, core.structured_unavailable
    )
    return engine, metrics


def check_port_free(host: str, port: int) -> None:
    """Raise OSError, in one line, if nothing could listen on host:port now (0: any port)."""
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        # As aiohttp binds: SO_REUSEADDR lets a port in TIME_WAIT pass, never a live listener.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as e:
            raise OSError(f"cannot listen on {host}:{port}: {e.strerror} (--port)") from None


class EngineServer:
    """The engine behind its HTTP API: started, then drained and stopped."""

    def __init__(
        self, args: EngineArgs, settings: ServerSettings, tracing: Tracing | None = None
    ) -> None:
        self.args = args
        self.settings = settings
        self.tracing = tracing
        self.app: web.Application | None = None
        self.engine: AsyncEngine | None = None
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        # Loading a model takes from seconds to minutes: a port that is taken is said first.
        check_port_free(self.settings.host, self.settings.port)
        # On a thread of its own, not the loop's default executor: when a signal ends serve()
        # during the load, the process exits without waiting for it, where closing the loop
        # would join the default executor's threads, and so wait for the whole load.
        loader = ThreadPoolExecutor(1, thread_name_prefix="kvfleet-load")
        try:
            self.engine, metrics = await asyncio.get_running_loop().run_in_executor(
                loader, create_engine, self.args, self.settings
            )
        finally:
            loader.shutdown(wait=False)
        http_started = time.perf_counter()
        self.app = build_app(self.engine, metrics, self.settings, self.tracing)
        # handler_cancellation: a client that hangs up cancels its handler, which aborts its
        # request and frees its KV blocks, even before the first byte was due.
        # keepalive_timeout: aiohttp arms it when a connection opens and after each response,
        # and closes the connection if no complete request head has arrived by then; so it
        # bounds both a client that trickles (or never finishes) its headers and idle
        # keep-alive connections. Compressed bodies are refused, never inflated.
        # lingering_time: how long the unread rest of a refused body (408, 413) is drained
        # before the close; aiohttp's 10 s would let a slow client hold the connection.
        # shutdown_timeout: what the runner waits for handlers at cleanup; our own shutdown
        # has already enforced the deadline by then. What aiohttp answers itself (a request
        # it cannot parse: bad framing, a request line or header over its limit) is OpenAI
        # error JSON too, as every other error (JsonErrorsRunner).
        self._runner = JsonErrorsRunner(
            self.app,
            handler_cancellation=True,
            access_log=None,
            keepalive_timeout=self.settings.header_timeout,
            auto_decompress=False,
            lingering_time=1.0,
            shutdown_timeout=_ABORT_GRACE,
        )
        await self._runner.setup()
        await web.TCPSite(self._runner, self.settings.host, self.settings.port).start()
        startup = self.engine.startup
        startup.record("http", time.perf_counter() - http_started)
        startup.log_ready()
        self.engine.start()
        logger.info(
            "serving %s on %s", self.app[SERVING].served_model_names, self._runner.addresses
        )

    @property
    def port(self) -> int:
        assert self._runner is not None
        return self._runner.addresses[0][1]

    async def shutdown(self, stop_now: asyncio.Event | None = None) -> bool:
        """New requests get 503 while the ones in flight finish, up to shutdown_timeout or until
        `stop_now` is set; what is still running then is aborted (streams end with an error
        event, the others get 503 "draining"), and the connections are closed soon after. The
        engine loop's step in progress is interrupted; False if the loop was stuck and is left
        running (AsyncEngine.stop), its engine not closed, or if `stop_now` is set before the
        loop has stopped (it is not waited for)."""
        assert self.app is not None and self.engine is not None and self._runner is not None
        self.app[SERVING].draining = True
        # Routers go elsewhere now: their event streams end here, not at the deadline.
        self.engine.end_kv_events()
        timeout = self.settings.shutdown_timeout
        deadline = time.monotonic() + timeout
        if self.engine.num_unfinished:
            logger.info(
                "draining: waiting up to %gs for %d requests in flight%s",
                timeout,
                self.engine.num_unfinished,
                "" if stop_now is None else "; Ctrl-C again (or a second SIGTERM) to stop now",
            )
        stop_now = stop_now or asyncio.Event()
        while self.engine.num_unfinished and time.monotonic() < deadline and not stop_now.is_set():
            await asyncio.sleep(0.05)
        if self.engine.num_unfinished:
            logger.warning(
                "%s: aborting %d requests",
                "stopping now" if stop_now.is_set() else "shutdown timeout",
                self.engine.num_unfinished,
            )
            self.engine.abort_all("the server is shutting down")
            # Let the handlers write their error events and responses.
            await asyncio.sleep(0.1)
        await self._runner.cleanup()
        stopping = await _unless(stop_now, self.engine.stop())
        if stopping is None:
            logger.warning("stopping now: not waiting for the engine loop to stop")
            return False
        if not stopping.result():
            return False
        # The server made this engine: its memory goes back with it, whoever still refers to
        # the server object.
        self.engine.close()
        logger.info("stopped")
        return True


class StopSignals:
    """SIGTERM and SIGINT (Ctrl-C), from the start of serve(): the first asks for a stop (the
    model's load is given up, a server drains), the second for an immediate one."""

    def __init__(self) -> None:
        self.first = asyncio.Event()
        self.second = asyncio.Event()
        self.last = signal.SIGINT
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._received, sig)

    def _received(self, sig: signal.Signals) -> None:
        self.last = sig
        if self.first.is_set() and not self.second.is_set():
            logger.warning("%s again: stopping now", sig.name)
            self.second.set()
        self.first.set()

    @property
    def name(self) -> str:
        return self.last.name

    @property
    def exit_code(self) -> int:
        """128 + the last signal's number, as a shell reports a process that signal ended."""
        return 128 + self.last


T = TypeVar("T")


async def _unless(stop: asyncio.Event, work: Awaitable[T]) -> asyncio.Future[T] | None:
    """`work` run until it ends, or until `stop` is set first: its finished future (whose
    result() returns or raises what `work` did), or None, `work` cancelled."""
    task = asyncio.ensure_future(work)
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait([task, stopped], return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
        finished = task.done()
        if not finished:
            task.cancel()
    return task if finished else None


async def serve(args: EngineArgs, settings: ServerSettings, tracing: Tracing | None = None) -> int:
    """Serve until SIGTERM or SIGINT, then drain; 0, EXIT_ENGINE_STUCK when the engine loop was
    stuck in a step and is still running, or 128 + the signal's number when a signal came
    during the model's load, or a second one during the drain: a thread is then left in the
    load or a step. Unless 0, the caller must exit without finalizing (cli._serve)."""
    signals = StopSignals()
    server = EngineServer(args, settings, tracing)
    started = await _unless(signals.first, server.start())
    if started is None:
        logger.warning("%s: interrupted while loading the model; exiting", signals.name)
        return signals.exit_code
    started.result()
    await signals.first.wait()
    logger.info("%s: shutting down", signals.name)
    stopped = await server.shutdown(signals.second)
    if signals.second.is_set():
        return signals.exit_code
    return 0 if stopped else EXIT_ENGINE_STUCK
