"""Live servers for tests: an EngineServer on its own event loop in a thread, and an aiohttp
app (the router's) on a free port."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager, contextmanager
from types import SimpleNamespace

from aiohttp import web

from kvfleet.engine.config import EngineArgs
from kvfleet.engine.server.app import EngineServer, ServerSettings


@contextmanager
def engine_server(args: EngineArgs, settings: ServerSettings) -> Iterator[SimpleNamespace]:
    """The engine's HTTP server on 127.0.0.1 (settings.port 0: a free one); yields url, srv
    (the EngineServer) and loop (the loop it runs on), and shuts it down gracefully on exit."""
    srv = EngineServer(args, settings)
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
