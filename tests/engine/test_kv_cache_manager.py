"""KVCacheManager + BlockPool: a rule-based state machine that drives admission (with prefix-cache
hits), chunked prefill, decode, finish and preemption the way the Scheduler does, checking ref
counts, the free queue, the prefix-cache table and the KV content each block holds; plus a few
plain tests of capacity accounting and eviction."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from kvfleet.engine.block_pool import KVBlock
from kvfleet.engine.kv_cache_manager import KVCacheManager, cdiv
from kvfleet.engine.lora_request import LoRARequest
from kvfleet.engine.request import Request
from kvfleet.engine.sampling_params import SamplingParams
from kvfleet.protocol.block_hash import hash_block_tokens
from kvfleet.protocol.kv_events import BlockRemoved, BlockStored

BS = 16
MAX_MODEL_LEN = 4096
# Requests stop growing here so one example cannot hog the whole pool forever.
MAX_REQ_TOKENS = 112

# A few fixed full blocks; prompts are built from them (plus a short random tail over the same
# small alphabet) so that whole-block prefixes repeat and the prefix cache gets hits.
PATTERNS: list[list[int]] = [[0] * BS, [1] * BS, [0, 1, 2, 2] * (BS // 4)]
TOKENS = st.integers(0, 2)
PROMPTS = st.builds(
    lambda blocks, tail: [t for i in blocks for t in PATTERNS[i]] + tail or [0],
    st.lists(st.integers(0, len(PATTERNS) - 1), max_size=4),
    st.lists(TOKENS, max_size=20),
)


def chunks(remaining: int) -> st.SearchStrategy[int]:
    return st.one_of(st.just(remaining), st.integers(1, remaining))


def make_request(rid: str, prompt: list[int], lora: LoRARequest | None = None) -> Request:
    return Request(
        rid,
        prompt,
        SamplingParams(max_tokens=None),
        eos_token_ids=frozenset(),
        max_tokens=MAX_MODEL_LEN - len(prompt),
        lora=lora,
    )


def chain_hash(tokens: tuple[int, ...]) -> bytes:
    """The chained hash of the last full block of tokens (len(tokens) a multiple of BS)."""
    h = None
    for i in range(0, len(tokens), BS):
        h = hash_block_tokens(h, tokens[i : i + BS])
    assert h is not None
    return h


def free_queue_ids(kv: KVCacheManager) -> list[int]:
    return [b.block_id for b in kv.pool.free_queue]


def snapshot(kv: KVCacheManager) -> tuple:
    pool = kv.pool
    return (
        [(b.ref_cnt, b.block_hash) for b in pool.blocks],
        free_queue_ids(kv),
        pool.num_free_blocks,
        {h: b.block_id for h, b in pool.cached.items()},
        {rid: [b.block_id for b in blocks] for rid, blocks in kv.req_blocks.items()},
        dict(kv._num_cached_blocks),
    )


class KVCacheMachine(RuleBasedStateMachine):
    """The model: requests are either waiting (holding no blocks) or running (holding
    cdiv(num_computed_tokens, BS) blocks, with num_computed_tokens < num_tokens, exactly as after a
    Scheduler.update). `shadow` records the tokens "written" into each slot of each block, and
    `ctx` the tokens that preceded the block in the request that wrote it."""

    def __init__(self) -> None:
        super().__init__()
        self.kv: KVCacheManager
        self.waiting: dict[str, Request] = {}
        self.running: dict[str, Request] = {}
        self.shadow: dict[int, list[int | None]] = {}
        self.ctx: dict[int, tuple[int, ...]] = {}
        self.next_id = 0
        # Token sequences of every request so far, for prompts that share their prefixes.
        self.history: list[list[int]] = []
        # The cache as a KV-events subscriber sees it: the events applied in order.
        self.published: set[str] = set()

    @initialize(
        num_blocks=st.sampled_from(range(2, 17)),
        caching=st.sampled_from([True, True, True, False]),
    )
    def setup(self, num_blocks: int, caching: bool) -> None:
        self.kv = KVCacheManager(num_blocks, BS, enable_caching=caching)
        self.kv.pool.events.enabled = True

    # -- helpers -----------------------------------------------------------------------------
    def _allocate(self, req: Request, num_new: int, hits: list[KVBlock]) -> bool:
        kv = self.kv
        before = snapshot(kv)
        old_ids = kv.block_ids(req)
        old_refs = {b.block_id: b.ref_cnt for b in kv.pool.blocks}
        ids = kv.allocate_slots(req, num_new, hits)
        total = req.num_computed_tokens + len(hits) * BS + num_new
        if ids is None:
            assert snapshot(kv) == before, "a failed allocate_slots changed state"
            # ...and it only fails when the pool really cannot hold the request.
            needed = cdiv(total, BS) - len(old_ids) - len(hits)
            revived = sum(1 for b in hits if old_refs[b.block_id] == 0)
            assert needed + revived > before[2]
            event("allocate_slots failed")
            return False
        assert ids[: len(hits)] == [b.block_id for b in hits]
        new_ids = ids[len(hits) :]
        assert kv.block_ids(req) == old_ids + ids
        assert len(kv.block_ids(req)) == cdiv(total, BS)
        if any(bid in before[3].values() for bid in new_ids):
            event("cached block evicted")
        for bid in new_ids:
            assert bid != 0, "the null block was handed out"
            assert old_refs[bid] == 0, f"block {bid} was handed out while referenced"
            assert kv.pool.blocks[bid].ref_cnt == 1
            # A fresh block: whatever it held before is gone.
            self.shadow[bid] = [None] * BS
            self.ctx.pop(bid, None)
        for b in hits:
            assert b.ref_cnt == old_refs[b.block_id] + 1
        return True

    def _compute(self, req: Request, num_new: int, token: int) -> None:
        """The forward pass: write the K/V of num_new tokens, then (at the end of the known
        tokens) sample one, as Scheduler.update does."""
        table = self.kv.req_blocks[req.request_id]
        toks = req.all_token_ids
        for p in range(req.num_computed_tokens, req.num_computed_tokens + num_new):
            blk = table[p // BS]
            assert blk.block_id != 0
            assert blk.ref_cnt == 1, f"writing into shared block {blk}"
            slots = self.shadow[blk.block_id]
            assert slots[p % BS] is None, f"slot {p % BS} of {blk} written twice"
            slots[p % BS] = toks[p]
            start = p - p % BS
            if p % BS == 0:
                self.ctx[blk.block_id] = tuple(toks[:start])
            else:
                assert self.ctx[blk.block_id] == tuple(toks[:start])
        req.num_computed_tokens += num_new
        if req.num_computed_tokens == req.num_tokens:
            req.append_token(token)

    def _check_hit(self, req: Request, hits: list[KVBlock], num_cached: int) -> None:
        kv = self.kv
        assert num_cached == len(hits) * BS
        max_hits = (req.num_tokens - 1) // BS
        assert len(hits) <= max_hits
        if not kv.enable_caching:
            assert hits == []
            return
        toks = req.all_token_ids
        for i, b in enumerate(hits):
            assert b.block_id != 0
            assert b.block_hash == req.block_hashes[i]
            assert self.shadow[b.block_id] == toks[i * BS : (i + 1) * BS], "hit with wrong KV"
            assert self.ctx[b.block_id] == tuple(toks[: i * BS]), "hit with wrong prefix"
        # The hit is the longest cached run.
        if len(hits) < max_hits:
            assert kv.pool.get_cached_block(req.block_hashes[len(hits)]) is None
        if hits:
            event("prefix-cache hit")
            if any(b.ref_cnt == 0 for b in hits):
                event("hit revived from the free queue")

    # -- rules -------------------------------------------------------------------------------
    def _add(self, prompt: list[int]) -> None:
        rid = f"r{self.next_id}"
        self.next_id += 1
        req = make_request(rid, prompt)
        self.waiting[rid] = req
        self.history.append(req.all_token_ids)  # the live list: it grows as req decodes

    @rule(prompt=PROMPTS)
    def add_request(self, prompt: list[int]) -> None:
        self._add(prompt)

    @precondition(lambda self: self.history)
    @rule(data=st.data())
    def add_request_sharing_prefix(self, data: st.DataObject) -> None:
        """A prompt that starts with part of an earlier request's tokens, decoded ones included."""
        base = data.draw(st.sampled_from(self.history), label="base")
        cut = data.draw(st.integers(1, min(len(base), MAX_REQ_TOKENS - 8)), label="cut")
        tail = data.draw(st.lists(TOKENS, max_size=8), label="tail")
        self._add([*base[:cut], *tail])

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def admit(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.waiting)), label="admit")
        req = self.waiting[rid]
        assert req.num_computed_tokens == 0
        assert self.kv.block_ids(req) == []
        hits, num_cached = self.kv.get_computed_blocks(req)
        self._check_hit(req, hits, num_cached)
        # The whole rest of the prompt, or a prefill chunk as the token budget would cut it.
        num_new = data.draw(chunks(req.num_tokens - num_cached), label="chunk")
        if not self._allocate(req, num_new, hits):
            return
        req.num_computed_tokens = num_cached
        self._compute(req, num_new, data.draw(TOKENS, label="sampled"))
        del self.waiting[rid]
        self.running[rid] = req

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def advance(self, data: st.DataObject) -> None:
        """Several steps of one running request: prefill chunks, then decode one token a step."""
        rid = data.draw(st.sampled_from(sorted(self.running)), label="advance")
        req = self.running[rid]
        for _ in range(data.draw(st.integers(1, 24), label="steps")):
            if req.num_tokens >= MAX_REQ_TOKENS:
                break
            remaining = req.num_tokens - req.num_computed_tokens
            assert remaining >= 1
            num_new = data.draw(chunks(remaining), label="chunk")
            if not self._allocate(req, num_new, []):
                break
            self._compute(req, num_new, data.draw(TOKENS, label="sampled"))

    def _free(self, req: Request) -> None:
        kv = self.kv
        table = list(kv.req_blocks[req.request_id])
        kv.free(req)
        assert req.request_id not in kv.req_blocks
        assert req.request_id not in kv._num_cached_blocks
        # Blocks that dropped to zero join the tail, the request's last block first.
        released = [b.block_id for b in reversed(table) if b.ref_cnt == 0]
        if released:
            assert free_queue_ids(kv)[-len(released) :] == released

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.running)), label="finish")
        self._free(self.running.pop(rid))

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.running)), label="preempt")
        req = self.running.pop(rid)
        self._free(req)
        req.num_computed_tokens = 0
        self.waiting[rid] = req

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def abort_waiting(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.waiting)), label="abort")
        before = snapshot(self.kv)
        self.kv.free(self.waiting.pop(rid))
        assert snapshot(self.kv) == before

    @rule()
    def free_all(self) -> None:
        for rid in sorted(self.running):
            self._free(self.running.pop(rid))
        self._check_no_leak()

    # -- invariants --------------------------------------------------------------------------
    def _check_no_leak(self) -> None:
        kv = self.kv
        assert kv.req_blocks == {}
        assert kv.num_free_blocks == kv.pool.num_usable_blocks
        assert all(b.ref_cnt == 0 for b in kv.pool.blocks[1:])

    @invariant()
    def ref_counts_match_holders(self) -> None:
        kv = self.kv
        assert set(kv.req_blocks) == set(self.running)
        holders: Counter[int] = Counter()
        for blocks in kv.req_blocks.values():
            ids = [b.block_id for b in blocks]
            assert len(set(ids)) == len(ids), "a request holds a block twice"
            holders.update(ids)
        assert kv.pool.null_block.ref_cnt == 1
        assert holders[0] == 0
        for b in kv.pool.blocks[1:]:
            assert b.ref_cnt == holders[b.block_id], b

    @invariant()
    def free_queue_is_the_unreferenced_blocks(self) -> None:
        kv = self.kv
        q = free_queue_ids(kv)
        assert len(q) == len(set(q))
        assert set(q) == {b.block_id for b in kv.pool.blocks[1:] if b.ref_cnt == 0}
        assert kv.num_free_blocks == kv.pool.free_queue.num_free == len(q)
        # The prev links agree with the next links.
        back = []
        b = kv.pool.free_queue._tail.prev_free
        while b is not None and b is not kv.pool.free_queue._head:
            back.append(b.block_id)
            b = b.prev_free
        assert back[::-1] == q

    @invariant()
    def the_published_events_add_up_to_the_cache(self) -> None:
        for e in self.kv.pool.events.drain():
            if isinstance(e, BlockStored):
                self.published.update(e.block_hashes)
            elif isinstance(e, BlockRemoved):
                assert set(e.block_hashes) <= self.published
                self.published.difference_update(e.block_hashes)
        assert self.published == {h.hex() for h in self.kv.pool.cached}

    @invariant()
    def cache_table_is_consistent(self) -> None:
        kv = self.kv
        pool = kv.pool
        if not kv.enable_caching:
            assert pool.cached == {}
            assert all(b.block_hash is None for b in pool.blocks)
            return
        for h, b in pool.cached.items():
            assert b.block_hash == h
            assert b.block_id != 0
            # A cached block holds a full block of K/V whose content and prefix hash to h.
            content = self.shadow[b.block_id]
            assert None not in content, f"{b} is cached but not fully written"
            assert chain_hash((*self.ctx[b.block_id], *content)) == h  # type: ignore[arg-type]
        for b in pool.blocks:
            if b.block_hash is not None:
                assert pool.cached.get(b.block_hash) is b

    @invariant()
    def running_requests_see_their_own_tokens(self) -> None:
        kv = self.kv
        for rid, req in self.running.items():
            table = kv.req_blocks[rid]
            assert 0 < req.num_computed_tokens < req.num_tokens
            assert len(table) == cdiv(req.num_computed_tokens, BS)
            toks = req.all_token_ids
            for i, blk in enumerate(table):
                end = min((i + 1) * BS, req.num_computed_tokens)
                slots = self.shadow[blk.block_id]
                assert slots[: end - i * BS] == toks[i * BS : end], f"{req}: block {i} content"
                assert self.ctx[blk.block_id] == tuple(toks[: i * BS])
                if kv.enable_caching and blk.block_hash is not None:
                    assert blk.block_hash == req.block_hashes[i]

    def teardown(self) -> None:
        if not hasattr(self, "kv"):
            return
        for rid in sorted(self.running):
            self._free(self.running.pop(rid))
        self._check_no_leak()


KVCacheMachine.TestCase.settings = settings(
    max_examples=250,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestKVCacheMachine = KVCacheMachine.TestCase


# -- plain tests -------------------------------------------------------------------------------


def admit(kv: KVCacheManager, req: Request) -> list[int] | None:
    """Admission as the Scheduler does it: the whole remaining prompt in one chunk."""
    hits, num_cached = kv.get_computed_blocks(req)
    ids = kv.allocate_slots(req, req.num_tokens - num_cached, hits)
    if ids is not None:
        req.num_computed_tokens = num_cached
    return ids


def test_hit_never_covers_the_last_token() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_caching=True)
    prompt = list(range(32))
    a = make_request("a", prompt)
    assert admit(kv, a) is not None
    a.num_computed_tokens = 32  # both blocks full and published

    # Same 32 tokens: only the first block may come from the cache.
    b = make_request("b", prompt)
    hits, num_cached = kv.get_computed_blocks(b)
    assert [h.block_id for h in hits] == kv.block_ids(a)[:1]
    assert num_cached == 16

    # One token more and both blocks are hits.
    c = make_request("c", [*prompt, 99])
    hits, num_cached = kv.get_computed_blocks(c)
    assert [h.block_id for h in hits] == kv.block_ids(a)
    assert num_cached == 32

    # Exactly one block of tokens: (16 - 1) // 16 == 0 hits.
    d = make_request("d", prompt[:16])
    assert kv.get_computed_blocks(d) == ([], 0)


def test_no_hits_when_caching_disabled() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_caching=False)
    a = make_request("a", list(range(40)))
    assert admit(kv, a) is not None
    assert kv.pool.cached == {}
    assert kv.get_computed_blocks(make_request("b", list(range(40)))) == ([], 0)


def test_an_adapter_loaded_again_under_its_name_never_reads_the_old_ones_blocks() -> None:
    """Blocks are keyed by the adapter's name (what a router can compute); the id tells the
    adapter unloaded from the one loaded again under its name."""
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_caching=True)
    prompt = list(range(40))
    old, new = LoRARequest("ad", 1, "/a"), LoRARequest("ad", 2, "/b")
    a = make_request("a", prompt, old)
    assert admit(kv, a) is not None
    a.num_computed_tokens = len(prompt)
    assert kv.get_computed_blocks(make_request("b", prompt, old))[1] == 32
    newer = make_request("c", prompt, new)
    assert kv.get_computed_blocks(newer) == ([], 0)  # not the old one's KV...
    assert newer.block_hashes == a.block_hashes  # ...under the same keys


def test_partial_chunk_publishes_only_full_blocks() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_caching=True)
    a = make_request("a", list(range(40)))
    assert kv.allocate_slots(a, 20) is not None  # a prefill chunk of 20 tokens
    assert len(kv.block_ids(a)) == 2
    assert len(kv.pool.cached) == 1  # block 0 full, block 1 holds 4 tokens
    a.num_computed_tokens = 20
    assert kv.allocate_slots(a, 12) is not None  # up to 32: block 1 full now
    assert len(kv.block_ids(a)) == 2
    assert len(kv.pool.cached) == 2
    assert [kv.pool.cached[h].block_id for h in a.block_hashes] == kv.block_ids(a)


def test_allocate_beyond_known_tokens_raises() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_caching=True)
    a = make_request("a", list(range(20)))
    before = snapshot(kv)
    with pytest.raises(ValueError):
        kv.allocate_slots(a, 21)
    assert snapshot(kv) == before


def test_eviction_under_pressure_reuses_cached_blocks_tail_first() -> None:
    kv = KVCacheManager(num_blocks=5, block_size=BS, enable_caching=True)  # 4 usable
    prompt_a = list(range(100, 165))  # 65 tokens: 4 full blocks + 1 token
    a = make_request("a", prompt_a[:64])
    assert admit(kv, a) is not None
    a_ids = kv.block_ids(a)
    assert len(a_ids) == 4 and kv.num_free_blocks == 0
    assert len(kv.pool.cached) == 4
    kv.free(a)
    # Everything is free, and still cached.
    assert kv.num_free_blocks == 4
    assert free_queue_ids(kv) == a_ids[::-1]
    assert len(kv.pool.cached) == 4

    # A different prompt needs 3 blocks: it must evict a's last three blocks, not its first.
    b = make_request("b", list(range(200, 248)))
    assert admit(kv, b) is not None
    assert kv.block_ids(b) == a_ids[:0:-1]
    assert kv.num_free_blocks == 1
    assert {blk.block_id for blk in kv.pool.cached.values()} == {a_ids[0], *kv.block_ids(b)}

    # a's prompt again: only its first block survived.
    a2 = make_request("a2", prompt_a)
    hits, num_cached = kv.get_computed_blocks(a2)
    assert [h.block_id for h in hits] == a_ids[:1]
    assert num_cached == 16


def test_hit_stops_at_first_missing_block() -> None:
    kv = KVCacheManager(num_blocks=5, block_size=BS, enable_caching=True)  # 4 usable
    prompt = list(range(300, 349))  # 3 full blocks + 1
    a = make_request("a", prompt[:48])
    assert admit(kv, a) is not None
    x0, x1, x2 = kv.req_blocks["a"]
    kv.free(a)  # queue: (never used), x2, x1, x0
    # Make x2 the most recently freed, so that x1 is the next cached block to be evicted.
    kv.pool.touch([x2])
    kv.pool.free_blocks([x2])
    other = make_request("other", list(range(900, 932)))
    assert admit(kv, other) is not None  # takes the unused block and x1
    assert x1 in kv.req_blocks["other"]
    assert kv.pool.get_cached_block(a.block_hashes[1]) is None
    assert kv.pool.get_cached_block(a.block_hashes[2]) is x2
    # Block 2 is still cached, but it cannot be used without block 1.
    hits, num_cached = kv.get_computed_blocks(make_request("b", prompt))
    assert hits == [x0]
    assert num_cached == 16


def test_revived_hit_counts_against_capacity() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BS, enable_caching=True)  # 3 usable
    prefix = list(range(500, 516))
    a = make_request("a", [*prefix, *range(600, 616)])
    assert admit(kv, a) is not None
    a_ids = kv.block_ids(a)
    kv.free(a)
    assert kv.num_free_blocks == 3

    # 49 tokens = 4 blocks, one of which is a hit sitting in the free queue: 3 new + 1 revived
    # is more than the 3 free blocks, so it must fail cleanly (not blow up half-way).
    b = make_request("b", [*prefix, *range(700, 733)])
    hits, num_cached = kv.get_computed_blocks(b)
    assert [h.block_id for h in hits] == a_ids[:1] and hits[0].ref_cnt == 0
    before = snapshot(kv)
    assert kv.allocate_slots(b, b.num_tokens - num_cached, hits) is None
    assert snapshot(kv) == before

    # 48 tokens = 3 blocks: 2 new + 1 revived fits exactly.
    c = make_request("c", [*prefix, *range(700, 732)])
    hits, num_cached = kv.get_computed_blocks(c)
    assert [h.block_id for h in hits] == a_ids[:1]
    ids = kv.allocate_slots(c, c.num_tokens - num_cached, hits)
    assert ids is not None and ids[0] == a_ids[0]
    assert kv.num_free_blocks == 0
    assert hits[0].ref_cnt == 1
    assert free_queue_ids(kv) == []


def test_hit_held_by_live_request_does_not_use_a_free_block() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BS, enable_caching=True)  # 3 usable
    prefix = list(range(500, 516))
    a = make_request("a", [*prefix, 1])
    assert admit(kv, a) is not None  # 2 blocks, the first cached
    assert kv.num_free_blocks == 1
    b = make_request("b", [*prefix, 2, 3])
    hits, num_cached = kv.get_computed_blocks(b)
    assert num_cached == 16 and hits[0].ref_cnt == 1
    ids = kv.allocate_slots(b, b.num_tokens - num_cached, hits)
    assert ids is not None and len(ids) == 2
    assert hits[0].ref_cnt == 2
    assert kv.num_free_blocks == 0

    # Freeing a leaves the shared block with b.
    kv.free(a)
    assert hits[0].ref_cnt == 1
    assert kv.num_free_blocks == 1
    kv.free(b)
    assert kv.num_free_blocks == 3
