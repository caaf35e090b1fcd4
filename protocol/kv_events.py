"""The wire format of an engine's KV events (``GET /kv_events``): which prefix-cache blocks the
engine holds, as a stream a router subscribes to (vLLM's KV-events shape: chained block hashes,
the parent's hash, the medium; never token ids, which are tenants' prompts).

The stream is newline-delimited JSON (``application/x-ndjson``), one :data:`StreamLine` a line:
a :class:`Snapshot` first (every block held now), then :class:`EventBatch` lines whose ``seq``
counts up by one from the snapshot's, and a :class:`Heartbeat` (the last ``seq`` again) when
nothing else was sent for :data:`HEARTBEAT_SECONDS`. A subscriber applies the events in order to
the snapshot's sets and has the engine's picture exactly; on a gap in ``seq``, a new
``engine_id``, a silent or closed stream it connects again and starts from a new snapshot.

Block hashes travel as lowercase hex of :mod:`kvfleet.protocol.block_hash`'s bytes.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, TypeAdapter

from kvfleet.protocol.block_hash import BLOCK_SIZE

PATH = "/kv_events"
CONTENT_TYPE = "application/x-ndjson"
# The engine sends a line at least this often; a subscriber that hears nothing for a few of
# these takes the stream for dead.
HEARTBEAT_SECONDS = 1.0

Medium = Literal["gpu", "cpu"]
MEDIA: tuple[Medium, ...] = ("gpu", "cpu")

# A block hash on the wire: 16 bytes as lowercase hex.
HexHash = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{32}$")]


def hash_hex(block_hash: bytes) -> str:
    return block_hash.hex()


class _Line(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class BlockStored(_Line):
    """Blocks that entered the cache on `medium`: a chain, each the child of the one before, the
    first the child of `parent_block_hash` (None: the first block of a prompt)."""

    type: Literal["stored"] = "stored"
    block_hashes: list[HexHash]
    parent_block_hash: HexHash | None
    medium: Medium
    # The LoRA adapter whose KV the blocks hold (their hashes carry its extra key), else None.
    lora_name: str | None = None


class BlockRemoved(_Line):
    """Blocks that left the cache on `medium` (evicted, or their adapter unloaded)."""

    type: Literal["removed"] = "removed"
    block_hashes: list[HexHash]
    medium: Medium


class AllBlocksCleared(_Line):
    """Every medium emptied (reset_prefix_cache)."""

    type: Literal["cleared"] = "cleared"


KVEvent = Annotated[BlockStored | BlockRemoved | AllBlocksCleared, Field(discriminator="type")]


class SnapshotBlocks(_Line):
    gpu: list[HexHash] = []
    cpu: list[HexHash] = []


class Snapshot(_Line):
    """Every block the engine holds as the subscription starts. `engine_id` is new each time an
    engine process starts: the same address with a new id is a new cache."""

    type: Literal["snapshot"] = "snapshot"
    engine_id: str = Field(min_length=1)
    seq: int = Field(ge=0)
    block_size: int = BLOCK_SIZE
    blocks: SnapshotBlocks


class EventBatch(_Line):
    """The events of one engine step, in order; `seq` is the previous line's plus one."""

    type: Literal["batch"] = "batch"
    seq: int = Field(ge=0)
    events: list[KVEvent]


class Heartbeat(_Line):
    """Nothing happened; `seq` is the last line's (a heartbeat does not advance it)."""

    type: Literal["heartbeat"] = "heartbeat"
    seq: int = Field(ge=0)


StreamLine = Annotated[Snapshot | EventBatch | Heartbeat, Field(discriminator="type")]
_STREAM_LINE: TypeAdapter[Snapshot | EventBatch | Heartbeat] = TypeAdapter(StreamLine)


def parse_line(line: bytes | str) -> Snapshot | EventBatch | Heartbeat:
    """One line of the stream, validated (pydantic.ValidationError if it is not one)."""
    return _STREAM_LINE.validate_json(line)


def encode_line(line: Snapshot | EventBatch | Heartbeat) -> bytes:
    return line.model_dump_json().encode() + b"\n"
