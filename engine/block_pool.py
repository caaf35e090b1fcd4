"""Fixed-size KV blocks: ref counts, an LRU free queue with O(1) removal, and the prefix-cache
table mapping a chained block hash to the block that holds those tokens."""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from kvfleet.engine.kv_event_log import KVEventLog
from kvfleet.engine.lora_request import LoRARequest


class KVBlock:
    __slots__ = (
        "block_hash",
        "block_id",
        "lora_id",
        "lora_name",
        "next_free",
        "parent_hash",
        "prev_free",
        "ref_cnt",
    )

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        # Of a cached block: the previous block's hash, and the LoRA adapter (lora_int_id, 0:
        # the base model; its name) whose KV it holds.
        self.parent_hash: bytes | None = None
        self.lora_id = 0
        self.lora_name: str | None = None
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class EvictedBlock(NamedTuple):
    """A cached block evicted to be reused: what a host tier needs to keep a copy of it."""

    block_id: int
    block_hash: bytes
    parent_hash: bytes | None
    lora_id: int
    lora_name: str | None


class FreeBlockQueue:
    """Doubly linked list of blocks with ref_cnt 0, least recently freed first.

    A prefix-cache hit takes a block out of the middle, hence the links instead of a deque.
    """

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free = 0
        for b in blocks:
            self.append(b)

    def append(self, block: KVBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free += 1

    def remove(self, block: KVBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"{block} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def popleft(self) -> KVBlock:
        first = self._head.next_free
        if first is self._tail or first is None:
            raise ValueError("no free blocks")
        self.remove(first)
        return first

    def __iter__(self):
        b = self._head.next_free
        while b is not None and b is not self._tail:
            yield b
            b = b.next_free


class BlockPool:
    """Owns every block. Block 0 is reserved as the null block that padding slots point at."""

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks < 2:
            raise ValueError(f"need at least 2 KV blocks, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.ref_cnt = 1  # never freed, never handed out
        self.free_queue = FreeBlockQueue(self.blocks[1:])
        self.cached: dict[bytes, KVBlock] = {}
        # What the cache gained and lost, while someone subscribes to the engine's KV events.
        self.events = KVEventLog()
        # The cached blocks get_new_blocks evicted, for a host tier to copy before they are
        # written again; None: nobody keeps them.
        self.evicted: list[EvictedBlock] | None = None

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests; cached, unreferenced blocks count as free."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def get_cached_block(self, block_hash: bytes) -> KVBlock | None:
        return self.cached.get(block_hash)

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} blocks, {self.num_free_blocks} free")
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            if self.evicted is not None and block.block_hash is not None:
                self.evicted.append(
                    EvictedBlock(
                        block.block_id,
                        block.block_hash,
                        block.parent_hash,
                        block.lora_id,
                        block.lora_name,
                    )
                )
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on prefix-cache hits, reviving them from the free queue if unused."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference each; blocks reaching zero join the free queue in the order given,
        so callers pass a request's blocks tail first to have its last blocks evicted first."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def cache_block(
        self,
        block: KVBlock,
        block_hash: bytes,
        parent_hash: bytes | None,
        lora: LoRARequest | None = None,
    ) -> None:
        """Enter a full block into the prefix cache under its chained hash (`parent_hash`: the
        previous block's, None for a prompt's first)."""
        if not self.enable_caching or block.block_hash is not None:
            return
        # Two requests can fill identical blocks in the same step; the first one stays the
        # cache entry and the other block is simply an uncached private copy.
        if block_hash in self.cached:
            return
        block.block_hash = block_hash
        block.parent_hash = parent_hash
        block.lora_id = lora.lora_int_id if lora is not None else 0
        block.lora_name = lora.lora_name if lora is not None else None
        self.cached[block_hash] = block
        if self.events.enabled:
            self.events.stored(block_hash, parent_hash, block.lora_name, "gpu")

    def _evict(self, block: KVBlock) -> None:
        # A block with a hash is the cache's entry for it: cache_block sets one only then.
        if block.block_hash is not None:
            del self.cached[block.block_hash]
            if self.events.enabled:
                self.events.removed(block.block_hash, "gpu")
            block.block_hash = None

    def cached_hashes(self) -> list[bytes]:
        """Every block hash in the prefix cache (a KV-events snapshot)."""
        return list(self.cached)

    def drop_adapter_blocks(self, lora_int_id: int) -> None:
        """Take an unloaded adapter's blocks out of the prefix cache: the adapter loaded again
        under its name (the same keys, another id) caches its own. A block a request still
        holds stays that request's, uncached."""
        for block in [b for b in self.cached.values() if b.lora_id == lora_int_id]:
            self._evict(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; only possible when no request holds a block."""
        if self.num_free_blocks != self.num_usable_blocks:
            return False
        for block in self.cached.values():
            block.block_hash = None
        self.cached.clear()
        if self.events.enabled:
            self.events.cleared()
        return True
