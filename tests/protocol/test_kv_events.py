"""The KV events' wire format: lines round-trip, the discriminators pick the model, and what
is not a line of the stream is refused."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from kvfleet.protocol.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    Heartbeat,
    Snapshot,
    SnapshotBlocks,
    encode_line,
    hash_hex,
    parse_line,
)

H1, H2 = hash_hex(bytes(range(16))), hash_hex(bytes(16))


def test_lines_round_trip() -> None:
    lines = [
        Snapshot(engine_id="e1", seq=0, blocks=SnapshotBlocks(gpu=[H1], cpu=[H2])),
        EventBatch(
            seq=1,
            events=[
                BlockStored(block_hashes=[H1, H2], parent_block_hash=None, medium="gpu"),
                BlockStored(block_hashes=[H2], parent_block_hash=H1, medium="cpu", lora_name="a"),
                BlockRemoved(block_hashes=[H1], medium="gpu"),
                AllBlocksCleared(),
            ],
        ),
        Heartbeat(seq=1),
    ]
    for line in lines:
        raw = encode_line(line)
        assert raw.endswith(b"\n") and raw.count(b"\n") == 1
        assert parse_line(raw) == line
    assert b'"block_size":16' in encode_line(lines[0])


@pytest.mark.parametrize(
    "raw",
    [
        '{"type": "batch", "seq": 1, "events": [{"type": "stored", "block_hashes": ["AB"], '
        '"parent_block_hash": null, "medium": "gpu"}]}',  # not lowercase hex of 16 bytes
        '{"type": "batch", "seq": 1, "events": [{"type": "removed", "block_hashes": [], '
        '"medium": "disk"}]}',
        '{"type": "heartbeat", "seq": -1}',
        '{"type": "snapshot", "seq": 0, "blocks": {}}',  # no engine_id
        '{"type": "batch", "seq": 1, "events": [{"type": "cleared", "token_ids": [1]}]}',
        '{"type": "gossip"}',
    ],
)
def test_what_is_not_a_line_is_refused(raw: str) -> None:
    with pytest.raises(ValidationError):
        parse_line(raw)
