"""``kvfleet-router``: the command line of the router process."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from collections.abc import Sequence

from aiohttp import web
from kubernetes_asyncio.config import ConfigException
from pydantic import ValidationError

from kvfleet.router.endpoints import EndpointSliceWatcher, in_cluster_namespace, load_configuration
from kvfleet.router.prompt_tokenizer import load_tokenizer
from kvfleet.router.proxy import Router, build_runner
from kvfleet.router.settings import RouterSettings, ServingSettings, engine_api_key
from kvfleet.telemetry.logs import add_log_flags, configure_logging
from kvfleet.telemetry.settings_flags import add_model_flags, flag_values, one_line
from kvfleet.telemetry.tracing import Tracing, TracingUnavailable, add_tracing_flag, tracing_from

logger = logging.getLogger("kvfleet.router")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvfleet-router", description="the reverse proxy in front of the engines"
    )
    add_model_flags(p, ServingSettings, "serving")
    add_model_flags(p, RouterSettings, "routing")
    add_tracing_flag(p)
    add_log_flags(p)
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The flags, checked as the settings check them: a bad value is a usage error."""
    p = build_parser()
    ns = p.parse_args(argv)
    try:
        serving_from(ns)
        settings_from(ns)
    except ValidationError as e:
        p.error(one_line(e))
    return ns


def serving_from(ns: argparse.Namespace) -> ServingSettings:
    return ServingSettings(**flag_values(ns, ServingSettings))


def settings_from(ns: argparse.Namespace) -> RouterSettings:
    return RouterSettings(**flag_values(ns, RouterSettings))


async def serve(ns: argparse.Namespace, tracing: Tracing | None = None) -> int:
    serving = serving_from(ns)
    settings = settings_from(ns)
    tokenizer = load_tokenizer(
        serving.tokenizer, settings.tokenized_chars, serving.tool_call_parser
    )
    router = Router(
        settings,
        tokenizer,
        tracing,
        fetch_tokenizer=serving.tokenizer is None,
        engine_api_key=engine_api_key(),
    )
    watch: asyncio.Task[None] | None = None
    if serving.endpoints is not None:
        router.set_endpoints(serving.endpoints)
    elif serving.engine_service is not None:
        namespace = serving.namespace or in_cluster_namespace()
        if not namespace:
            raise SystemExit("--namespace is required outside a cluster")
        try:
            # Loaded here to fail fast; the watcher loads them again, at start and on a 401.
            await load_configuration()
        except (ConfigException, OSError) as e:
            raise SystemExit(f"--engine-service needs the Kubernetes API: {e}") from None
        watcher = EndpointSliceWatcher(
            load_configuration,
            namespace,
            serving.engine_service,
            serving.engine_port,
            router.set_endpoints,
        )
        watch = asyncio.create_task(watcher.run())
    runner = build_runner(router)
    await runner.setup()
    await web.TCPSite(runner, serving.host, serving.port).start()
    logger.info("routing on %s:%d", serving.host, serving.port)
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
