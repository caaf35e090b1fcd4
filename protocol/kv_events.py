"""PROVISIONAL copy of the issue-41 contract (kv-events builds the real one): the wire format of
an engine's GET /kv_events stream, one JSON object per line."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

Medium = Literal["gpu", "cpu"]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SnapshotBlocks(_Model):
    gpu: list[str] = []
    cpu: list[str] = []


class Snapshot(_Model):
    type: Literal["snapshot"] = "snapshot"
    engine_id: str
    seq: int
    block_size: int = 16
    blocks: SnapshotBlocks


class BlockStored(_Model):
    type: Literal["stored"] = "stored"
    block_hashes: list[str]
    parent_block_hash: str | None = None
    medium: Medium = "gpu"
    lora_name: str | None = None


class BlockRemoved(_Model):
    type: Literal["removed"] = "removed"
    block_hashes: list[str]
    medium: Medium = "gpu"


class AllBlocksCleared(_Model):
    type: Literal["cleared"] = "cleared"


KvEvent = Annotated[BlockStored | BlockRemoved | AllBlocksCleared, Field(discriminator="type")]


class EventBatch(_Model):
    type: Literal["batch"] = "batch"
    seq: int
    events: list[KvEvent]


class Heartbeat(_Model):
    type: Literal["heartbeat"] = "heartbeat"
    seq: int


StreamLine = Annotated[Snapshot | EventBatch | Heartbeat, Field(discriminator="type")]
STREAM_LINE: TypeAdapter[Snapshot | EventBatch | Heartbeat] = TypeAdapter(StreamLine)
KV_EVENTS_PATH = "/kv_events"
