"""The LoRA slot manager's decisions alone: least-recently-used eviction that never takes a slot
a running request holds, the host tier's LRU that never drops the copy of an adapter a request
in the engine uses (a further adapter waits instead), and the changes the runner is told to
make."""

from __future__ import annotations

import pytest

from kvfleet.engine.lora_request import LoRARequest
from kvfleet.engine.lora_slots import AdapterSlots

A, B, C = (LoRARequest(name, i, f"/adapters/{name}") for i, name in enumerate("abc", 1))


def _hosted(slots: AdapterSlots, *loras: LoRARequest) -> list[int]:
    """Read each adapter into host memory as the engine core does; the ids dropped for them."""
    dropped = []
    for lora in loras:
        room = slots.make_room()
        assert room is not None
        dropped += room
        slots.host(lora)
    return dropped


def test_a_pinned_slot_is_never_evicted_and_waiting_is_said_first():
    slots = AdapterSlots(max_loras=1, max_cpu_loras=2)
    assert not slots.can_acquire(A)  # not in host memory yet
    with pytest.raises(ValueError, match="host memory"):
        slots.acquire(A)
    _hosted(slots, A, B)
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
    _hosted(slots, A, B, C)
    for lora in (A, B):
        slots.acquire(lora)
        slots.release(lora)
    slots.acquire(A)  # A is now the most recent, and pinned
    slots.release(A)
    assert slots.acquire(C) == slots.slot_of(C) == 1  # B's slot
    assert slots.slot_of(B) == -1 and slots.slot_of(A) == 0


def test_the_host_tier_keeps_the_copies_of_adapters_in_use():
    slots = AdapterSlots(max_loras=1, max_cpu_loras=2)
    _hosted(slots, A, B)
    slots.add_user(A)  # a request of A waits, of B runs
    slots.add_user(B)
    slots.acquire(B)
    assert slots.make_room() is None  # C waits: no copy is free to go
    slots.release(B)
    slots.drop_user(B)
    # B, unused, goes, with its slot; A's copy stays for its waiting request.
    assert _hosted(slots, C) == [B.lora_int_id]
    assert slots.slot_of(B) == -1 and slots.free_slots == [0]
    assert slots.stats.evictions == {"b": 1}
    slots.drop_user(A)
    assert _hosted(slots, B) == [A.lora_int_id]  # the least recent unused one
    assert slots.resident() == {"b": "cpu", "c": "cpu"}
    assert slots.stats.disk_reads == {"a": 1, "b": 2, "c": 1}
    with pytest.raises(ValueError, match="no request"):
        slots.drop_user(A)


def test_the_host_tier_drops_an_adapter_in_a_slot_last():
    slots = AdapterSlots(max_loras=1, max_cpu_loras=2)
    _hosted(slots, A)
    slots.acquire(A)
    slots.release(A)
    _hosted(slots, B)
    assert _hosted(slots, C) == [B.lora_int_id]  # A is older, but in the slot
    assert slots.slot_of(A) == 0


def test_remove_frees_the_slot_of_an_unused_adapter():
    slots = AdapterSlots(max_loras=1, max_cpu_loras=1)
    _hosted(slots, A)
    slots.add_user(A)
    slots.acquire(A)
    with pytest.raises(ValueError, match="in use"):
        slots.remove(A)
    slots.release(A)
    slots.drop_user(A)
    assert slots.remove(A)
    assert slots.free_slots == [0] and not slots.cpu
    assert not slots.remove(A)


def test_the_host_tier_must_hold_the_slots():
    with pytest.raises(ValueError, match="max_cpu_loras"):
        AdapterSlots(max_loras=2, max_cpu_loras=1)


def test_a_starved_adapter_takes_a_copy_only_waiting_requests_use():
    slots = AdapterSlots(max_loras=1, max_cpu_loras=1)
    _hosted(slots, A)
    slots.add_user(A)
    slots.acquire(A)  # A's request runs
    assert slots.make_room() is None
    assert slots.make_room(starved=True) is None  # a running request's copy never goes
    slots.release(A)  # preempted: it waits again
    assert slots.make_room() is None
    assert slots.make_room(starved=True) == [A.lora_int_id]
    assert slots.free_slots == [0] and not slots.cpu and slots.users[A.lora_int_id] == 1
