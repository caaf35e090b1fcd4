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
class HostEntry:
    block_hash: bytes
    slot: int
    ticket: int  # the store copy that fills the slot
    # What the KV events say of the block: its parent's hash, its adapter's name; and the
    # adapter's id, which a lookup must match (an adapter loaded again under its name is
    # another one).
    parent_hash: bytes | None
    lora_id: int
    lora_name: str | None
    ready: bool = False
    pins: int = 0
    # Its adapter was unloaded while a copy back read it: dropped once unpinned.
    doomed: bool = False


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
        self._entries: OrderedDict[bytes, HostEntry] = OrderedDict()
        self._by_ticket: dict[int, bytes] = {}
        self._next_ticket = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._entries

    def hashes(self) -> list[bytes]:
        return list(self._entries)

    def ready_hashes(self) -> list[bytes]:
        """The blocks that can be served (those whose copy completed)."""
        return [h for h, e in self._entries.items() if e.ready and not e.doomed]

    def lookup(self, block_hash: bytes, lora_id: int = 0) -> int | None:
        """The slot holding this block of this adapter (0: the base model), if its copy has
        completed."""
        entry = self._entries.get(block_hash)
        if entry is None or not entry.ready or entry.doomed or entry.lora_id != lora_id:
            return None
        return entry.slot

    def place(
        self,
        block_hash: bytes,
        parent_hash: bytes | None = None,
        lora_id: int = 0,
        lora_name: str | None = None,
    ) -> Placement | None:
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
        self._entries[block_hash] = HostEntry(
            block_hash, slot, ticket, parent_hash, lora_id, lora_name
        )
        self._by_ticket[ticket] = block_hash
        return Placement(slot, ticket, dropped)

    def stored(self, ticket: int) -> HostEntry | None:
        """The store copy `ticket` completed: its block becomes servable. Returns its entry, or
        None when the entry was dropped meanwhile (a reset, its adapter unloaded)."""
        block_hash = self._by_ticket.pop(ticket, None)
        if block_hash is None:
            return None
        entry = self._entries[block_hash]
        entry.ready = True
        return entry

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

    def unpin(self, block_hash: bytes, *, drop: bool = False) -> bool:
        """Release a pin; `drop`: the copy back failed, so the entry, once no other copy reads
        it, is not trusted again. True when that dropped a block that could be served."""
        entry = self._entries[block_hash]
        entry.pins -= 1
        if entry.pins or not (drop or entry.doomed):
            return False
        del self._entries[block_hash]
        self._free.append(entry.slot)
        return not entry.doomed

    def drop_adapter(self, lora_id: int) -> list[bytes]:
        """Forget an unloaded adapter's blocks (one being read by a copy back once that is
        done). Returns the hashes of those that could be served."""
        dropped = []
        for block_hash, entry in list(self._entries.items()):
            if entry.lora_id != lora_id or entry.doomed:
                continue
            if entry.ready:
                dropped.append(block_hash)
            if entry.pins:
                entry.doomed = True
                continue
            del self._entries[block_hash]
            self._by_ticket.pop(entry.ticket, None)
            self._free.append(entry.slot)
        return dropped

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
