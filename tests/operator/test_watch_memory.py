"""The operator's memory of watched objects (operator/watch_memory.py): which events need a
reconcile, and which objects a relist found gone."""

from __future__ import annotations

from kvfleet.operator.watch_memory import WatchMemory

PODS_A = ("pods", "team-a")
PODS_B = ("pods", "team-b")
OWNER = ("team-a", "llama")


def test_only_a_new_resource_version_is_a_change():
    memory = WatchMemory()
    first = memory.observe(PODS_A, "p1", OWNER, "ADDED", "10")
    assert first.changed and not first.relisting
    assert memory.observe(PODS_A, "p1", OWNER, "MODIFIED", "11").changed
    # The same object again: a relist (kopf's listing events have no type, a replaying watch
    # says ADDED).
    for event_type in (None, "ADDED"):
        again = memory.observe(PODS_A, "p1", OWNER, event_type, "11")
        assert not again.changed and again.relisting
    # No resourceVersion: nothing to compare, so always a change.
    assert memory.observe(PODS_A, "p2", OWNER, "ADDED", None).changed
    assert memory.observe(PODS_A, "p2", OWNER, "ADDED", None).changed


def test_a_deleted_object_is_forgotten():
    memory = WatchMemory()
    memory.observe(PODS_A, "p1", OWNER, "ADDED", "10")
    memory.forget(PODS_A, "p1")
    assert len(memory) == 0
    # Created again under its name (a StatefulSet's pod would be): a change.
    assert memory.observe(PODS_A, "p1", OWNER, "ADDED", "10").changed


def test_content_decides_a_change_and_the_resource_version_a_relist():
    """An InferenceService's own status writes move its resourceVersion but not what a
    reconcile acts on."""
    memory = WatchMemory()
    isvcs = ("inferenceservices", "team-a")
    memory.observe(isvcs, "llama", OWNER, None, "5", content=("spec", 1))
    status_write = memory.observe(isvcs, "llama", OWNER, "MODIFIED", "6", content=("spec", 1))
    assert not status_write.changed and not status_write.relisting
    assert memory.observe(isvcs, "llama", OWNER, "MODIFIED", "7", content=("spec", 2)).changed


def test_a_relist_finds_the_objects_it_did_not_bring_gone():
    memory = WatchMemory()
    other = ("team-a", "qwen")
    for name, owner in (("p1", OWNER), ("p2", OWNER), ("q1", other)):
        memory.observe(PODS_A, name, owner, "ADDED", "1")
    memory.observe(PODS_B, "b1", ("team-b", "x"), "ADDED", "1")
    assert memory.end_relist(PODS_A) == set()  # no relist under way

    # A relist brings p1 unchanged and q1 changed; p2 was deleted while no watch was open.
    assert memory.observe(PODS_A, "p1", OWNER, None, "1").relisting
    assert memory.observe(PODS_A, "q1", other, None, "2").changed
    assert memory.end_relist(PODS_A) == {OWNER}
    assert len(memory) == 3  # p1, q1, and b1 of a namespace not relisted
    assert memory.end_relist(PODS_A) == set()

    # The next relist brings only what is there; a live event counts as brought.
    memory.observe(PODS_A, "p1", OWNER, None, "1")
    memory.observe(PODS_A, "q1", other, "MODIFIED", "3")
    assert memory.end_relist(PODS_A) == set()
    assert memory.end_relist(PODS_B) == set()


def test_an_object_late_for_its_relist_costs_reconciles_not_a_miss():
    """A relist's event after its end cannot be told from the first of the next relist: the
    objects brought before count as not brought again, which reconciles their owners once
    more, and the late one is new again."""
    memory = WatchMemory()
    memory.observe(PODS_A, "p1", OWNER, "ADDED", "1")
    memory.observe(PODS_A, "q1", ("team-a", "qwen"), "ADDED", "1")
    memory.observe(PODS_A, "p1", OWNER, None, "1")
    assert memory.end_relist(PODS_A) == {("team-a", "qwen")}  # q1's event had not come yet
    late = memory.observe(PODS_A, "q1", ("team-a", "qwen"), None, "1")
    assert late.changed and late.relisting
    assert memory.end_relist(PODS_A) == {OWNER}
    assert memory.observe(PODS_A, "p1", OWNER, "MODIFIED", "2").changed


def test_the_memory_holds_only_live_objects():
    memory = WatchMemory()
    for i in range(100):
        memory.observe(PODS_A, f"p{i}", OWNER, "ADDED", str(i))
    for i in range(50):
        memory.forget(PODS_A, f"p{i}")
    memory.observe(PODS_A, "p99", OWNER, None, "99")
    memory.end_relist(PODS_A)
    assert len(memory) == 1
    memory.forget(PODS_A, "p99")
    assert len(memory) == 0 and not memory._objects and not memory._epoch
