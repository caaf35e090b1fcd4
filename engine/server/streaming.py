"""Server-sent events, and merging the output streams of several prompts into one."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from aiohttp import web
from pydantic import BaseModel

from kvfleet.engine.outputs import RequestOutput
from kvfleet.engine.server.errors import APIError

_END = object()


async def merge_streams(
    streams: list[AsyncIterator[RequestOutput]],
) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """Interleave outputs as they come, tagged with their stream's index. Closing the merged
    iterator (or an error in any stream) closes every stream, which aborts its request."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in stream:
                queue.put_nowait((i, out))
            queue.put_nowait((i, _END))
        except asyncio.CancelledError:
            raise
        except Exception as e:
            queue.put_nowait((i, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is _END:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class SSEResponse:
    """An OpenAI-style event stream: `data: {json}` events, then `data: [DONE]`."""

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.response = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",  # proxies must not buffer a token stream
            }
        )

    async def start(self) -> None:
        await self.response.prepare(self.request)

    async def send(self, event: BaseModel) -> None:
        await self.response.write(b"data: " + event.model_dump_json().encode() + b"\n\n")

    async def send_error(self, error: APIError) -> None:
        """The event that ends a stream which failed, before [DONE]."""
        data = json.dumps(error.body(), ensure_ascii=False, separators=(",", ":"))
        await self.response.write(b"data: " + data.encode() + b"\n\n")

    async def finish(self, done: bool = True) -> web.StreamResponse:
        """The end of the stream: `data: [DONE]` first unless `done` is false (the Responses
        API's streams end with their last event)."""
        if done:
            await self.response.write(b"data: [DONE]\n\n")
        await self.response.write_eof()
        return self.response
