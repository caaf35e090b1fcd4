"""The KV events' subscribers on the event loop: snapshot first, then only the batches after
it; a subscriber that falls behind is dropped, never waited for; the subscriber bound; every
stream ended at close."""

from __future__ import annotations

import pytest

from kvfleet.engine.kv_event_stream import KVEventStreams, SnapshotTaken, TooManySubscribers
from kvfleet.protocol.kv_events import BlockRemoved, EventBatch, Heartbeat, Snapshot, parse_line

H = bytes(range(16))


def _batch(n: int) -> list:
    return [BlockRemoved(block_hashes=[H.hex()] * n, medium="gpu")]


@pytest.mark.asyncio
async def test_a_subscriber_gets_its_snapshot_then_the_batches_after_it() -> None:
    streams = KVEventStreams()
    sub = streams.open()
    streams.publish(1, _batch(1))  # before its snapshot was taken: in the snapshot already
    streams.start(sub, SnapshotTaken(1, [H], []))
    streams.publish(2, _batch(2))
    snapshot = parse_line(await sub.next_line(1))
    assert isinstance(snapshot, Snapshot) and snapshot.seq == 1
    assert snapshot.engine_id == streams.engine_id and snapshot.blocks.gpu == [H.hex()]
    batch = parse_line(await sub.next_line(1))
    assert isinstance(batch, EventBatch) and batch.seq == 2 and batch.events == _batch(2)
    heartbeat = parse_line(await sub.next_line(0.01))
    assert heartbeat == Heartbeat(seq=2)
    assert streams.events_published == 2
    # Each engine process is a cache of its own.
    assert KVEventStreams().engine_id != streams.engine_id


@pytest.mark.asyncio
async def test_a_subscriber_that_falls_behind_is_dropped_and_the_others_go_on() -> None:
    streams = KVEventStreams(max_queued_bytes=2000)
    slow, fast = streams.open(), streams.open()
    dropped = []
    slow.on_drop = lambda: dropped.append(True)
    for sub in (slow, fast):
        streams.start(sub, SnapshotTaken(0, [], []))
    await fast.next_line(1)
    for seq in range(1, 40):
        streams.publish(seq, _batch(1))
        line = parse_line(await fast.next_line(1))
        assert isinstance(line, EventBatch) and line.seq == seq
    assert dropped == [True] and streams.dropped == 1
    assert streams.subscribers == {fast}
    # What the slow one had queued is bounded; its stream ends after it.
    lines = []
    while (line := await slow.next_line(1)) is not None:
        lines.append(line)
    assert 0 < sum(map(len, lines)) - len(lines[0]) <= 2000


@pytest.mark.asyncio
async def test_subscribers_are_bounded_and_closing_ends_every_stream() -> None:
    streams = KVEventStreams(max_subscribers=2)
    subs = [streams.open(), streams.open()]
    with pytest.raises(TooManySubscribers):
        streams.open()
    streams.end(subs[0])
    subs[1] = streams.open()
    streams.close()
    for sub in subs:
        assert await sub.next_line(1) is None
    with pytest.raises(RuntimeError):
        streams.open()
