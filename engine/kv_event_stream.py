"""The subscribers of an engine's KV events, on the event loop: each gets the snapshot the engine
thread took for it, then every batch the engine publishes after it, through a queue of its own.

The engine never waits for a subscriber: a batch is encoded once and queued for each; one whose
queue holds more than `max_queued_bytes` is dropped (its connection closed: it resyncs from a new
snapshot), so a slow or stalled reader costs memory up to that bound and no more. The number of
subscribers is bounded too. Sequence numbers are the engine thread's (AsyncEngine): one counter
per engine process, whose `engine_id` is new at each start."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from kvfleet.protocol.kv_events import (
    EventBatch,
    Heartbeat,
    KVEvent,
    Snapshot,
    SnapshotBlocks,
    encode_line,
)

logger = logging.getLogger(__name__)

# Routers subscribe once per replica (plus a fleet harness or two): far fewer than this.
MAX_SUBSCRIBERS = 32
# A subscriber this far behind is dropped: about 450,000 block hashes' worth of events.
MAX_QUEUED_BYTES = 16 << 20


class TooManySubscribers(RuntimeError):
    pass


@dataclass(frozen=True, slots=True)
class SnapshotTaken:
    """What the engine thread hands a new subscriber: the seq of the last batch published
    before it, and the hashes the cache held then, per medium."""

    seq: int
    gpu: list[bytes]
    cpu: list[bytes]


class KVEventSubscriber:
    """One subscription's queue: the snapshot, then encoded lines; None when the stream ends
    (the engine stops, or this subscriber fell behind and is dropped)."""

    def __init__(self, engine_id: str) -> None:
        self.engine_id = engine_id
        self._lines: asyncio.Queue[SnapshotTaken | bytes | None] = asyncio.Queue()
        self.queued_bytes = 0
        # The seq of the last line queued; None until the snapshot is.
        self.seq: int | None = None
        self.ended = False
        # Called when the subscriber is dropped: closes its connection, even mid-write.
        self.on_drop: Callable[[], object] | None = None

    async def next_line(self, timeout: float) -> bytes | None:
        """The next line to send, encoded; a heartbeat after `timeout` seconds without one
        (once the snapshot is out); None at the end of the stream."""
        while True:
            try:
                item = await asyncio.wait_for(self._lines.get(), timeout)
            except TimeoutError:
                if self.seq is None:
                    continue  # the snapshot is still being taken
                return encode_line(Heartbeat(seq=self.seq))
            if item is None:
                return None
            if isinstance(item, SnapshotTaken):
                # Every hash the engine holds: encoded off the event loop.
                return await asyncio.to_thread(self._encode_snapshot, item)
            self.queued_bytes -= len(item)
            return item

    def _encode_snapshot(self, taken: SnapshotTaken) -> bytes:
        # Built from the engine's own hashes: nothing to validate.
        blocks = SnapshotBlocks.model_construct(
            gpu=[h.hex() for h in taken.gpu], cpu=[h.hex() for h in taken.cpu]
        )
        snapshot = Snapshot.model_construct(engine_id=self.engine_id, seq=taken.seq, blocks=blocks)
        return encode_line(snapshot)

    def _put(self, item: SnapshotTaken | bytes | None) -> None:
        self._lines.put_nowait(item)


class KVEventStreams:
    """The event-loop side of the engine's KV events: who subscribes, and what each is sent."""

    def __init__(
        self,
        max_subscribers: int = MAX_SUBSCRIBERS,
        max_queued_bytes: int = MAX_QUEUED_BYTES,
    ) -> None:
        self.engine_id = uuid.uuid4().hex
        self.max_subscribers = max_subscribers
        self.max_queued_bytes = max_queued_bytes
        self.subscribers: set[KVEventSubscriber] = set()
        self.closed = False
        # Counted for /metrics.
        self.events_published = 0
        self.dropped = 0

    def open(self) -> KVEventSubscriber:
        """A new subscriber, waiting for its snapshot (start); TooManySubscribers when there
        are max_subscribers already, RuntimeError once the streams are closed."""
        if self.closed:
            raise RuntimeError("the engine is stopping")
        if len(self.subscribers) >= self.max_subscribers:
            raise TooManySubscribers(
                f"this engine serves {self.max_subscribers} KV-event subscribers already"
            )
        sub = KVEventSubscriber(self.engine_id)
        self.subscribers.add(sub)
        return sub

    def start(self, sub: KVEventSubscriber, snapshot: SnapshotTaken) -> None:
        """Queue the subscriber's snapshot: from the engine thread, after every batch published
        before it was taken and before any published after."""
        if sub.ended:
            return
        sub.seq = snapshot.seq
        sub._put(snapshot)

    def publish(self, seq: int, events: list[KVEvent]) -> None:
        """One engine step's events, to every subscriber whose snapshot came before them."""
        self.events_published += len(events)
        line: bytes | None = None
        for sub in list(self.subscribers):
            if sub.seq is None or sub.ended:
                continue  # its snapshot, taken later, holds these events already
            if line is None:
                line = encode_line(EventBatch.model_construct(seq=seq, events=events))
            if sub.queued_bytes + len(line) > self.max_queued_bytes:
                self._drop(sub)
                continue
            sub.seq = seq
            sub.queued_bytes += len(line)
            sub._put(line)

    def _drop(self, sub: KVEventSubscriber) -> None:
        logger.warning(
            "a KV-event subscriber fell %d bytes behind: disconnected (it resyncs)",
            sub.queued_bytes,
        )
        self.dropped += 1
        self.end(sub)
        if sub.on_drop is not None:
            sub.on_drop()

    def end(self, sub: KVEventSubscriber) -> None:
        """End one subscriber's stream (it left, or was dropped)."""
        self.subscribers.discard(sub)
        if not sub.ended:
            sub.ended = True
            sub._put(None)

    def close(self) -> None:
        """End every stream (the engine stops or died); no subscriber is accepted after."""
        self.closed = True
        for sub in list(self.subscribers):
            self.end(sub)
