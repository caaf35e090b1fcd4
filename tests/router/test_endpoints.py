"""The EndpointSlice watcher's reconnection rules against a fake API server: a stream that ends
at once is resumed after a growing backoff (no hot loop), a failing API likewise, an expired
version is listed again, and a 401 reloads the credentials."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
from aiohttp import web
from kubernetes_asyncio.client import Configuration

from kvfleet.router.endpoints import Backoff, EndpointSliceWatcher

SLICES = "/apis/discovery.k8s.io/v1/namespaces/ml/endpointslices"


def _list(version: str, *addresses: str) -> web.Response:
    item = {
        "metadata": {"name": "s1", "resourceVersion": version},
        "endpoints": [{"addresses": [a], "conditions": {"ready": True}} for a in addresses],
    }
    return web.json_response({"metadata": {"resourceVersion": version}, "items": [item]})


@asynccontextmanager
async def api(
    handler: Callable[[web.Request], Any], token: Callable[[], str] = lambda: "t"
) -> AsyncIterator[Callable[..., EndpointSliceWatcher]]:
    app = web.Application()
    app.router.add_get(SLICES, handler)
    # Cancelled handlers: a watch the client dropped must not hold the cleanup up.
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"

    async def connect() -> Configuration:
        cfg = Configuration(host=url)
        cfg.api_key["BearerToken"] = f"Bearer {token()}"
        return cfg

    def watcher(on_change: Callable[[frozenset[str]], None], **kw: Any) -> EndpointSliceWatcher:
        return EndpointSliceWatcher(connect, "ml", "chat-engine", 8000, on_change, **kw)

    try:
        yield watcher
    finally:
        await runner.cleanup()


async def run_for(watcher: EndpointSliceWatcher, seconds: float) -> None:
    task = asyncio.create_task(watcher.run())
    await asyncio.sleep(seconds)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


@pytest.mark.asyncio
async def test_streams_that_end_at_once_back_off() -> None:
    watches: list[str] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        if "watch" not in request.query:
            return _list("5", "10.0.0.1")
        watches.append(request.query["resourceVersion"])
        return web.StreamResponse()  # ends at once, no event

    changes: list[frozenset[str]] = []
    async with api(handler) as watcher:
        await run_for(watcher(changes.append, initial_backoff_s=0.05, max_backoff_s=0.4), 1.0)
    assert changes == [{"10.0.0.1:8000"}]
    # Backoffs of 0.05, 0.1, 0.2, 0.4, 0.4 ... (times 0.5 to 1): a handful, not hundreds.
    assert 3 <= len(watches) <= 12, watches
    assert set(watches) == {"5"}


@pytest.mark.asyncio
async def test_failing_api_backs_off_and_keeps_the_last_endpoints() -> None:
    calls: list[str] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        calls.append(request.query.get("watch", "list"))
        if len(calls) == 1:
            return _list("5", "10.0.0.1")
        return web.json_response({"kind": "Status", "code": 500}, status=500)

    changes: list[frozenset[str]] = []
    async with api(handler) as watcher:
        await run_for(watcher(changes.append, initial_backoff_s=0.05, max_backoff_s=0.4), 1.0)
    assert changes == [{"10.0.0.1:8000"}]  # never cleared by the outage
    assert 3 <= len(calls) <= 12, calls


@pytest.mark.asyncio
async def test_expired_version_relists_and_bookmarks_advance_the_version() -> None:
    seen: list[str | None] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        seen.append(request.query.get("resourceVersion"))
        if "watch" not in request.query:
            return _list(
                "7" if len(seen) == 1 else "40", "10.0.0.1" if len(seen) == 1 else "10.0.0.2"
            )
        assert request.query["watch"] == request.query["allowWatchBookmarks"] == "true"
        if request.query["resourceVersion"] == "20":
            return web.json_response({"kind": "Status", "code": 410}, status=410)
        resp = web.StreamResponse()
        await resp.prepare(request)
        if request.query["resourceVersion"] == "7":
            bookmark = {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "20"}}}
            await resp.write(json.dumps(bookmark).encode() + b"\n")
        else:
            await asyncio.sleep(30)
        return resp

    changes: list[frozenset[str]] = []
    async with api(handler) as watcher:
        await run_for(watcher(changes.append, initial_backoff_s=5), 0.5)
    # No backoff of 5 s anywhere: a bookmark is progress, a 410 after it lists at once.
    assert seen == [None, "7", "20", None, "40"]
    assert changes == [{"10.0.0.1:8000"}, {"10.0.0.2:8000"}]


@pytest.mark.asyncio
async def test_repeated_410s_relist_after_a_growing_backoff() -> None:
    """Issue 17: a bookmark, then 410, every time (161 requests/s before): at most 12 lists in
    the first second, and fewer each second after (the backoff's cap: 30 s by default)."""
    lists: list[float] = []
    loop = asyncio.get_running_loop()

    async def handler(request: web.Request) -> web.StreamResponse:
        if "watch" not in request.query:
            lists.append(loop.time())
            return _list("7", "10.0.0.1")
        if request.query["resourceVersion"] == "20":
            return web.json_response({"kind": "Status", "code": 410}, status=410)
        resp = web.StreamResponse()
        await resp.prepare(request)
        bookmark = {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "20"}}}
        await resp.write(json.dumps(bookmark).encode() + b"\n")
        return resp

    changes: list[frozenset[str]] = []
    async with api(handler) as watcher:
        await run_for(watcher(changes.append, initial_backoff_s=0.05, max_backoff_s=0.4), 1.0)
    assert changes == [{"10.0.0.1:8000"}]
    # The first 410 lists at once; then 0.05, 0.1, 0.2, 0.4 ... (times 0.5 to 1).
    assert 3 <= len(lists) <= 12, len(lists)


@pytest.mark.asyncio
async def test_401_reloads_the_credentials() -> None:
    tokens = iter(["expired", "fresh"])
    auth: list[str] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        auth.append(request.headers["Authorization"])
        if request.headers["Authorization"] == "Bearer expired":
            return web.json_response({"kind": "Status", "code": 401}, status=401)
        return _list("5", "10.0.0.1")

    changes: list[frozenset[str]] = []
    async with api(handler, token=lambda: next(tokens, "fresh")) as watcher:
        await run_for(watcher(changes.append, initial_backoff_s=0.01), 0.3)
    assert auth[:2] == ["Bearer expired", "Bearer fresh"]
    assert changes == [{"10.0.0.1:8000"}]


@pytest.mark.asyncio
async def test_backoff_doubles_to_its_cap_with_jitter(monkeypatch: pytest.MonkeyPatch) -> None:
    slept: list[float] = []

    async def sleep(s: float) -> None:
        slept.append(s)

    monkeypatch.setattr(asyncio, "sleep", sleep)
    b = Backoff(1.0, 4.0)
    for _ in range(5):
        await b.sleep()
    b.reset()
    await b.sleep()
    caps = [1, 2, 4, 4, 4, 1]
    assert all(cap / 2 <= s <= cap for s, cap in zip(slept, caps, strict=True)), slept
