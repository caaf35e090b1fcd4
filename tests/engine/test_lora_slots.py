"""The LoRA slot manager's decisions alone: least-recently-used eviction that never takes a slot
a running request holds, the host tier's LRU that never drops an adapter in a slot, and the
changes the runner is told to make."""

from __future__ import annotations

import pytest

from kvfleet.engine.lora_request import LoRARequest
from kvfleet.engine.lora_slots import AdapterSlots

A, B, C = (LoRARequest(name, i, f"/adapters/{name}") for i, name in enumerate("abc", 1))


def test_a_pinned_slot_is_never_evicted_and_waiting_is_said_first():
    slots = AdapterSlots(max_loras=1, max_cpu_loras=2)
    assert slots.acquire(A) == 0
    assert slots.take_changes().loads == [(0, A)]
    assert not slots.can_acquire(B)  # A's request still runs
    with pytest.raises(ValueError, match="pinned"):
        slots.acquire(B)
    assert slots.can_acquire(A) and slots.acquire(A) == 0  # a second request of A shares it
    assert not slots.take_changes()  # nothing to copy
    slots.release(A)
    slots.release(A)
    assert slots.acquire(B) == 0
    assert slots.take_changes().loads == [(0, B)]
    assert slots.stats.evictions == {"a": 1}
    assert slots.resident() == {"a": "cpu", "b": "gpu"}


def test_the_least_recently_used_unpinned_slot_goes_first():
    slots = AdapterSlots(max_loras=2, max_cpu_loras=3)
    for lora in (A, B):
        slots.acquire(lora)
        slots.release(lora)
    slots.acquire(A)  # A is now the most recent, and pinned
    slots.release(A)
    assert slots.acquire(C) == slots.slot_of(C) == 1  # B's slot
    assert slots.slot_of(B) == -1 and slots.slot_of(A) == 0


def test_the_host_tier_drops_its_least_recent_adapter_not_in_a_slot():
    slots = AdapterSlots(max_loras=1, max_cpu_loras=2)
    for lora in (A, B, C):
        slots.acquire(lora)
        slots.release(lora)
    changes = slots.take_changes()
    assert changes.dropped == [A.lora_int_id]
    assert [lora for _, lora in changes.loads] == [A, B, C]
    assert slots.resident() == {"b": "cpu", "c": "gpu"}
    assert slots.stats.disk_reads == {"a": 1, "b": 1, "c": 1}
    slots.acquire(A)  # from disk again
    assert slots.stats.disk_reads["a"] == 2


def test_remove_frees_the_slot_of_an_unused_adapter():
    slots = AdapterSlots(max_loras=1, max_cpu_loras=1)
    slots.acquire(A)
    with pytest.raises(ValueError, match="in use"):
        slots.remove(A)
    slots.release(A)
    assert slots.remove(A)
    assert slots.free_slots == [0] and not slots.cpu
    assert not slots.remove(A)


def test_the_host_tier_must_hold_the_slots():
    with pytest.raises(ValueError, match="max_cpu_loras"):
        AdapterSlots(max_loras=2, max_cpu_loras=1)
