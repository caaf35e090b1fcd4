"""Per-request block lists over a shared BlockPool: prefix-cache lookup, slot allocation as a
sequence grows, and freeing on finish, abort or preemption; with a host tier, the copies of
evicted blocks into host memory and of host hits back into device blocks."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvfleet.engine.block_pool import BlockPool, KVBlock
from kvfleet.engine.host_block_index import HostBlockIndex
from kvfleet.engine.kv_transfers import KVTransfers
from kvfleet.engine.lora_request import LoRARequest
from kvfleet.engine.request import Request
from kvfleet.protocol.block_hash import extend_block_hashes, lora_extra_key


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True, slots=True)
class HostLoad:
    """Host blocks being copied back for a request: the device blocks it holds meanwhile (its
    device hits, then the copies' targets), and the hashes the targets take once filled (with
    each one's parent, and the request's adapter)."""

    request_id: str
    held: list[KVBlock]
    targets: list[KVBlock]
    hashes: list[bytes]
    parents: list[bytes | None]
    lora: LoRARequest | None


class KVCacheManager:
    def __init__(
        self, num_blocks: int, block_size: int, enable_caching: bool, num_host_blocks: int = 0
    ) -> None:
        """`num_host_blocks`: slots of the host tier (0: none; it needs prefix caching)."""
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_blocks: dict[str, list[KVBlock]] = {}
        # How many leading blocks of each request are already registered in the prefix cache.
        self._num_cached_blocks: dict[str, int] = {}
        self.host: HostBlockIndex | None = None
        if enable_caching and num_host_blocks > 0:
            self.host = HostBlockIndex(num_host_blocks)
            self.pool.evicted = []
        self.loads: dict[int, HostLoad] = {}
        self._next_load = 0
        self._transfers = KVTransfers()

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def _update_block_hashes(self, req: Request) -> None:
        """Extend req.block_hashes to cover every full block of its tokens. Each block is hashed
        once in the request's life, so the work per step does not grow with context length."""
        extra = lora_extra_key(req.lora.lora_name) if req.lora is not None else None
        extend_block_hashes(req.block_hashes, req.all_token_ids, extra, self.block_size)

    def get_computed_blocks(self, req: Request) -> tuple[list[KVBlock], int]:
        """The longest run of leading full blocks already in the prefix cache, and its length in
        tokens. The last token is never taken from the cache: it must run to produce logits.
        Nor is any token of a request that scores its prompt (prompt_logprobs): each position
        must run to produce its logits, so such a request takes no hit (as in vLLM); nor does
        an embedding request that pools the mean of every position's hidden state."""
        if not self._takes_hits(req):
            return [], 0
        self._update_block_hashes(req)
        lora_id = req.lora.lora_int_id if req.lora is not None else 0
        hits: list[KVBlock] = []
        for block_hash in req.block_hashes[: self._max_hit_blocks(req)]:
            block = self.pool.get_cached_block(block_hash)
            # An adapter's blocks are keyed by its name (all a router knows of it); one
            # unloaded and loaded again under that name is another adapter (a new id) whose
            # requests must not read the KV of the one before.
            if block is None or block.lora_id != lora_id:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def _takes_hits(self, req: Request) -> bool:
        every_position = req.sampling_params.prompt_logprobs is not None or (
            req.pooling is not None and req.pooling.pooling_type == "MEAN"
        )
        return self.enable_caching and not every_position

    def _max_hit_blocks(self, req: Request) -> int:
        return (req.num_tokens - 1) // self.block_size

    # -- the host tier ---------------------------------------------------------------------
    def get_host_blocks(self, req: Request, num_device_hits: int) -> list[bytes]:
        """The hashes of the blocks that continue the request's device hits in the host tier
        (copies complete), up to where get_computed_blocks would stop."""
        host = self.host
        if host is None or not self._takes_hits(req):
            return []
        lora_id = req.lora.lora_int_id if req.lora is not None else 0
        found: list[bytes] = []
        for block_hash in req.block_hashes[num_device_hits : self._max_hit_blocks(req)]:
            if host.lookup(block_hash, lora_id) is None:
                break
            found.append(block_hash)
        return found

    def start_load(self, req: Request, device_hits: Sequence[KVBlock], hashes: list[bytes]) -> bool:
        """Hold the request's device hits and new device blocks for its host hits, and queue
        the copies into them. False, changing nothing, when the pool cannot hold them."""
        host = self.host
        assert host is not None
        num_revived = sum(1 for b in device_hits if b.ref_cnt == 0)
        if len(hashes) + num_revived > self.pool.num_free_blocks:
            return False
        self.pool.touch(device_hits)
        # Pinned before any eviction below can place a block into their slots.
        slots = [host.pin(h) for h in hashes]
        targets = self.pool.get_new_blocks(len(hashes))
        self._place_evicted()
        load_id = self._next_load
        self._next_load += 1
        first = len(device_hits)
        chain = req.block_hashes
        parents = [chain[i - 1] if i else None for i in range(first, first + len(hashes))]
        self.loads[load_id] = HostLoad(
            req.request_id, [*device_hits, *targets], targets, hashes, parents, req.lora
        )
        self._transfers.loads.append((load_id, slots, [b.block_id for b in targets]))
        return True

    def finish_load(self, load_id: int, ok: bool) -> str:
        """A load's copies completed (or failed: the blocks are dropped, the tokens computed
        again). Its blocks join the prefix cache and are released: the request finds them as
        device hits when it is scheduled. Returns the request's id."""
        load = self.loads.pop(load_id)
        host = self.host
        assert host is not None
        for block_hash in load.hashes:
            if host.unpin(block_hash, drop=not ok):
                self._host_removed(block_hash)
        if ok:
            for block, block_hash, parent in zip(
                load.targets, load.hashes, load.parents, strict=True
            ):
                self.pool.cache_block(block, block_hash, parent, load.lora)
        self.pool.free_blocks(reversed(load.held))
        # The step that may first use them waits for their copies on every rank.
        self._transfers.loads_ready.append(load_id)
        return load.request_id

    def host_stored(self, tickets: list[int], failed: list[int]) -> None:
        """These store copies completed: their blocks can be served from the host tier; those
        that failed are forgotten."""
        host = self.host
        if host is None:
            return
        events = self.pool.events
        for ticket in tickets:
            entry = host.stored(ticket)
            if entry is not None and events.enabled:
                events.stored(entry.block_hash, entry.parent_hash, entry.lora_name, "cpu")
        for ticket in failed:
            host.store_failed(ticket)  # never servable, never published

    def _host_removed(self, block_hash: bytes) -> None:
        """A block the host tier served is gone from it."""
        if self.pool.events.enabled:
            self.pool.events.removed(block_hash, "cpu")

    def _place_evicted(self) -> None:
        """A host slot for each cached block the pool just evicted; the copy goes ahead of the
        step that reuses the block."""
        evicted, host = self.pool.evicted, self.host
        if not evicted or host is None:
            return
        for block in evicted:
            placement = host.place(
                block.block_hash, block.parent_hash, block.lora_id, block.lora_name
            )
            if placement is not None:
                self._transfers.stores.append((block.block_id, placement.slot, placement.ticket))
                for dropped in placement.dropped:
                    self._host_removed(dropped)
        evicted.clear()

    def take_transfers(self) -> KVTransfers:
        """The copies decided since the last call, for the step about to run."""
        transfers, self._transfers = self._transfers, KVTransfers()
        return transfers

    def drop_adapter_blocks(self, lora_int_id: int) -> None:
        """Take an unloaded adapter's blocks out of both tiers (BlockPool.drop_adapter_blocks)."""
        self.pool.drop_adapter_blocks(lora_int_id)
        if self.host is not None:
            for block_hash in self.host.drop_adapter(lora_int_id):
                self._host_removed(block_hash)

    def cached_host_hashes(self) -> list[bytes]:
        """Every block hash the host tier serves (a KV-events snapshot)."""
        return self.host.ready_hashes() if self.host is not None else []

    @property
    def num_host_blocks(self) -> int:
        return len(self.host) if self.host is not None else 0

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block, on the device and in host memory; only possible when no
        request holds a block."""
        if self.loads or not self.pool.reset_prefix_cache():
            return False
        if self.host is not None:
            self.host.clear()  # the pool's `cleared` event covers every medium
        return True

    def allocate_slots(
        self,
        req: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVBlock] = (),
    ) -> list[int] | None:
        """Make room for num_new_tokens beyond req.num_computed_tokens (plus any prefix-cache hits
        being adopted). Returns the ids of the blocks appended to the request's block table, or
        None, changing nothing, when the pool cannot hold them."""
        bs = self.block_size
        blocks = self.req_blocks.get(req.request_id, [])
        total = req.num_computed_tokens + len(new_computed_blocks) * bs + num_new_tokens
        # The common decode step: the token fits the last block and fills no block to cache.
        if (
            not new_computed_blocks
            and total <= len(blocks) * bs
            and (not self.enable_caching or total // bs <= self._num_cached_blocks[req.request_id])
        ):
            return []
        if total > req.num_tokens + req.num_pending:
            raise ValueError(
                f"{req}: cannot compute {total} tokens, only {req.num_tokens} known and "
                f"{req.num_pending} sampled"
            )
        num_needed = cdiv(total, bs) - len(blocks) - len(new_computed_blocks)
        # Adopting a hit whose block sits unreferenced in the free queue uses up a free block.
        num_revived = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_needed + num_revived > self.pool.num_free_blocks:
            return None

        self.pool.touch(new_computed_blocks)
        new_blocks = self.pool.get_new_blocks(max(num_needed, 0))
        self._place_evicted()
        added = [*new_computed_blocks, *new_blocks]
        if added:
            blocks = self.req_blocks.setdefault(req.request_id, blocks)
            blocks.extend(added)

        if self.enable_caching:
            # Blocks filled by this step are published now: any later request in the same batch
            # that hits them reads K/V written earlier in the same layer's forward. A block
            # whose last token is still on the device waits for a later step: its hash needs it.
            self._update_block_hashes(req)
            num_full = min(total, req.num_tokens) // bs
            start = self._num_cached_blocks.get(req.request_id, 0)
            hashes = req.block_hashes
            for i in range(start, num_full):
                self.pool.cache_block(blocks[i], hashes[i], hashes[i - 1] if i else None, req.lora)
            self._num_cached_blocks[req.request_id] = max(start, num_full)
        return [b.block_id for b in added]

    def free(self, req: Request) -> None:
        blocks = self.req_blocks.pop(req.request_id, [])
        self._num_cached_blocks.pop(req.request_id, None)
        # Tail first: a request's last blocks are the least likely to be shared; evict them first.
        self.pool.free_blocks(reversed(blocks))

    def block_ids(self, req: Request) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(req.request_id, [])]
