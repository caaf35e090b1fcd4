"""The copies between the device KV cache and its host tier that one step runs, as the KV cache
manager decides them and every rank's runner carries them out; and what rank 0 reports done.
Plain data (no torch): the scheduler's side builds it, the step plan carries it."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class KVTransfers:
    """The copies to run before a step, in this order: stores (device block id, host slot,
    ticket), then waits for the loads whose blocks the step may use (load ids), then loads
    (load id, host slots, device block ids)."""

    stores: list[tuple[int, int, int]] = field(default_factory=list)
    loads_ready: list[int] = field(default_factory=list)
    loads: list[tuple[int, list[int], list[int]]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.stores or self.loads_ready or self.loads)


@dataclass(slots=True)
class TransfersDone:
    """What rank 0 found complete since the last call: store tickets (of copies done, and of
    copies that failed), and loads with whether each succeeded."""

    stored: list[int] = field(default_factory=list)
    store_failed: list[int] = field(default_factory=list)
    loaded: list[tuple[int, bool]] = field(default_factory=list)
