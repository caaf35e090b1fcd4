"""Per-request block lists over a shared BlockPool: prefix-cache lookup, slot allocation as a
sequence grows, and freeing on finish, abort or preemption."""

from __future__ import annotations

from collections.abc import Sequence

from kvfleet.engine.block_pool import BlockPool, KVBlock
from kvfleet.engine.request import Request
from kvfleet.protocol.block_hash import extend_block_hashes, lora_extra_key


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_blocks: dict[str, list[KVBlock]] = {}
        # How many leading blocks of each request are already registered in the prefix cache.
        self._num_cached_blocks: dict[str, int] = {}

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
        every_position = req.sampling_params.prompt_logprobs is not None or (
            req.pooling is not None and req.pooling.pooling_type == "MEAN"
        )
        if not self.enable_caching or every_position:
            return [], 0
        self._update_block_hashes(req)
        max_hit_blocks = (req.num_tokens - 1) // self.block_size
        lora_id = req.lora.lora_int_id if req.lora is not None else 0
        hits: list[KVBlock] = []
        for block_hash in req.block_hashes[:max_hit_blocks]:
            block = self.pool.get_cached_block(block_hash)
            # An adapter's blocks are keyed by its name (all a router knows of it); one
            # unloaded and loaded again under that name is another adapter (a new id) whose
            # requests must not read the KV of the one before.
            if block is None or block.lora_id != lora_id:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

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
