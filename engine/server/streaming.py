"""Server-sent events, and merging the output streams of several prompts into one."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

from aiohttp import web

from kvfleet.engine.outputs import CompletionOutput, RequestOutput
from kvfleet.engine.server.errors import ENGINE_ERRORS, APIError, engine_error

logger = logging.getLogger(__name__)
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

    async def send(self, payload: dict[str, Any]) -> None:
        data = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
        await self.response.write(b"data: " + data.encode() + b"\n\n")

    async def finish(self) -> web.StreamResponse:
        await self.response.write(b"data: [DONE]\n\n")
        await self.response.write_eof()
        return self.response


def nothing_to_send(choice: CompletionOutput) -> bool:
    """A token that completed no character (text held back) and carries no logprobs or finish:
    a chunk for it would be empty noise."""
    return not choice.text and choice.finish_reason is None and choice.logprobs is None


Choices = list[dict[str, Any]]


async def relay(
    sse: SSEResponse,
    outputs: AsyncGenerator[tuple[int, RequestOutput], None],
    to_choices: Callable[[int, RequestOutput], Choices],
    chunk: Callable[[Choices], dict[str, Any]],
) -> bool:
    """One event per engine step, carrying the choices `to_choices` makes of its delta (steps
    that make none send nothing). False, after an error event, when the request could not be
    finished: the engine failed it, the server aborted it, the engine died, or the server
    failed on it (the stream has begun: its error is an event, and the stream still ends)."""
    try:
        async with aclosing(outputs) as it:
            async for i, delta in it:
                choices = to_choices(i, delta)
                if choices:
                    await sse.send(chunk(choices))
    except ENGINE_ERRORS as e:
        await sse.send(engine_error(e).sse_payload())
        return False
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:
        logger.exception("unhandled error streaming %s", sse.request.path)
        await sse.send(APIError(500, "internal server error", "server_error").sse_payload())
        return False
    return True
