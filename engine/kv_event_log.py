"""What the prefix cache gained and lost since the engine last published it (KV events), kept
only while someone subscribes: the block pool writes to it on the engine thread, and the engine
drains it after each step into one batch of the stream (kvfleet.protocol.kv_events).

Consecutive blocks of one chain stored together become one `stored` event (its parent the block
before the first), consecutive removals one `removed` event: a long prompt's prefill is one
event, not one per block."""

from __future__ import annotations

from kvfleet.protocol.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    Medium,
)


class KVEventLog:
    def __init__(self) -> None:
        # Off until a subscriber comes: then the pool pays a hex string per block it caches or
        # evicts, and nothing before.
        self.enabled = False
        self._events: list[KVEvent] = []
        # The hash (bytes) of the last block of the last event when it is a `stored` one, which
        # the next stored block extends if it is that block's child.
        self._chain_end: bytes | None = None

    def stored(
        self, block_hash: bytes, parent_hash: bytes | None, lora_name: str | None, medium: Medium
    ) -> None:
        last = self._events[-1] if self._events else None
        if (
            isinstance(last, BlockStored)
            and parent_hash is not None
            and parent_hash == self._chain_end
            and last.lora_name == lora_name
            and last.medium == medium
        ):
            last.block_hashes.append(block_hash.hex())
        else:
            self._events.append(
                BlockStored.model_construct(
                    block_hashes=[block_hash.hex()],
                    parent_block_hash=None if parent_hash is None else parent_hash.hex(),
                    medium=medium,
                    lora_name=lora_name,
                )
            )
        self._chain_end = block_hash

    def removed(self, block_hash: bytes, medium: Medium) -> None:
        last = self._events[-1] if self._events else None
        if isinstance(last, BlockRemoved) and last.medium == medium:
            last.block_hashes.append(block_hash.hex())
        else:
            self._events.append(
                BlockRemoved.model_construct(block_hashes=[block_hash.hex()], medium=medium)
            )
        self._chain_end = None

    def cleared(self) -> None:
        # Whatever came before is moot: the subscriber empties its picture either way.
        self._events = [AllBlocksCleared()]
        self._chain_end = None

    def drain(self) -> list[KVEvent]:
        events, self._events = self._events, []
        self._chain_end = None
        return events

    def stop(self) -> None:
        """No subscriber left: record nothing more, and drop what no one will read."""
        self.enabled = False
        self.drain()
