"""Live servers for tests: an EngineServer on its own event loop in a thread, and an aiohttp
app (the router's) on a free port."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager, contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import aiohttp
from aiohttp import web
from openai import OpenAI

from kvfleet.engine.config import EngineArgs
from kvfleet.engine.server.app import EngineServer, ServerSettings
from kvfleet.telemetry.tracing import Tracing
from tests.support.net import http_call


@contextmanager
def engine_server(
    args: EngineArgs, settings: ServerSettings, tracing: Tracing | None = None
) -> Iterator[SimpleNamespace]:
    """The engine's HTTP server on 127.0.0.1 (settings.port 0: a free one); yields url, srv
    (the EngineServer) and loop (the loop it runs on), and shuts it down gracefully on exit."""
    srv = EngineServer(args, settings, tracing)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        asyncio.run_coroutine_threadsafe(srv.start(), loop).result(120)
        yield SimpleNamespace(url=f"http://127.0.0.1:{srv.port}", srv=srv, loop=loop)
        asyncio.run_coroutine_threadsafe(srv.shutdown(), loop).result(120)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


# The name the tests serve the default model under.
DEFAULT_SERVED_NAME = "smollm2"


@contextmanager
def default_model_server(gguf: Path, name: str, **settings: Any) -> Iterator[SimpleNamespace]:
    """The real default model (its GGUF file, fp32) served as `name` on a free port, with any
    other ServerSettings given; as engine_server."""
    server_settings = ServerSettings(host="127.0.0.1", port=0, served_model_name=[name], **settings)
    with engine_server(EngineArgs(model=str(gguf), dtype="float32"), server_settings) as s:
        yield s


def openai_client(url: str, **kwargs: Any) -> OpenAI:
    """The official SDK on a server's /v1, without retries (a test sees each answer as it
    comes); kwargs: the client's other settings (timeout)."""
    return OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, **kwargs)


@asynccontextmanager
async def running(runner: web.AppRunner) -> AsyncIterator[str]:
    """An aiohttp runner on a free port of 127.0.0.1; yields host:port."""
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


def serving(app: web.Application) -> AbstractAsyncContextManager[str]:
    """The app on a free port with the router's runner settings; yields host:port."""
    return running(web.AppRunner(app, handler_cancellation=True, access_log=None))


@contextmanager
def runner_in_thread(runner: web.AppRunner) -> Iterator[SimpleNamespace]:
    """An aiohttp runner (the router's, with its connection settings) on a free port of
    127.0.0.1, on its own event loop in a thread, for blocking clients; yields host, port, url."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    served = running(runner)
    try:
        addr = asyncio.run_coroutine_threadsafe(served.__aenter__(), loop).result(30)
        host, port = addr.rsplit(":", 1)
        yield SimpleNamespace(host=host, port=int(port), url=f"http://{addr}")
        asyncio.run_coroutine_threadsafe(served.__aexit__(None, None, None), loop).result(30)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


class EngineProcess:
    """``kvfleet-engine serve`` as a child process on 127.0.0.1 (fp32, ``served_name``); entered,
    it waits until /ready and yields the base URL; on exit it kills what is still running.
    ``main``: the module run as the CLI (one that wraps it, as tests.support.slow_steps)."""

    def __init__(
        self,
        model: Path,
        port: int,
        extra: list[str],
        served_name: str,
        env: dict[str, str] | None = None,
        main: str = "kvfleet.engine.cli",
    ) -> None:
        self.argv = [
            sys.executable, "-m", main, "serve", "--model", str(model),
            "--dtype", "float32", "--host", "127.0.0.1", "--port", str(port),
            "--served-model-name", served_name, *extra,
        ]  # fmt: skip
        self.env = env or {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> str:
        self.proc = subprocess.Popen(
            self.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=self.env
        )
        deadline = time.monotonic() + 120
        while True:
            try:
                if http_call(self.url + "/ready", method="GET")[0] == 200:
                    return self.url
            except OSError:
                pass
            assert self.proc.poll() is None, self.proc.stdout.read().decode()  # type: ignore[union-attr]
            assert time.monotonic() < deadline
            time.sleep(0.2)

    def __exit__(self, *exc: object) -> None:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


async def sse_data_lines(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], started: asyncio.Event
) -> list[str]:
    """The `data:` lines of one streamed request, in order; ``started`` is set at the first."""
    lines = []
    async with session.post(url, json=body) as resp:
        async for line in resp.content:
            if line.startswith(b"data: "):
                lines.append(line.decode().strip())
                started.set()
    return lines


def metric(server, name: str) -> float:
    with urllib.request.urlopen(server.url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    for line in text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not exported")


def assert_engine_idle(server, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    names = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
    while True:
        values = [metric(server, n) for n in names]
        if values == [0.0, 0.0, 0.0]:
            return
        assert time.monotonic() < deadline, dict(zip(names, values, strict=True))
        time.sleep(0.05)
