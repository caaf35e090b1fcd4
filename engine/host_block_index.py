"""Which prefix-cache blocks the host tier keeps: a fixed number of host slots, each holding the
KV of one full block by its chained hash, least recently used first out. Pure bookkeeping (no
tensors): the model runner does the copies the decisions here ask for.

An entry is servable only once the copy that filled it is known to be complete (`stored`), and
a slot that a copy back to the device reads (`pin`) is never handed to another block until it
is unpinned, so a load never reads a slot being overwritten."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(slots=True)
class _Entry:
    slot: int
    ticket: int  # the store copy that fills the slot
    ready: bool = False
    pins: int = 0


@dataclass(frozen=True, slots=True)
class Placement:
    """Where to copy an evicted device block: its host slot, the store's ticket (the runner
    reports it done), and the blocks dropped from the host tier to make room."""

    slot: int
    ticket: int
    dropped: tuple[bytes, ...]


class HostBlockIndex:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"the host KV tier needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))
        # Hash -> entry, least recently stored or used first.
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()
        self._by_ticket: dict[int, bytes] = {}
        self._next_ticket = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._entries

    def hashes(self) -> list[bytes]:
        return list(self._entries)

    def lookup(self, block_hash: bytes) -> int | None:
        """The slot holding this block, if its copy has completed."""
        entry = self._entries.get(block_hash)
        return entry.slot if entry is not None and entry.ready else None

    def place(self, block_hash: bytes) -> Placement | None:
        """A slot for a block the device evicts, taking the least recently used unpinned, ready
        entry's slot when none is free. None when the block is held already (it is marked used)
        or every slot is pinned or still being filled: the block is then not kept."""
        entry = self._entries.get(block_hash)
        if entry is not None:
            self._entries.move_to_end(block_hash)
            return None
        dropped: tuple[bytes, ...] = ()
        if self._free:
            slot = self._free.pop()
        else:
            victim = next((h for h, e in self._entries.items() if e.ready and e.pins == 0), None)
            if victim is None:
                return None
            slot = self._entries.pop(victim).slot
            dropped = (victim,)
        ticket = self._next_ticket
        self._next_ticket += 1
        self._entries[block_hash] = _Entry(slot, ticket)
        self._by_ticket[ticket] = block_hash
        return Placement(slot, ticket, dropped)

    def stored(self, ticket: int) -> bytes | None:
        """The store copy `ticket` completed: its block becomes servable. Returns its hash, or
        None when the entry was dropped meanwhile (a reset)."""
        block_hash = self._by_ticket.pop(ticket, None)
        if block_hash is None:
            return None
        entry = self._entries[block_hash]
        entry.ready = True
        return block_hash

    def store_failed(self, ticket: int) -> bytes | None:
        """The store copy `ticket` failed: the entry is dropped and its slot freed."""
        block_hash = self._by_ticket.pop(ticket, None)
        if block_hash is None:
            return None
        self._free.append(self._entries.pop(block_hash).slot)
        return block_hash

    def pin(self, block_hash: bytes) -> int:
        """Hold a ready entry's slot for a copy back to the device, marking it used."""
        entry = self._entries[block_hash]
        if not entry.ready:
            raise ValueError("a host block is pinned before its copy completed")
        entry.pins += 1
        self._entries.move_to_end(block_hash)
        return entry.slot

    def unpin(self, block_hash: bytes, *, drop: bool = False) -> None:
        """Release a pin; `drop`: the copy back failed, so the entry, once no other copy reads
        it, is not trusted again."""
        entry = self._entries[block_hash]
        entry.pins -= 1
        if drop and entry.pins == 0:
            del self._entries[block_hash]
            self._free.append(entry.slot)

    @property
    def pinned(self) -> bool:
        return any(e.pins for e in self._entries.values())

    def clear(self) -> list[bytes]:
        """Forget every entry (none may be pinned); returns the hashes dropped. A store still in
        flight into a freed slot is ordered before any later copy of that slot by the runner's
        stream, and its completion is ignored."""
        if self.pinned:
            raise ValueError("the host KV tier is cleared while a copy back reads it")
        dropped = list(self._entries)
        self._entries.clear()
        self._by_ticket.clear()
        self._free = list(range(self.num_slots - 1, -1, -1))
        return dropped
