"""``kvfleet-router``: the command line of the router process."""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import signal
from collections.abc import Sequence

from aiohttp import web
from kubernetes_asyncio.config import ConfigException

from kvfleet.protocol.byte_size import FORMS, byte_size_flag, format_byte_size
from kvfleet.router.breaker import BreakerPolicy
from kvfleet.router.endpoints import (
    EndpointSliceWatcher,
    in_cluster_namespace,
    load_configuration,
    parse_static,
)
from kvfleet.router.prompt_tokenizer import load_tokenizer
from kvfleet.router.proxy import Router, RouterSettings, build_runner
from kvfleet.router.request_body import BodyLimits
from kvfleet.router.routing_key import KeyPolicy
from kvfleet.telemetry.logs import add_log_flags, configure_logging
from kvfleet.telemetry.ports import ENGINE_PORT, ROUTER_PORT
from kvfleet.telemetry.tracing import Tracing, TracingUnavailable, add_tracing_flag, tracing_from

logger = logging.getLogger("kvfleet.router")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvfleet-router", description="the reverse proxy in front of the engines"
    )
    # "%(default)s": argparse prints the parser's own default, which cannot go stale.
    d = " (default: %(default)s)"
    p.add_argument("--host", default="0.0.0.0", help="address to listen on" + d)
    p.add_argument("--port", type=int, default=ROUTER_PORT, help="port to listen on" + d)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--engine-service", help="watch this Service's EndpointSlices")
    src.add_argument("--endpoints", type=parse_static, help="static host:port,host:port list")
    p.add_argument("--namespace", help="of the engine Service (default: the pod's namespace)")
    p.add_argument("--engine-port", type=int, default=ENGINE_PORT,
                   help="the engines' HTTP port, with --engine-service" + d)  # fmt: skip
    p.add_argument("--session-header", default="x-session-id",
                   help="request header whose value keeps a session on one engine" + d)  # fmt: skip
    p.add_argument("--use-user-field", action=argparse.BooleanOptionalAction, default=True,
                   help="key a request without that header by its body's user" + d)  # fmt: skip
    p.add_argument("--prefix-affinity", action=argparse.BooleanOptionalAction, default=True,
                   help="key any other request by its prompt's prefix" + d)  # fmt: skip
    p.add_argument("--prefix-length", type=int, default=256, help="prompt tokens in the key" + d)
    p.add_argument("--load-factor", type=float, default=1.25,
                   help="an engine takes at most this times the mean load before keys spill "
                        "to the next" + d)  # fmt: skip
    p.add_argument("--engine-load-interval", type=float, default=1.0,
                   help="seconds between reads of each engine's own load (its /metrics), "
                        "which the load bound counts; 0: own requests only" + d)  # fmt: skip
    p.add_argument("--hold-timeout", type=float, default=120.0,
                   help="seconds a request waits for a ready engine" + d)  # fmt: skip
    p.add_argument("--tokenizer", help="local HF tokenizer directory for token prefix keys; "
                   "default: prefix keys of characters")  # fmt: skip
    p.add_argument("--max-body-bytes", type=byte_size_flag, metavar="SIZE",
                   default=format_byte_size(BodyLimits.max_bytes),
                   help=f"larger request bodies get 413; {FORMS}" + d)  # fmt: skip
    p.add_argument("--max-json-depth", type=int, default=BodyLimits.max_depth,
                   help="deeper-nested request bodies get 400" + d)  # fmt: skip
    p.add_argument("--body-timeout", type=float, default=30.0,
                   help="seconds a client has to send a request body" + d)  # fmt: skip
    p.add_argument("--keepalive-timeout", type=float, default=15.0,
                   help="seconds an idle connection stays open; also the time to send a "
                        "request head" + d)  # fmt: skip
    p.add_argument("--upstream-first-byte-timeout", type=float,
                   default=RouterSettings.first_byte_timeout_s,
                   help="seconds an engine has to begin its answer once the request is sent; a "
                        "non-streamed answer begins when its generation ends" + d)  # fmt: skip
    p.add_argument("--upstream-idle-timeout", type=float, default=RouterSettings.idle_timeout_s,
                   help="seconds an engine may send nothing once its answer began, and before a "
                        "stream's headers; covers a queued request's wait and its prefill"
                        + d)  # fmt: skip
    p.add_argument("--breaker-failures", type=int, default=BreakerPolicy.failures,
                   help="consecutive failures that eject an engine" + d)  # fmt: skip
    p.add_argument("--breaker-backoff", type=float, default=BreakerPolicy.backoff_s,
                   help="seconds of the first ejection; doubles for each in a row" + d)  # fmt: skip
    p.add_argument("--breaker-max-backoff", type=float, default=BreakerPolicy.max_backoff_s,
                   help="the longest ejection, in seconds" + d)  # fmt: skip
    add_tracing_flag(p)
    add_log_flags(p)
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = build_parser()
    ns = p.parse_args(argv)
    if ns.prefix_length < 1 or ns.load_factor < 1 or ns.hold_timeout < 0:
        p.error("need --prefix-length >= 1, --load-factor >= 1, --hold-timeout >= 0")
    if ns.max_body_bytes < 1024 or ns.max_json_depth < 8:
        p.error("need --max-body-bytes >= 1024, --max-json-depth >= 8")
    if ns.body_timeout <= 0 or ns.keepalive_timeout <= 0:
        p.error("need --body-timeout > 0, --keepalive-timeout > 0")
    timeouts = (ns.upstream_first_byte_timeout, ns.upstream_idle_timeout)
    if not all(math.isfinite(t) and t > 0 for t in timeouts):
        p.error("need --upstream-first-byte-timeout > 0, --upstream-idle-timeout > 0 seconds")
    if not (math.isfinite(ns.engine_load_interval) and ns.engine_load_interval >= 0):
        p.error("need --engine-load-interval >= 0 seconds (0 turns it off)")
    try:
        BreakerPolicy(ns.breaker_failures, ns.breaker_backoff, ns.breaker_max_backoff)
    except ValueError as e:
        p.error(f"circuit breaker: {e}")
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
        body=BodyLimits(max_bytes=ns.max_body_bytes, max_depth=ns.max_json_depth),
        breaker=BreakerPolicy(ns.breaker_failures, ns.breaker_backoff, ns.breaker_max_backoff),
        keepalive_timeout_s=ns.keepalive_timeout,
        body_timeout_s=ns.body_timeout,
        engine_load_interval_s=ns.engine_load_interval,
        first_byte_timeout_s=ns.upstream_first_byte_timeout,
        idle_timeout_s=ns.upstream_idle_timeout,
    )


async def serve(ns: argparse.Namespace, tracing: Tracing | None = None) -> int:
    router = Router(settings_from(ns), load_tokenizer(ns.tokenizer), tracing)
    watch: asyncio.Task[None] | None = None
    if ns.endpoints is not None:
        router.set_endpoints(ns.endpoints)
    else:
        namespace = ns.namespace or in_cluster_namespace()
        if not namespace:
            raise SystemExit("--namespace is required outside a cluster")
        try:
            # Loaded here to fail fast; the watcher loads them again, at start and on a 401.
            await load_configuration()
        except (ConfigException, OSError) as e:
            raise SystemExit(f"--engine-service needs the Kubernetes API: {e}") from None
        watcher = EndpointSliceWatcher(
            load_configuration, namespace, ns.engine_service, ns.engine_port, router.set_endpoints
        )
        watch = asyncio.create_task(watcher.run())
    runner = build_runner(router)
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
    configure_logging(ns.log_level, ns.log_format)
    try:
        tracing = tracing_from(ns.otlp_traces_endpoint, "router")
    except (ValueError, TracingUnavailable) as e:
        raise SystemExit(f"kvfleet-router: {e}") from None
    try:
        return asyncio.run(serve(ns, tracing))
    finally:
        if tracing is not None:
            tracing.shutdown()


if __name__ == "__main__":
    raise SystemExit(main())
