"""Which LoRA adapters the engine holds where: max_loras GPU slots and max_cpu_loras host copies,
each tier least-recently-used first out. An adapter is read into host memory before any request
of it is scheduled, and its copy stays while a request of it waits or runs; it is pinned in its
GPU slot while a scheduled or running request uses it. Pure decision logic: the engine core reads
the adapters it decides to host, the runner does the slot copies (SlotChanges), the scheduler
asks before it starts a request.

An adapter in a GPU slot keeps its host copy (slots are filled from host memory), so the host
tier holds at least the slots' adapters: max_cpu_loras >= max_loras."""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass, field

from kvfleet.engine.lora_request import LoRARequest


@dataclass
class SlotChanges:
    """What the runner copies before the step that uses it: adapters into GPU slots, from their
    host copy."""

    loads: list[tuple[int, LoRARequest]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.loads)


@dataclass
class SlotStats:
    loads: Counter[str] = field(default_factory=Counter)  # into a GPU slot, by adapter name
    evictions: Counter[str] = field(default_factory=Counter)  # out of a GPU slot
    disk_reads: Counter[str] = field(default_factory=Counter)  # into host memory


class AdapterSlots:
    def __init__(self, max_loras: int, max_cpu_loras: int) -> None:
        if max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, not {max_loras}")
        if max_cpu_loras < max_loras:
            raise ValueError(
                f"max_cpu_loras ({max_cpu_loras}) must be >= max_loras ({max_loras}): an adapter "
                "in a GPU slot keeps its copy in host memory"
            )
        self.max_loras = max_loras
        self.max_cpu_loras = max_cpu_loras
        # lora_int_id -> slot, least recently used first.
        self.gpu: OrderedDict[int, int] = OrderedDict()
        # lora_int_id -> the adapter, least recently used first.
        self.cpu: OrderedDict[int, LoRARequest] = OrderedDict()
        # Running requests per adapter (its slot's pins); requests in the engine, waiting or
        # running, per adapter (its host copy's).
        self.pins: Counter[int] = Counter()
        self.users: Counter[int] = Counter()
        self.free_slots = list(range(max_loras - 1, -1, -1))
        self.changes = SlotChanges()
        self.stats = SlotStats()

    def slot_of(self, lora: LoRARequest | None) -> int:
        """The adapter's GPU slot; -1 for the base model (or an adapter not in a slot)."""
        if lora is None:
            return -1
        return self.gpu.get(lora.lora_int_id, -1)

    def add_user(self, lora: LoRARequest) -> None:
        """A request of the adapter entered the engine: its host copy stays until it leaves."""
        self.users[lora.lora_int_id] += 1

    def drop_user(self, lora: LoRARequest) -> None:
        """A request of the adapter left the engine (finished, aborted or failed)."""
        key = lora.lora_int_id
        if self.users[key] <= 0:
            raise ValueError(f"adapter {lora.lora_name} has no request in the engine")
        self.users[key] -= 1
        if not self.users[key]:
            del self.users[key]

    def is_hosted(self, lora: LoRARequest) -> bool:
        return lora.lora_int_id in self.cpu

    def make_room(self, starved: bool = False) -> list[int] | None:
        """Room in host memory for one more adapter: the lora_int_ids of the copies dropped for
        it, least recently used first among those no request in the engine uses (one out of a
        GPU slot last: its slot goes with it). None when every copy is in use: the new adapter
        waits for the requests of one to end, rather than take a copy a step may need.
        `starved`: room for the adapter of a request waited past the scheduler's bound; when
        every copy is in use, one that only waiting requests use goes too (they read it again
        when they can start), so that a stream of them cannot keep it out."""
        dropped: list[int] = []
        while len(self.cpu) >= self.max_cpu_loras:
            unused = [k for k in self.cpu if not self.users[k]]
            if not unused and starved:
                unused = [k for k in self.cpu if not self.pins[k]]
            if not unused:
                return None
            victim = next((k for k in unused if k not in self.gpu), unused[0])
            slot = self.gpu.pop(victim, None)
            if slot is not None:
                self.free_slots.append(slot)
                self.stats.evictions[self.cpu[victim].lora_name] += 1
            del self.cpu[victim]
            dropped.append(victim)
        return dropped

    def host(self, lora: LoRARequest) -> None:
        """The adapter was read into host memory (make_room first)."""
        if len(self.cpu) >= self.max_cpu_loras:
            raise ValueError("no room in host memory for another LoRA adapter")
        self.cpu[lora.lora_int_id] = lora
        self.stats.disk_reads[lora.lora_name] += 1

    def can_acquire(self, lora: LoRARequest) -> bool:
        """Whether acquire would find the adapter a slot now: it is in host memory and has a
        slot, one is free, or an adapter no request uses can give its slot up."""
        return lora.lora_int_id in self.cpu and (
            lora.lora_int_id in self.gpu
            or bool(self.free_slots)
            or any(self.pins[i] == 0 for i in self.gpu)
        )

    def acquire(self, lora: LoRARequest) -> int:
        """Pin the adapter in a GPU slot for one request (released by release()), loading it
        into a free slot or the least recently used one no request uses. Ask can_acquire
        first: ValueError when the adapter is not in host memory or every slot is pinned by
        other adapters."""
        key = lora.lora_int_id
        if key not in self.cpu:
            raise ValueError(f"adapter {lora.lora_name} is not in host memory")
        slot = self.gpu.get(key)
        if slot is None:
            slot = self._take_slot()
            self.gpu[key] = slot
            self.changes.loads.append((slot, lora))
            self.stats.loads[lora.lora_name] += 1
        self.gpu.move_to_end(key)
        self.cpu.move_to_end(key)
        self.pins[key] += 1
        return slot

    def release(self, lora: LoRARequest) -> None:
        """One request of the adapter no longer runs (finished or preempted)."""
        key = lora.lora_int_id
        if self.pins[key] <= 0:
            raise ValueError(f"adapter {lora.lora_name} is not pinned")
        self.pins[key] -= 1
        if not self.pins[key]:
            del self.pins[key]

    def _take_slot(self) -> int:
        if self.free_slots:
            return self.free_slots.pop()
        for key, slot in self.gpu.items():
            if not self.pins[key]:
                del self.gpu[key]
                self.stats.evictions[self.cpu[key].lora_name] += 1
                return slot
        raise ValueError("every LoRA slot is pinned by a running request")

    def remove(self, lora: LoRARequest) -> bool:
        """Forget an unloaded adapter (no request of it may be queued): its slot frees and its
        host copy goes (the caller drops it). False if it was held nowhere."""
        key = lora.lora_int_id
        if self.users[key]:
            raise ValueError(f"adapter {lora.lora_name} is in use by a request")
        for counts in (self.stats.loads, self.stats.evictions, self.stats.disk_reads):
            counts.pop(lora.lora_name, None)
        slot = self.gpu.pop(key, None)
        if slot is not None:
            self.free_slots.append(slot)
        return self.cpu.pop(key, None) is not None or slot is not None

    def take_changes(self) -> SlotChanges:
        """The copies decided since the last call, for the runner to make before the step."""
        changes, self.changes = self.changes, SlotChanges()
        return changes

    def resident(self) -> dict[str, str]:
        """Adapter name -> the tier holding it ("gpu" or "cpu")."""
        return {
            lora.lora_name: "gpu" if key in self.gpu else "cpu" for key, lora in self.cpu.items()
        }
