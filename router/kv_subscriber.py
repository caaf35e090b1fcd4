"""The router's subscriptions to the engines' KV events (GET /kv_events on each engine; wire
format in kvfleet.protocol.kv_events), which keep the index (kv_index.py) current.

One stream per ready engine endpoint, opened when the endpoint appears and cancelled when it
goes (its view is dropped with it). Every router replica follows every engine on its own, so
replicas agree without a shared store, and one that starts late begins from each engine's
snapshot. A stream that ends, breaks, goes silent for ``stale_after`` seconds, skips a sequence
number or comes from a restarted engine (a new engine_id) is opened again after a backoff with
jitter, and starts from a new snapshot; meanwhile the engine's view is gone or stale, and
requests are scored for it as approximate routing would.

An engine's stream is semi-trusted input: each line is bounded (``max_line_bytes``: a snapshot
of the index's bound of hashes in each medium fits), validated against the wire models, and a
line that is not is a broken stream (resync), never a router failure. Large lines are parsed off
the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable

import aiohttp
from pydantic import ValidationError

from kvfleet.protocol.json_body import OFF_LOOP_BYTES
from kvfleet.protocol.kv_events import PATH, EventBatch, Heartbeat, Snapshot, parse_line
from kvfleet.router.endpoints import Backoff
from kvfleet.router.kv_index import Gap, KvIndex, build_view

logger = logging.getLogger("kvfleet.router.kv_subscriber")


def max_line_bytes(max_blocks: int) -> int:
    """The longest line read: a snapshot of the index's bound in each medium, 35 bytes a hash
    ("<32 hex>",), and room for the rest (18 MB at the default bound)."""
    return 2 * max_blocks * 35 + 4096


RESYNC_REASONS = ("connect", "closed", "silent", "gap", "new_engine", "invalid")


class StreamBroken(Exception):
    """The stream cannot be followed any further: ``reason`` (a RESYNC_REASONS entry)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


async def stream_lines(
    content: aiohttp.StreamReader, max_line_bytes: int, idle_s: float
) -> AsyncIterator[bytes]:
    """The lines of an NDJSON body, each at most ``max_line_bytes``; raises StreamBroken when a
    line is longer, or nothing arrives for ``idle_s`` seconds. A newline is looked for in each
    chunk only, so a long line read in many chunks costs its length once."""
    parts: list[bytes] = []
    size = 0
    while True:
        try:
            async with asyncio.timeout(idle_s):
                chunk = await content.readany()
        except TimeoutError:
            raise StreamBroken("silent", f"nothing for {idle_s:g} s") from None
        if not chunk:
            return
        while (end := chunk.find(b"\n")) >= 0:
            parts.append(chunk[:end])
            line = b"".join(parts)
            parts, size, chunk = [], 0, chunk[end + 1 :]
            if len(line) > max_line_bytes:
                raise StreamBroken("invalid", f"a line over {max_line_bytes} bytes")
            if line.strip():
                yield line
        parts.append(chunk)
        size += len(chunk)
        if size > max_line_bytes:
            raise StreamBroken("invalid", f"a line over {max_line_bytes} bytes")


async def parsed(line: bytes) -> Snapshot | EventBatch | Heartbeat:
    """One line, validated (a large one off the event loop); raises StreamBroken."""
    try:
        if len(line) <= OFF_LOOP_BYTES:
            return parse_line(line)
        return await asyncio.to_thread(parse_line, line)
    except ValidationError as e:
        raise StreamBroken("invalid", f"not a KV events line: {e.errors()[0]['msg']}") from None


class KvSubscriber:
    """Follows every engine's stream into ``index``; ``on_applied(n)``, ``on_resync(reason)``:
    the router's metrics; ``headers``: sent on each request (the engines' API key);
    ``on_new_engine(endpoint)``: a stream's snapshot came from an engine not seen there before."""

    def __init__(
        self,
        index: KvIndex,
        on_applied: Callable[[int], None],
        on_resync: Callable[[str], None],
        *,
        initial_backoff_s: float = 0.5,
        max_backoff_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        headers: dict[str, str] | None = None,
        on_new_engine: Callable[[str], None] | None = None,
    ) -> None:
        self.index = index
        self.headers = {**(headers or {}), "Accept-Encoding": "identity"}
        self.on_new_engine = on_new_engine
        self.on_applied = on_applied
        self.on_resync = on_resync
        self.initial_backoff_s = initial_backoff_s
        self.max_backoff_s = max_backoff_s
        self.max_line_bytes = max_line_bytes(index.max_blocks)
        self.clock = clock
        self.session: aiohttp.ClientSession | None = None
        self._streams: dict[str, asyncio.Task[None]] = {}
        self._wanted: frozenset[str] = frozenset()
        # The engine id each endpoint's last snapshot named: a restarted engine is logged.
        self._engine_ids: dict[str, str] = {}

    def start(self) -> None:
        """Open the session, and follow the endpoints set so far (on the running loop)."""
        self.session = aiohttp.ClientSession(
            # Each read has its own deadline (stale_after); a stream lasts as long as the engine.
            timeout=aiohttp.ClientTimeout(total=None, connect=5),
            auto_decompress=False,
            connector=aiohttp.TCPConnector(limit=0),
        )
        self.set_endpoints(self._wanted)

    def set_endpoints(self, endpoints: Iterable[str]) -> None:
        """Follow the engines of ``endpoints``, and only those (from start on)."""
        self._wanted = frozenset(endpoints)
        if self.session is None:
            return
        for endpoint in set(self._streams) - self._wanted:
            self._streams.pop(endpoint).cancel()
            self._engine_ids.pop(endpoint, None)
            self.index.drop(endpoint)
        for endpoint in self._wanted - set(self._streams):
            self._streams[endpoint] = asyncio.create_task(self._follow(endpoint))

    async def close(self) -> None:
        tasks = list(self._streams.values())
        self._streams.clear()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self.session is not None:
            await self.session.close()

    async def _follow(self, endpoint: str) -> None:
        backoff = Backoff(self.initial_backoff_s, self.max_backoff_s)
        while True:
            try:
                await self._stream(endpoint, backoff)
                reason, message = "closed", "the stream ended"
            except StreamBroken as e:
                reason, message = e.reason, str(e)
            except (aiohttp.ClientError, OSError, TimeoutError) as e:
                reason, message = "connect", f"{type(e).__name__}: {e}"
            except Exception as e:  # a failure mode not foreseen, on semi-trusted input
                logger.exception("KV events of %s: stream failed", endpoint)
                reason, message = "invalid", repr(e)
            self.index.drop(endpoint)
            self.on_resync(reason)
            logger.info("KV events of %s: %s; resync after a backoff", endpoint, message)
            await backoff.sleep()

    async def _stream(self, endpoint: str, backoff: Backoff) -> None:
        """Follow one connection until it ends or breaks (StreamBroken)."""
        assert self.session is not None
        async with self.session.get(f"http://{endpoint}{PATH}", headers=self.headers) as response:
            if response.status != 200:
                raise StreamBroken("connect", f"{PATH} answered {response.status}")
            first = True
            lines = stream_lines(response.content, self.max_line_bytes, self.index.stale_after)
            async for raw in lines:
                line = await parsed(raw)
                now = self.clock()
                if first:
                    if not isinstance(line, Snapshot):
                        raise StreamBroken("invalid", f"the stream began with a {line.type}")
                    known = self._engine_ids.get(endpoint)
                    if known is not None and known != line.engine_id:
                        logger.info("KV events of %s: a new engine (%s)", endpoint, line.engine_id)
                    self._engine_ids[endpoint] = line.engine_id
                    if known != line.engine_id and self.on_new_engine is not None:
                        self.on_new_engine(endpoint)
                    view = await asyncio.to_thread(build_view, endpoint, line, now,
                                                   self.index.max_blocks)  # fmt: skip
                    self.index.install(endpoint, view)
                    backoff.reset()
                    first = False
                    continue
                try:
                    if isinstance(line, EventBatch):
                        self.on_applied(self.index.apply(endpoint, line, now))
                    elif isinstance(line, Heartbeat):
                        self.index.heartbeat(endpoint, line.seq, now)
                    else:
                        new = line.engine_id != self._engine_ids[endpoint]
                        raise StreamBroken("new_engine" if new else "gap",
                                           "a second snapshot in one stream")  # fmt: skip
                except Gap as e:
                    raise StreamBroken("gap", str(e)) from None
