"""GET /kv_events: the engine's KV events as newline-delimited JSON (kvfleet.protocol.kv_events):
a snapshot, then a batch per engine step that changed the prefix cache, and a heartbeat each
second the stream is otherwise quiet. Not under /v1, so the router's proxy never forwards it."""

from __future__ import annotations

import asyncio

from aiohttp import web

from kvfleet.engine.async_engine import EngineDeadError
from kvfleet.engine.kv_event_stream import TooManySubscribers
from kvfleet.engine.server.errors import APIError
from kvfleet.engine.server.serving import SERVING
from kvfleet.protocol.kv_events import CONTENT_TYPE, HEARTBEAT_SECONDS


async def stream_kv_events(request: web.Request) -> web.StreamResponse:
    engine = request.app[SERVING].engine
    try:
        sub = engine.subscribe_kv_events()
    except TooManySubscribers as e:
        raise APIError(
            429, f"{e}; retry later", "rate_limit_error", code="too_many_subscribers",
            headers={"Retry-After": "5"},
        ) from None  # fmt: skip
    except (EngineDeadError, RuntimeError) as e:
        raise APIError(503, str(e), "service_unavailable", code="engine_unavailable") from None
    # A subscriber dropped for falling behind may be stuck writing to a client that reads
    # nothing: its handler is cancelled, which closes the connection.
    task = asyncio.current_task()
    if task is not None:
        sub.on_drop = task.cancel
    try:
        response = web.StreamResponse(
            headers={"Content-Type": CONTENT_TYPE, "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        while (line := await sub.next_line(HEARTBEAT_SECONDS)) is not None:
            await response.write(line)
        await response.write_eof()
        return response
    finally:
        engine.unsubscribe_kv_events(sub)
