"""Unit tests of BlockPool and FreeBlockQueue: ref counts, LRU free order, prefix-cache table."""

from __future__ import annotations

import pytest

from kvfleet.engine.block_pool import BlockPool, FreeBlockQueue, KVBlock
from kvfleet.engine.lora_request import LoRARequest
from kvfleet.protocol.block_hash import hash_block_tokens
from kvfleet.protocol.kv_events import AllBlocksCleared, BlockRemoved, BlockStored


def free_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_queue]


def free_ids_backwards(q: FreeBlockQueue) -> list[int]:
    """Walk the queue tail to head, so a broken prev link shows up even if next links are fine."""
    out = []
    b = q._tail.prev_free
    while b is not None and b is not q._head:
        out.append(b.block_id)
        b = b.prev_free
    return out[::-1]


# -- FreeBlockQueue ----------------------------------------------------------------------------


def test_free_queue_remove_from_middle_keeps_links() -> None:
    blocks = [KVBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    assert q.num_free == 5

    q.remove(blocks[2])
    assert [b.block_id for b in q] == [0, 1, 3, 4]
    assert free_ids_backwards(q) == [0, 1, 3, 4]
    assert q.num_free == 4
    assert blocks[2].prev_free is None and blocks[2].next_free is None
    assert blocks[1].next_free is blocks[3] and blocks[3].prev_free is blocks[1]

    # Both ends too.
    q.remove(blocks[0])
    q.remove(blocks[4])
    assert [b.block_id for b in q] == [1, 3]
    assert free_ids_backwards(q) == [1, 3]
    assert q.num_free == 2

    # A removed block can rejoin, at the tail.
    q.append(blocks[2])
    assert [b.block_id for b in q] == [1, 3, 2]
    assert free_ids_backwards(q) == [1, 3, 2]
    assert q.num_free == 3


def test_free_queue_remove_of_absent_block_raises_and_changes_nothing() -> None:
    blocks = [KVBlock(i) for i in range(3)]
    q = FreeBlockQueue(blocks)
    q.remove(blocks[1])
    with pytest.raises(ValueError):
        q.remove(blocks[1])
    with pytest.raises(ValueError):
        q.remove(KVBlock(99))
    assert [b.block_id for b in q] == [0, 2]
    assert q.num_free == 2


def test_free_queue_popleft_order_and_empty() -> None:
    blocks = [KVBlock(i) for i in range(3)]
    q = FreeBlockQueue(blocks)
    assert [q.popleft().block_id for _ in range(3)] == [0, 1, 2]
    assert q.num_free == 0
    assert list(q) == []
    with pytest.raises(ValueError):
        q.popleft()


# -- BlockPool ---------------------------------------------------------------------------------


def test_pool_needs_two_blocks() -> None:
    with pytest.raises(ValueError):
        BlockPool(1, enable_caching=True)
    pool = BlockPool(2, enable_caching=True)
    assert pool.num_usable_blocks == 1
    assert pool.num_free_blocks == 1


def test_null_block_is_never_handed_out() -> None:
    pool = BlockPool(6, enable_caching=True)
    assert pool.null_block is pool.blocks[0]
    assert pool.null_block.ref_cnt == 1
    assert 0 not in free_ids(pool)
    assert pool.num_free_blocks == pool.num_usable_blocks == 5

    for _ in range(3):  # churn: allocate everything, free it, again
        got = pool.get_new_blocks(5)
        assert sorted(b.block_id for b in got) == [1, 2, 3, 4, 5]
        with pytest.raises(ValueError):
            pool.get_new_blocks(1)
        pool.free_blocks(got)
    assert pool.null_block.ref_cnt == 1
    assert pool.null_block.prev_free is None and pool.null_block.next_free is None


def test_get_new_blocks_takes_from_head_and_sets_ref() -> None:
    pool = BlockPool(6, enable_caching=True)
    got = pool.get_new_blocks(2)
    assert [b.block_id for b in got] == [1, 2]
    assert all(b.ref_cnt == 1 for b in got)
    assert free_ids(pool) == [3, 4, 5]
    assert pool.num_free_blocks == 3
    assert pool.usage == pytest.approx(2 / 5)


def test_get_new_blocks_too_many_raises_without_side_effects() -> None:
    pool = BlockPool(4, enable_caching=True)
    with pytest.raises(ValueError):
        pool.get_new_blocks(4)
    assert free_ids(pool) == [1, 2, 3]
    assert all(b.ref_cnt == 0 for b in pool.blocks[1:])


def test_freed_blocks_go_to_tail_in_given_order() -> None:
    pool = BlockPool(6, enable_caching=True)
    a = pool.get_new_blocks(3)  # 1, 2, 3
    assert free_ids(pool) == [4, 5]
    pool.free_blocks(reversed(a))
    assert free_ids(pool) == [4, 5, 3, 2, 1]
    # LRU: the never-used blocks first, then the most recently freed last.
    got = pool.get_new_blocks(3)
    assert [b.block_id for b in got] == [4, 5, 3]
    assert free_ids(pool) == [2, 1]


def test_shared_block_freed_only_when_last_ref_drops() -> None:
    pool = BlockPool(4, enable_caching=True)
    (b,) = pool.get_new_blocks(1)
    pool.touch([b])
    assert b.ref_cnt == 2
    pool.free_blocks([b])
    assert b.ref_cnt == 1
    assert b.block_id not in free_ids(pool)
    pool.free_blocks([b])
    assert b.ref_cnt == 0
    assert free_ids(pool)[-1] == b.block_id


def test_double_free_raises() -> None:
    pool = BlockPool(4, enable_caching=True)
    (b,) = pool.get_new_blocks(1)
    pool.free_blocks([b])
    before = free_ids(pool)
    with pytest.raises(ValueError, match="double free"):
        pool.free_blocks([b])
    assert b.ref_cnt == 0
    assert free_ids(pool) == before
    assert pool.num_free_blocks == 3


def test_touch_revives_block_from_middle_of_free_queue() -> None:
    pool = BlockPool(6, enable_caching=True)
    blocks = pool.get_new_blocks(5)
    pool.free_blocks(blocks)  # queue: 1 2 3 4 5
    b3 = pool.blocks[3]
    pool.touch([b3])
    assert b3.ref_cnt == 1
    assert free_ids(pool) == [1, 2, 4, 5]
    assert free_ids_backwards(pool.free_queue) == [1, 2, 4, 5]
    assert pool.num_free_blocks == 4
    # A touched block that is already referenced just gains a ref.
    pool.touch([b3])
    assert b3.ref_cnt == 2
    assert pool.num_free_blocks == 4


# -- hashing and the prefix-cache table -------------------------------------------------------


def test_cache_block_and_lookup() -> None:
    pool = BlockPool(4, enable_caching=True)
    (b,) = pool.get_new_blocks(1)
    h = hash_block_tokens(None, [1] * 16)
    assert pool.get_cached_block(h) is None
    pool.cache_block(b, h, None)
    assert pool.get_cached_block(h) is b
    assert b.block_hash == h
    # A block already holding a hash keeps it.
    h2 = hash_block_tokens(None, [2] * 16)
    pool.cache_block(b, h2, None)
    assert b.block_hash == h
    assert pool.get_cached_block(h2) is None


def test_cache_block_keeps_first_entry_on_duplicate_hash() -> None:
    pool = BlockPool(4, enable_caching=True)
    first, second = pool.get_new_blocks(2)
    h = hash_block_tokens(None, [5] * 16)
    pool.cache_block(first, h, None)
    pool.cache_block(second, h, None)
    assert pool.get_cached_block(h) is first
    assert first.block_hash == h
    assert second.block_hash is None  # an uncached private copy
    assert pool.cached == {h: first}

    # Reusing the private copy must not drop the first block's cache entry.
    pool.free_blocks([second])
    (again,) = pool.get_new_blocks(1)
    assert again is pool.blocks[3]  # never-used block first
    (again2,) = pool.get_new_blocks(1)
    assert again2 is second
    assert pool.get_cached_block(h) is first


def test_cache_block_disabled_caching_is_noop() -> None:
    pool = BlockPool(4, enable_caching=False)
    (b,) = pool.get_new_blocks(1)
    pool.cache_block(b, hash_block_tokens(None, [1] * 16), None)
    assert pool.cached == {}
    assert b.block_hash is None


def test_cached_block_survives_free_until_reused() -> None:
    pool = BlockPool(3, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    ha = hash_block_tokens(None, [1] * 16)
    hb = hash_block_tokens(ha, [2] * 16)
    pool.cache_block(a, ha, None)
    pool.cache_block(b, hb, ha)
    pool.free_blocks([b, a])  # queue: b, a
    # Freed but still a hit.
    assert pool.get_cached_block(ha) is a
    assert pool.get_cached_block(hb) is b

    (x,) = pool.get_new_blocks(1)  # head of the queue: b is evicted
    assert x is b
    assert x.block_hash is None
    assert pool.get_cached_block(hb) is None
    assert pool.get_cached_block(ha) is a
    assert pool.cached == {ha: a}

    # Reviving the cached free block takes it out of the queue; it stays cached.
    pool.touch([a])
    assert pool.num_free_blocks == 0
    assert pool.get_cached_block(ha) is a
    assert a.block_hash == ha


def test_reset_prefix_cache() -> None:
    pool = BlockPool(4, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    ha = hash_block_tokens(None, [1] * 16)
    hb = hash_block_tokens(ha, [2] * 16)
    pool.cache_block(a, ha, None)
    pool.cache_block(b, hb, ha)

    pool.free_blocks([b])
    assert pool.reset_prefix_cache() is False  # a is still held
    assert pool.cached == {ha: a, hb: b}
    assert a.block_hash == ha and b.block_hash == hb

    pool.free_blocks([a])
    assert pool.reset_prefix_cache() is True
    assert pool.cached == {}
    assert all(blk.block_hash is None for blk in pool.blocks)
    assert pool.num_free_blocks == pool.num_usable_blocks
    # The blocks are plain free blocks again and can be re-cached.
    pool.touch([a])
    pool.cache_block(a, hb, ha)
    assert pool.get_cached_block(hb) is a


# -- KV events ---------------------------------------------------------------------------------


def test_the_pool_records_events_only_while_subscribed() -> None:
    pool = BlockPool(4, enable_caching=True)
    a, b, c = pool.get_new_blocks(3)
    ha = hash_block_tokens(None, [1] * 16)
    pool.cache_block(a, ha, None)
    assert pool.events.drain() == []
    pool.events.enabled = True
    hb = hash_block_tokens(ha, [2] * 16)
    hc = hash_block_tokens(hb, [3] * 16)
    lora = LoRARequest("ad", 1, "/ad")
    pool.cache_block(b, hb, ha, lora)
    pool.cache_block(c, hc, hb, lora)  # the chain goes on: one event
    pool.cache_block(c, hc, hb, lora)  # cached already: nothing
    assert pool.events.drain() == [
        BlockStored(block_hashes=[hb.hex(), hc.hex()], parent_block_hash=ha.hex(),
                    medium="gpu", lora_name="ad"),
    ]  # fmt: skip
    pool.free_blocks([c, b, a])
    pool.get_new_blocks(2)  # evicts c, then b
    pool.drop_adapter_blocks(lora.lora_int_id)  # nothing of it is left
    assert pool.events.drain() == [
        BlockRemoved(block_hashes=[hc.hex(), hb.hex()], medium="gpu"),
    ]
    pool.events.stop()
    pool.cache_block(pool.get_new_blocks(1)[0], hb, ha)
    assert pool.events.drain() == []


def test_an_unloaded_adapters_blocks_leave_the_cache_and_a_reset_clears_it() -> None:
    pool = BlockPool(6, enable_caching=True)
    pool.events.enabled = True
    blocks = pool.get_new_blocks(3)
    h0 = hash_block_tokens(None, [1] * 16)
    h1 = hash_block_tokens(None, [1] * 16, b"lora:ad")
    h2 = hash_block_tokens(h1, [1] * 16)
    pool.cache_block(blocks[0], h0, None)
    pool.cache_block(blocks[1], h1, None, LoRARequest("ad", 2, "/ad"))
    pool.cache_block(blocks[2], h2, h1, LoRARequest("ad", 2, "/ad"))
    pool.events.drain()
    pool.drop_adapter_blocks(2)
    assert set(pool.cached) == {h0}
    assert pool.events.drain() == [BlockRemoved(block_hashes=[h1.hex(), h2.hex()], medium="gpu")]
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache()
    assert pool.events.drain() == [AllBlocksCleared()]
