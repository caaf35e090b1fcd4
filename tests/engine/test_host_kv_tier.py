"""The host tier of the prefix cache: which blocks it keeps (HostBlockIndex), and through the
whole engine on the CPU, blocks evicted from a device cache too small for the prompts come back
from host memory instead of being computed again, with the same tokens."""

from __future__ import annotations

import pytest

from kvfleet.engine import LLM, SamplingParams
from kvfleet.engine.engine_core import EngineCore
from kvfleet.engine.host_block_index import HostBlockIndex
from kvfleet.protocol.kv_events import BlockRemoved, BlockStored
from tests.support.engine import assert_no_leak


def _h(i: int) -> bytes:
    return i.to_bytes(16, "little")


def _stored(index: HostBlockIndex, *hashes: bytes) -> None:
    for h in hashes:
        placement = index.place(h)
        assert placement is not None
        index.stored(placement.ticket)


def test_the_least_recently_used_ready_unpinned_block_gives_its_slot() -> None:
    index = HostBlockIndex(3)
    _stored(index, _h(1), _h(2), _h(3))
    assert index.place(_h(1)) is None  # held already: marked used, 2 is now the oldest
    slot = index.pin(_h(2))  # a copy back reads it: not given away
    placement = index.place(_h(4))
    assert placement is not None and placement.dropped == (_h(3),)
    assert index.hashes() == [_h(1), _h(2), _h(4)]
    # 4's copy is still running: not served, and its slot not given away either; 1 goes next.
    assert index.lookup(_h(4)) is None
    nxt = index.place(_h(5))
    assert nxt is not None and nxt.dropped == (_h(1),)
    assert index.place(_h(6)) is None  # 2 pinned, 4 and 5 still being filled: 6 is not kept
    index.unpin(_h(2))
    index.stored(placement.ticket)
    assert index.lookup(_h(4)) == placement.slot
    again = index.place(_h(6))
    assert again is not None and again.dropped == (_h(2),) and again.slot == slot
    assert len(index) == 3


def test_a_failed_copy_back_drops_the_block_and_a_reset_ignores_stale_copies() -> None:
    index = HostBlockIndex(2)
    _stored(index, _h(1))
    index.pin(_h(1))
    index.unpin(_h(1), drop=True)
    assert _h(1) not in index and index.lookup(_h(1)) is None
    pending = index.place(_h(2))
    assert pending is not None
    with pytest.raises(ValueError):
        index.pin(_h(2))  # not servable before its copy completes
    _stored(index, _h(3))
    index.pin(_h(3))
    with pytest.raises(ValueError):
        index.clear()
    index.unpin(_h(3))
    assert sorted(index.clear()) == [_h(2), _h(3)]
    assert index.stored(pending.ticket) is None  # the copy of a dropped entry: ignored
    assert len(index) == 0 and index.lookup(_h(2)) is None


def test_an_adapters_blocks_serve_only_it_and_leave_when_it_is_unloaded() -> None:
    index = HostBlockIndex(4)
    for h, lora in ((_h(1), 0), (_h(2), 7), (_h(3), 7)):
        placement = index.place(h, None, lora, "sql" if lora else None)
        assert placement is not None
        index.stored(placement.ticket)
    pending = index.place(_h(4), None, 7, "sql")
    assert pending is not None
    assert index.lookup(_h(2)) is None and index.lookup(_h(2), 7) is not None
    slot = index.pin(_h(3))
    # Served blocks are reported gone; the one being copied back goes once unpinned.
    assert index.drop_adapter(7) == [_h(2), _h(3)]
    assert index.hashes() == [_h(1), _h(3)] and index.ready_hashes() == [_h(1)]
    assert index.lookup(_h(3), 7) is None and index.stored(pending.ticket) is None
    assert index.unpin(_h(3)) is False  # already reported
    assert index.hashes() == [_h(1)]
    placements = [index.place(_h(i)) for i in (5, 6, 7)]  # the freed slots, 3's among them
    assert slot in {p.slot for p in placements if p is not None} and all(placements)


# The device cache holds 19 blocks; 7 prompts of 4 full blocks each (a fifth, partial, holds the
# tail and the output), so a second pass finds the first prompts evicted from the device. The
# host tier holds them all.
DEVICE_BLOCKS = 20
HOST_BLOCKS = 40
PROMPT_LEN = 70
PARAMS = SamplingParams(temperature=0, max_tokens=6)


def _two_passes(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = []
    for _ in range(2):
        for p in prompts:  # one at a time: each one's blocks are freed before the next
            (out,) = llm.generate([{"prompt_token_ids": p}], PARAMS, use_tqdm=False)
            outs.append(list(out.outputs[0].token_ids))
    return outs


def _picture_matches(core: EngineCore, picture: dict[str, set[str]]) -> None:
    """Apply the KV events recorded since the last call to `picture` (each removal of a block
    published before), then check it is what the engine holds per medium."""
    for event in core.kv_event_log.drain():
        if isinstance(event, BlockStored):
            picture[event.medium].update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            assert set(event.block_hashes) <= picture[event.medium], event
            picture[event.medium].difference_update(event.block_hashes)
        else:
            picture["gpu"], picture["cpu"] = set(), set()
    gpu, cpu = core.cached_block_hashes()
    assert picture == {"gpu": {h.hex() for h in gpu}, "cpu": {h.hex() for h in cpu}}


@pytest.fixture(scope="module")
def working_set(prompts: list[list[int]]) -> list[list[int]]:
    base = [t for p in prompts for t in p]
    return [base[i * PROMPT_LEN : (i + 1) * PROMPT_LEN] for i in range(7)]


def test_prefixes_evicted_from_the_device_come_back_from_host_memory(
    model_dirs, working_set, monkeypatch
):
    path = str(model_dirs["llama"])
    args = {"dtype": "float32", "num_gpu_blocks_override": DEVICE_BLOCKS}
    plain = LLM(path, **args)
    want = _two_passes(plain, working_set)
    plain_stats = plain.engine.stats()
    block_bytes = plain.engine.runner.block_bytes

    tiered = LLM(path, cpu_kv_cache_bytes=HOST_BLOCKS * block_bytes + block_bytes - 1, **args)
    core = tiered.engine
    assert core.kv_cache_manager.host is not None
    assert core.kv_cache_manager.host.num_slots == HOST_BLOCKS
    core.kv_event_log.enabled = True  # as a subscriber to GET /kv_events does
    picture: dict[str, set[str]] = {"gpu": set(), "cpu": set()}
    assert _two_passes(tiered, working_set) == want
    _picture_matches(core, picture)
    assert picture["cpu"]  # blocks copied to host memory are published with medium "cpu"
    stats = core.stats()
    # The prompts differ: the first pass finds nothing. The second finds every full block of
    # every prompt in one tier or the other, where the device alone missed some.
    every_block = 7 * 4 * 16
    assert plain_stats.prefix_cache_hits < every_block
    assert stats.host_cache_hits > 0
    assert stats.prefix_cache_hits + stats.host_cache_hits == every_block
    assert stats.host_cache_queries == stats.prefix_cache_queries - stats.prefix_cache_hits
    assert 0 < stats.num_host_cache_blocks <= HOST_BLOCKS
    assert_no_leak(tiered)
    assert not core.scheduler.loading and not core.kv_cache_manager.loads

    assert core.reset_prefix_cache()
    assert core.stats().num_host_cache_blocks == 0 and core.stats().num_cached_blocks == 0
    _picture_matches(core, picture)
    tiered.generate([{"prompt_token_ids": working_set[0]}], PARAMS, use_tqdm=False)
    after = core.stats()  # found in neither tier
    assert (after.prefix_cache_hits, after.host_cache_hits) == (
        stats.prefix_cache_hits,
        stats.host_cache_hits,
    )

    # Copies back that fail: those tokens are computed instead, with the same result.
    host_kv = core.runner.host_kv
    assert host_kv is not None
    failed: list[int] = []

    def broken(slots: list[int], block_ids: list[int]) -> None:
        failed.append(len(slots))
        raise RuntimeError("copy failed")

    monkeypatch.setattr(host_kv, "_copy_in", broken)
    assert _two_passes(tiered, working_set) == want
    assert failed
    _picture_matches(core, picture)  # blocks whose copy back failed: removed from "cpu"
    assert_no_leak(tiered)
    assert not core.scheduler.loading and not core.kv_cache_manager.loads


def test_a_host_tier_larger_than_the_memory_available_is_refused(model_dirs, monkeypatch):
    from kvfleet.engine import model_runner
    from kvfleet.engine.host_memory import Available

    monkeypatch.setattr(model_runner, "available_memory", lambda: Available(2**30, False))
    with pytest.raises(
        ValueError, match=r"KV tier take 2\.0 GiB .* 1\.0 GiB .* --cpu-kv-cache-bytes"
    ):
        LLM(str(model_dirs["llama"]), dtype="float32", cpu_kv_cache_bytes="2Gi")
    # Under a container's limit the headroom counts reclaimable page cache: only a warning.
    monkeypatch.setattr(model_runner, "available_memory", lambda: Available(2**30, True))
    llm = LLM(str(model_dirs["llama"]), dtype="float32", cpu_kv_cache_bytes="2Gi")
    assert llm.engine.runner.host_kv is not None


def test_every_tensor_parallel_rank_copies_its_share(model_dirs, working_set):
    """Two ranks (gloo on the CPU): each keeps its heads' half of every host block and copies
    it back as rank 0's plan says; the tokens are one rank's without the tier."""
    path = str(model_dirs["llama"])
    args = {"dtype": "float32", "num_gpu_blocks_override": DEVICE_BLOCKS, "device": "cpu"}
    with LLM(path, **args) as one:
        want = _two_passes(one, working_set)
    with LLM(path, tensor_parallel_size=2, cpu_kv_cache_bytes=2**26, **args) as two:
        assert _two_passes(two, working_set) == want
        assert two.engine.stats().host_cache_hits > 0
        assert_no_leak(two)
