"""Scheduler over a real KVCacheManager, no model: each step is schedule(), then update() with a
fake sampled token for every scheduled request that reached the end of its known tokens."""

from __future__ import annotations

import itertools
import random
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvfleet.engine.admission import Admission, completion_budget
from kvfleet.engine.kv_cache_manager import KVCacheManager, cdiv
from kvfleet.engine.lora_request import LoRARequest
from kvfleet.engine.lora_slots import AdapterSlots
from kvfleet.engine.request import InvalidRequestError, Request, RequestStatus
from kvfleet.engine.sampling_params import SamplingParams
from kvfleet.engine.scheduler import Scheduler, SchedulerOutput

BS = 16
EOS = 2
FILLER = 7  # the fake sampled token: neither EOS nor a stop token
MAX_MODEL_LEN = 256

_unique_tokens = itertools.count(1000)

TokenFn = Callable[[Request], int]


def make_scheduler(
    num_blocks: int = 64,
    max_num_seqs: int = 8,
    budget: int = 64,
    caching: bool = True,
) -> Scheduler:
    kv = KVCacheManager(num_blocks, BS, enable_caching=caching)
    return Scheduler(kv, max_num_seqs, budget)


def admission_for(sched: Scheduler, max_model_len: int) -> Admission:
    """The engine's admission over this scheduler's KV cache."""
    return Admission(
        max_model_len=max_model_len,
        vocab_size=1 << 20,
        block_size=BS,
        num_kv_blocks=sched.kv.pool.num_usable_blocks,
    )


def make_request(
    rid: str,
    prompt: int | list[int],
    max_tokens: int | None = 16,
    max_model_len: int = MAX_MODEL_LEN,
    grammar: Future | None = None,
    lora: LoRARequest | None = None,
    **sampling: Any,
) -> Request:
    """prompt: the tokens, or a length for a prompt of fresh tokens (no prefix-cache hits);
    max_tokens resolved within max_model_len as admission resolves it."""
    if isinstance(prompt, int):
        prompt = [next(_unique_tokens) for _ in range(prompt)]
    return Request(
        rid,
        prompt,
        SamplingParams(max_tokens=max_tokens, **sampling),
        eos_token_ids=frozenset({EOS}),
        max_tokens=completion_budget(len(prompt), max_tokens, max_model_len),
        grammar=grammar,
        lora=lora,
    )


def step(sched: Scheduler, token: int | TokenFn = FILLER) -> tuple[SchedulerOutput, list[Request]]:
    out = sched.schedule()
    sampled = {
        req.request_id: token(req) if callable(token) else token
        for req, n in out.scheduled
        if req.num_computed_tokens + n == req.num_tokens
    }
    return out, sched.update(out, sampled)


def run(
    sched: Scheduler, max_steps: int = 1000, token: int | TokenFn = FILLER
) -> list[SchedulerOutput]:
    outs = []
    while sched.has_unfinished():
        assert len(outs) < max_steps, f"not done after {max_steps} steps: {sched.requests}"
        out, _ = step(sched, token)
        assert out.num_batched_tokens <= sched.max_num_batched_tokens
        assert len(out.scheduled) <= sched.max_num_seqs
        outs.append(out)
    return outs


def sequence(*tokens: int) -> TokenFn:
    """Sample tokens[k] as a request's k-th output token (FILLER past the end)."""
    return lambda req: tokens[k] if (k := req.num_output_tokens) < len(tokens) else FILLER


def assert_pool_consistent(sched: Scheduler) -> None:
    kv = sched.kv
    pool = kv.pool
    holders: Counter[int] = Counter()
    for blocks in kv.req_blocks.values():
        holders.update(b.block_id for b in blocks)
    assert pool.null_block.ref_cnt == 1 and holders[0] == 0
    for b in pool.blocks[1:]:
        assert b.ref_cnt == holders[b.block_id], b
    free = [b.block_id for b in pool.free_queue]
    assert len(free) == len(set(free)) == pool.num_free_blocks
    assert set(free) == {b.block_id for b in pool.blocks[1:] if b.ref_cnt == 0}
    assert set(kv.req_blocks) == {r.request_id for r in sched.running}


def assert_all_free(sched: Scheduler) -> None:
    kv = sched.kv
    assert not sched.running and not sched.waiting and not sched.requests
    assert kv.req_blocks == {}
    assert kv.num_free_blocks == kv.pool.num_usable_blocks
    assert_pool_consistent(sched)


# -- budget, ordering, chunking ----------------------------------------------------------------


def test_token_budget_respected_and_used() -> None:
    sched = make_scheduler(num_blocks=200, budget=40)
    lens = [5, 70, 33, 1, 100, 16]
    reqs = [make_request(f"r{i}", n, max_tokens=5 + i) for i, n in enumerate(lens)]
    for r in reqs:
        sched.add_request(r)
    outs = run(sched)
    assert all(o.num_batched_tokens <= 40 for o in outs)
    assert outs[0].num_batched_tokens == 40  # the budget is the limit, not something smaller
    # Every prompt token and every output token but the last was computed exactly once.
    assert sum(o.num_batched_tokens for o in outs) == sum(n + 5 + i - 1 for i, n in enumerate(lens))
    for i, r in enumerate(reqs):
        assert r.status is RequestStatus.FINISHED_LENGTH
        assert r.num_output_tokens == 5 + i
        assert r.output_token_ids == [FILLER] * (5 + i)
    assert_all_free(sched)


def test_running_scheduled_before_waiting() -> None:
    sched = make_scheduler(budget=64)
    a = make_request("a", 10, max_tokens=8)
    sched.add_request(a)
    out, _ = step(sched)
    assert out.scheduled == [(a, 10)] and out.started == {"a"}

    b = make_request("b", 20)
    sched.add_request(b)
    out, _ = step(sched)
    assert out.scheduled == [(a, 1), (b, 20)]
    assert out.started == {"b"}
    assert [r.request_id for r in sched.running] == ["a", "b"]

    # A tight budget goes to the running request first; the newcomer gets the rest.
    sched.max_num_batched_tokens = 8
    c = make_request("c", 30)
    sched.add_request(c)
    out, _ = step(sched)
    assert out.scheduled == [(a, 1), (b, 1), (c, 6)]

    # No budget left after the running ones: nothing is admitted.
    sched.max_num_batched_tokens = 2
    d = make_request("d", 3)
    sched.add_request(d)
    out, _ = step(sched)
    assert out.scheduled == [(a, 1), (b, 1)]
    assert list(sched.waiting) == [d]


def test_fcfs_admission_order() -> None:
    sched = make_scheduler(budget=100)
    reqs = [make_request(r, 10) for r in "abc"]
    for r in reqs:
        sched.add_request(r)
    out, _ = step(sched)
    assert [r.request_id for r, _ in out.scheduled] == ["a", "b", "c"]
    assert out.started == {"a", "b", "c"}


def test_fcfs_head_of_line_blocks_smaller_requests() -> None:
    sched = make_scheduler(num_blocks=6, budget=200)  # 5 usable blocks
    r0 = make_request("r0", 40, max_tokens=40)  # 3 blocks for its prompt
    sched.add_request(r0)
    step(sched)
    assert sched.kv.num_free_blocks == 2

    big = make_request("big", 48, max_tokens=32)  # 3 blocks: does not fit now
    small = make_request("small", 5, max_tokens=4)  # would fit
    sched.add_request(big)
    sched.add_request(small)
    out, _ = step(sched)
    assert out.scheduled == [(r0, 1)]
    assert list(sched.waiting) == [big, small]

    run(sched)
    assert big.num_output_tokens == 32 and small.num_output_tokens == 4
    assert_all_free(sched)


def test_chunked_prefill_samples_only_after_last_chunk() -> None:
    sched = make_scheduler(budget=32)
    a = make_request("a", 100, max_tokens=3)
    sched.add_request(a)
    chunks, computed, blocks = [], [], []
    for _ in range(4):
        out, advanced = step(sched)
        chunks.append(out.scheduled[0][1])
        computed.append(a.num_computed_tokens)
        blocks.append(len(out.new_block_ids["a"]))
        if a.num_computed_tokens < 100:
            assert advanced == [] and a.num_output_tokens == 0
            assert a.first_token_time is None
    assert chunks == [32, 32, 32, 4]
    assert computed == [32, 64, 96, 100]
    assert blocks == [2, 2, 2, 1]
    assert advanced == [a] and a.output_token_ids == [FILLER]
    assert a.first_token_time is not None
    assert len(sched.kv.block_ids(a)) == 7

    out, _ = step(sched)
    assert out.scheduled == [(a, 1)] and out.started == set()
    out, _ = step(sched)
    assert a.status is RequestStatus.FINISHED_LENGTH and a.num_output_tokens == 3
    assert_all_free(sched)


def test_chunked_prefill_shares_budget_with_the_next_request() -> None:
    sched = make_scheduler(budget=32)
    a = make_request("a", 50, max_tokens=2)
    b = make_request("b", 10, max_tokens=2)
    sched.add_request(a)
    sched.add_request(b)
    out, _ = step(sched)
    assert out.scheduled == [(a, 32)]
    assert list(sched.waiting) == [b]
    out, advanced = step(sched)
    assert out.scheduled == [(a, 18), (b, 10)]
    assert advanced == [a, b]


def test_max_num_seqs() -> None:
    sched = make_scheduler(max_num_seqs=2, budget=256)
    reqs = [make_request(f"r{i}", 8, max_tokens=3 + i) for i in range(5)]
    for r in reqs:
        sched.add_request(r)
    out, _ = step(sched)
    assert [r.request_id for r, _ in out.scheduled] == ["r0", "r1"]
    seen_running: set[str] = set()
    while sched.has_unfinished():
        assert len(sched.running) <= 2
        seen_running.update(r.request_id for r in sched.running)
        out, _ = step(sched)
        assert len(out.scheduled) <= 2
    assert seen_running == {r.request_id for r in reqs}
    assert [r.num_output_tokens for r in reqs] == [3, 4, 5, 6, 7]
    assert_all_free(sched)


# -- preemption --------------------------------------------------------------------------------


def test_preemption_when_blocks_run_out() -> None:
    sched = make_scheduler(num_blocks=5, max_num_seqs=2, budget=256)  # 4 usable blocks
    a = make_request("a", 16, max_tokens=40)
    b = make_request("b", 16, max_tokens=40)
    c = make_request("c", 4, max_tokens=4)
    for r in (a, b, c):
        sched.add_request(r)

    out, _ = step(sched)
    assert out.started == {"a", "b"}
    while sched.stats.num_preemptions == 0:
        free_before = sched.kv.num_free_blocks
        b_tokens = list(b.all_token_ids)
        out, _ = step(sched)
    # a needed its third block with none free: the newest running request, b, gave way.
    assert free_before == 0
    assert out.preempted == ["b"]
    assert out.scheduled == [(a, 1)]
    assert len(sched.kv.block_ids(a)) == 3
    assert "b" not in sched.kv.req_blocks
    assert sched.running == [a]
    assert list(sched.waiting) == [b, c]  # b in front of the request that never ran
    assert b.status is RequestStatus.WAITING
    assert b.num_computed_tokens == 0
    assert b.num_preemptions == 1
    assert b.all_token_ids == b_tokens  # its output so far is kept, to be recomputed
    assert sched.stats.num_preemptions == 1
    assert sched.take_finished() == []  # preempted is not finished
    # After a preemption nothing new is admitted in the same step.
    assert out.started == set()
    assert_pool_consistent(sched)

    run(sched)
    assert a.num_output_tokens == 40 and b.num_output_tokens == 40 and c.num_output_tokens == 4
    assert all(r.status is RequestStatus.FINISHED_LENGTH for r in (a, b, c))
    assert_all_free(sched)


def test_preempted_request_resumes_with_fresh_block_table() -> None:
    sched = make_scheduler(num_blocks=5, max_num_seqs=2, budget=256, caching=False)
    a = make_request("a", 16, max_tokens=20)
    b = make_request("b", 16, max_tokens=40)
    sched.add_request(a)
    sched.add_request(b)
    while sched.stats.num_preemptions == 0:
        step(sched)
    n_tokens = b.num_tokens
    while True:
        out, _ = step(sched)
        if "b" in out.started:
            break
    # Resumed: the whole sequence so far is recomputed (no prefix cache here).
    (n,) = [n for r, n in out.scheduled if r is b]
    assert n == n_tokens
    assert out.new_block_ids["b"] == sched.kv.block_ids(b)
    run(sched)
    assert b.num_output_tokens == 40
    assert_all_free(sched)


def test_preemption_takes_newest_first_and_keeps_fcfs_order() -> None:
    sched = make_scheduler(num_blocks=5, max_num_seqs=4, budget=256, caching=False)  # 4 usable
    reqs = a, b, c, d = [make_request(r, 16, max_tokens=4) for r in "abcd"]
    for r in reqs:
        sched.add_request(r)
    out, _ = step(sched)
    assert out.started == {"a", "b", "c", "d"}
    assert sched.kv.num_free_blocks == 0

    # Every request now needs a 2nd block. a takes d's, the newest; b then takes c's.
    out, _ = step(sched)
    assert out.preempted == ["d", "c"]
    assert out.scheduled == [(a, 1), (b, 1)]
    assert sched.running == [a, b]
    assert list(sched.waiting) == [c, d]  # arrival order survives
    assert sched.stats.num_preemptions == 2
    assert c.num_preemptions == d.num_preemptions == 1
    assert c.num_computed_tokens == d.num_computed_tokens == 0
    assert "c" not in sched.kv.req_blocks and "d" not in sched.kv.req_blocks
    assert_pool_consistent(sched)

    run(sched)
    assert [r.num_output_tokens for r in reqs] == [4, 4, 4, 4]
    assert_all_free(sched)


def test_newest_request_that_cannot_grow_preempts_itself() -> None:
    sched = make_scheduler(num_blocks=4, max_num_seqs=2, budget=256, caching=False)  # 3 usable
    a = make_request("a", 20, max_tokens=10)  # 2 blocks, room to grow to 32 tokens
    b = make_request("b", 16, max_tokens=10)  # 1 full block
    sched.add_request(a)
    sched.add_request(b)
    out, _ = step(sched)
    assert out.started == {"a", "b"} and sched.kv.num_free_blocks == 0
    # b needs a 2nd block and is itself the newest: it gives way; a carries on.
    out, _ = step(sched)
    assert out.preempted == ["b"]
    assert out.scheduled == [(a, 1)]
    assert list(sched.waiting) == [b]
    assert b.num_computed_tokens == 0 and b.num_output_tokens == 1
    run(sched)
    assert a.num_output_tokens == 10 and b.num_output_tokens == 10
    assert_all_free(sched)


def test_no_admission_in_a_step_that_preempted() -> None:
    sched = make_scheduler(num_blocks=5, max_num_seqs=2, budget=20, caching=False)  # 4 usable
    a = make_request("a", 16, max_tokens=20)
    b = make_request("b", 48, max_tokens=4)
    sched.add_request(a)
    sched.add_request(b)
    out, _ = step(sched)
    assert out.scheduled == [(a, 16), (b, 4)]
    out, _ = step(sched)
    assert out.scheduled == [(a, 1), (b, 19)]
    assert sched.kv.num_free_blocks == 0
    # b's next chunk needs a 3rd block: it preempts itself. A 19-token chunk of b would now fit
    # in the 2 blocks it freed, but re-admitting it in the same step would only thrash.
    out, _ = step(sched)
    assert out.preempted == ["b"]
    assert out.scheduled == [(a, 1)]
    assert out.started == set()
    assert sched.kv.num_free_blocks == 2
    assert list(sched.waiting) == [b]
    # The next step takes it back.
    out, _ = step(sched)
    assert out.scheduled == [(a, 1), (b, 19)]
    assert out.started == {"b"}
    run(sched)
    assert a.num_output_tokens == 20 and b.num_output_tokens == 4
    assert_all_free(sched)


# -- stop conditions ---------------------------------------------------------------------------


def run_one(req: Request, token: int | TokenFn) -> list[SchedulerOutput]:
    sched = make_scheduler()
    sched.add_request(req)
    outs = run(sched, token=token)
    assert_all_free(sched)
    # The finished request is reported once, for the model runner to drop its state.
    assert sched.take_finished() == [req.request_id]
    assert sched.take_finished() == []
    return outs


def test_eos_stops() -> None:
    req = make_request("a", 5, max_tokens=10)
    run_one(req, sequence(FILLER, FILLER, EOS))
    assert req.output_token_ids == [FILLER, FILLER, EOS]
    assert req.status is RequestStatus.FINISHED_STOPPED
    assert req.finish_reason == "stop"
    assert req.stop_reason is None


def test_eos_ignored_with_ignore_eos() -> None:
    req = make_request("a", 5, max_tokens=5, ignore_eos=True)
    run_one(req, sequence(FILLER, EOS, EOS))
    assert req.output_token_ids == [FILLER, EOS, EOS, FILLER, FILLER]
    assert req.status is RequestStatus.FINISHED_LENGTH
    assert req.finish_reason == "length"


def test_min_tokens_suppresses_eos() -> None:
    req = make_request("a", 5, max_tokens=10, min_tokens=4)
    run_one(req, sequence(EOS, EOS, FILLER, EOS, EOS))
    assert req.output_token_ids == [EOS, EOS, FILLER, EOS]
    assert req.status is RequestStatus.FINISHED_STOPPED


def test_min_tokens_boundary() -> None:
    req = make_request("a", 5, max_tokens=10, min_tokens=2)
    run_one(req, sequence(FILLER, EOS))
    assert req.num_output_tokens == 2
    assert req.status is RequestStatus.FINISHED_STOPPED


def test_stop_token_ids_set_stop_reason() -> None:
    req = make_request("a", 5, max_tokens=10, stop_token_ids=[9, 11])
    run_one(req, sequence(FILLER, 11))
    assert req.output_token_ids == [FILLER, 11]
    assert req.status is RequestStatus.FINISHED_STOPPED
    assert req.stop_reason == 11


def test_stop_token_ids_apply_with_ignore_eos_and_respect_min_tokens() -> None:
    req = make_request("a", 5, max_tokens=10, min_tokens=3, ignore_eos=True, stop_token_ids=[9])
    run_one(req, sequence(9, EOS, 9))
    assert req.output_token_ids == [9, EOS, 9]
    assert req.stop_reason == 9
    assert req.status is RequestStatus.FINISHED_STOPPED


def test_max_tokens_finishes_with_length() -> None:
    req = make_request("a", 5, max_tokens=6)
    outs = run_one(req, FILLER)
    assert req.output_token_ids == [FILLER] * 6
    assert req.status is RequestStatus.FINISHED_LENGTH
    assert req.stop_reason is None
    assert len(outs) == 6  # one prefill step, then five decode steps


def test_stop_on_last_allowed_token_is_a_stop_not_length() -> None:
    req = make_request("a", 5, max_tokens=3)
    run_one(req, sequence(FILLER, FILLER, EOS))
    assert req.status is RequestStatus.FINISHED_STOPPED


class _EndsAfter:
    """A grammar matcher that allows no further token once it has seen `n`."""

    def __init__(self, n: int) -> None:
        self.left = n

    @property
    def terminated(self) -> bool:
        return self.left == 0

    def accept(self, token_id: int) -> None:
        self.left -= 1


def test_a_grammar_that_allows_no_further_token_is_a_stop() -> None:
    req = make_request("a", 5, max_tokens=10)
    matcher = _EndsAfter(3)
    req.grammar = matcher

    def accepted(r: Request) -> int:
        matcher.accept(FILLER)  # as the runner does when it reads the token
        return FILLER

    run_one(req, accepted)
    assert req.output_token_ids == [FILLER] * 3
    assert req.status is RequestStatus.FINISHED_STOPPED and req.stop_reason is None


@pytest.mark.parametrize("max_tokens", [None, 100])
def test_max_tokens_capped_by_max_model_len(max_tokens: int | None) -> None:
    sched = make_scheduler()
    req = make_request("a", 12, max_tokens=max_tokens, max_model_len=20)
    assert req.max_tokens == 8
    sched.add_request(req)
    run(sched)
    assert req.num_output_tokens == 8
    assert req.num_tokens == 20
    assert req.status is RequestStatus.FINISHED_LENGTH
    assert_all_free(sched)


# -- abort -------------------------------------------------------------------------------------


def test_abort_running_frees_blocks() -> None:
    sched = make_scheduler(num_blocks=10)
    a = make_request("a", 40)
    sched.add_request(a)
    step(sched)
    assert sched.kv.num_free_blocks == 9 - 3
    assert sched.abort_request("a") is a
    assert a.status is RequestStatus.FINISHED_ABORTED
    assert a.finish_reason == "abort"
    assert sched.kv.num_free_blocks == 9
    assert "a" not in sched.kv.req_blocks
    assert_all_free(sched)
    assert sched.take_finished() == ["a"]
    assert sched.abort_request("a") is None
    assert sched.take_finished() == []


def test_abort_waiting_and_unknown() -> None:
    sched = make_scheduler(max_num_seqs=1)
    a = make_request("a", 5)
    b = make_request("b", 5)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)
    assert list(sched.waiting) == [b]
    assert sched.abort_request("b") is b
    assert b.status is RequestStatus.FINISHED_ABORTED
    assert not sched.waiting
    assert sched.abort_request("nope") is None
    assert sched.take_finished() == ["b"]
    out, _ = step(sched)
    assert out.scheduled == [(a, 1)]


def test_abort_while_step_runs() -> None:
    sched = make_scheduler()
    a = make_request("a", 5)
    b = make_request("b", 5)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    sched.abort_request("a")
    advanced = sched.update(out, {"a": FILLER, "b": FILLER})
    assert advanced == [b]
    assert a.output_token_ids == [] and a.num_computed_tokens == 0
    assert a.status is RequestStatus.FINISHED_ABORTED
    assert b.output_token_ids == [FILLER]
    assert [r.request_id for r in sched.running] == ["b"]
    assert_pool_consistent(sched)


# -- async scheduling: each step launched before the previous one's tokens are read ---------


def run_async(sched: Scheduler, token: TokenFn, max_steps: int = 1000) -> list[SchedulerOutput]:
    """The engine's loop under async scheduling: step k is scheduled and advanced, and only then
    are step k-1's tokens appended."""
    outs: list[SchedulerOutput] = []
    prev: tuple[SchedulerOutput, list[Request]] | None = None
    while sched.has_unfinished():
        assert len(outs) < max_steps, f"not done after {max_steps} steps: {sched.requests}"
        out = sched.schedule()
        samplers = [req for req, n in out.scheduled if req.samples_after(n)]
        sched.advance(out)
        if prev is not None:
            sched.update(prev[0], {r.request_id: token(r) for r in prev[1]})
        sched.take_finished()
        assert_pool_consistent(sched)
        assert all(r.num_pending <= 1 for r in sched.requests.values())
        prev = out, samplers
        outs.append(out)
    return outs


def _stopping_workload(num_blocks: int) -> tuple[Scheduler, list[Request], TokenFn]:
    """Requests of mixed lengths that stop by EOS or by length, over a chunking budget."""
    sched = make_scheduler(num_blocks=num_blocks, max_num_seqs=4, budget=40)
    reqs = [
        make_request(f"r{i}", list(range(1000 + 100 * i, 1000 + 100 * i + n)), max_tokens=m)
        for i, (n, m) in enumerate([(5, 30), (37, 12), (16, 25), (60, 9), (3, 40), (20, 20)])
    ]
    stop_at = {"r0": 17, "r2": 4, "r4": 22}

    def token(req: Request) -> int:
        k = req.num_output_tokens
        return EOS if stop_at.get(req.request_id) == k else FILLER + k % 3

    for r in reqs:
        sched.add_request(r)
    return sched, reqs, token


@pytest.mark.parametrize("num_blocks", [200, 9], ids=["roomy", "preempting"])
def test_async_scheduling_produces_what_sync_scheduling_does(num_blocks: int) -> None:
    sync, sync_reqs, token = _stopping_workload(num_blocks)
    run(sync, token=token)
    sched, reqs, token = _stopping_workload(num_blocks)
    outs = run_async(sched, token)
    if num_blocks == 9:
        assert sched.stats.num_preemptions > 0
    for got, want in zip(reqs, sync_reqs, strict=True):
        assert got.output_token_ids == want.output_token_ids
        assert got.status is want.status
        # A request that stopped at length never ran a row past its last token.
        if got.status is RequestStatus.FINISHED_LENGTH:
            assert got.num_output_tokens == got.max_tokens
    # Every token but a request's last is computed once; each of the three stops by EOS may
    # cost one wasted row more (scheduled before the EOS was read).
    computed = sum(o.num_batched_tokens for o in outs)
    if num_blocks == 200:
        needed = sum(r.num_prompt_tokens + r.num_output_tokens - 1 for r in reqs)
        assert needed <= computed <= needed + 3
    assert_all_free(sched)


def test_a_last_token_in_flight_is_not_scheduled_again() -> None:
    sched = make_scheduler()
    a = make_request("a", 5, max_tokens=1)
    sched.add_request(a)
    first = sched.schedule()
    sched.advance(first)
    assert a.num_pending == 1 and a.num_computed_tokens == 5
    assert sched.schedule().empty  # its one token is on the way: nothing more to compute
    sched.update(first, {"a": FILLER})
    assert a.status is RequestStatus.FINISHED_LENGTH and a.output_token_ids == [FILLER]
    assert a.num_pending == 0
    assert_all_free(sched)


def test_the_next_step_feeds_the_token_in_flight() -> None:
    sched = make_scheduler()
    a = make_request("a", 5, max_tokens=4)
    sched.add_request(a)
    first = sched.schedule()
    sched.advance(first)
    second = sched.schedule()
    # One decode row for the token the prefill is sampling, before anyone has read it.
    assert second.scheduled == [(a, 1)] and a.num_computed_tokens == 5 and a.num_tokens == 5
    sched.advance(second)
    assert a.num_pending == 2 and a.num_computed_tokens == 6
    sched.update(first, {"a": 11})
    sched.update(second, {"a": 12})
    assert a.output_token_ids == [11, 12] and a.num_pending == 0


def test_a_request_preempted_with_a_token_in_flight_keeps_it() -> None:
    sched = make_scheduler(num_blocks=5, max_num_seqs=2, budget=256)  # 4 usable blocks
    a = make_request("a", 16, max_tokens=40)
    b = make_request("b", 16, max_tokens=40)
    sched.add_request(a)
    sched.add_request(b)
    prev = sched.schedule()
    sched.advance(prev)
    while True:
        out = sched.schedule()
        sched.advance(out)
        if out.preempted:
            break
        sched.update(prev, {"a": FILLER, "b": FILLER})
        prev = out
    assert out.preempted == ["b"]
    assert b.status is RequestStatus.WAITING and b.num_pending == 1
    known = b.num_tokens
    sched.update(prev, {"a": FILLER, "b": FILLER})
    # The token it sampled before it gave way is kept, to be recomputed with the rest.
    assert b.num_tokens == known + 1 and b.num_pending == 0 and b.num_computed_tokens == 0
    assert_pool_consistent(sched)


# -- what admission accepts ----------------------------------------------------------------------


def test_the_largest_request_admission_accepts_completes_on_its_pool() -> None:
    """The scheduler trusts admission (it checks nothing again): what admission accepts must
    run to completion on the KV cache it was admitted against."""
    sched = make_scheduler(num_blocks=5)  # 4 usable blocks: 64 tokens
    admission = admission_for(sched, max_model_len=100)
    prompt = [next(_unique_tokens) for _ in range(10)]
    with pytest.raises(InvalidRequestError, match="KV blocks"):
        admission.admit(prompt, SamplingParams(max_tokens=56))
    admitted = admission.admit(prompt, SamplingParams(max_tokens=55))
    ok = Request("ok", prompt, admitted.params, frozenset({EOS}), admitted.max_tokens)
    sched.add_request(ok)
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(make_request("ok", 3))
    assert list(sched.waiting) == [ok]
    run(sched)
    assert ok.num_output_tokens == 55
    assert_all_free(sched)


# -- prefix caching through the scheduler ------------------------------------------------------


def test_prefix_cache_hit_on_admission() -> None:
    sched = make_scheduler(budget=256)
    prompt = [next(_unique_tokens) for _ in range(40)]
    a = make_request("a", prompt, max_tokens=2)
    sched.add_request(a)
    step(sched)
    a_blocks = sched.kv.block_ids(a)
    run(sched)
    assert a.num_cached_tokens == 0

    b = make_request("b", [*prompt, 5, 6], max_tokens=2)
    sched.add_request(b)
    out, _ = step(sched)
    assert b.num_cached_tokens == 32
    assert out.scheduled == [(b, 42 - 32)]
    assert out.new_block_ids["b"][:2] == a_blocks[:2]  # a's first two blocks, reused
    assert sched.stats.prefix_cache_queries == 40 + 42
    assert sched.stats.prefix_cache_hits == 32
    run(sched)
    assert_all_free(sched)


# -- a grammar still compiling ----------------------------------------------------------------


class _Compiled:
    """What a compile job's future holds: a grammar that starts a matcher."""

    def matcher(self) -> _EndsAfter:
        return _EndsAfter(1000)


def test_a_request_steps_back_to_sample_once_its_grammar_has_compiled() -> None:
    """Its prompt runs while the grammar compiles; the engine steps it back when the grammar
    is not there to sample with, and its last position waits for it alone."""
    sched = make_scheduler(budget=64)
    compiling: Future = Future()
    a = make_request("a", 40, max_tokens=2, grammar=compiling)
    sched.add_request(a)
    out = sched.schedule()
    assert out.scheduled == [(a, 40)]
    sched.advance(out)
    assert a.num_pending == 1
    assert sched.settle_grammars(out) == []  # at sampling, still compiling: a steps back
    assert sched.update(out, {}) == [] and a.num_pending == 0 and a.num_computed_tokens == 39
    out, _ = step(sched)
    assert out.empty and a.grammar is None  # the last position alone waits
    compiling.set_result(_Compiled())
    out, advanced = step(sched)
    assert out.scheduled == [(a, 1)] and advanced == [a]
    assert isinstance(a.grammar, _EndsAfter) and a.pending_grammar is None
    run(sched)
    assert a.num_output_tokens == 2
    assert_all_free(sched)


def test_a_request_waiting_for_its_grammar_does_not_hold_up_the_queue() -> None:
    sched = make_scheduler(budget=64)
    prompt = [next(_unique_tokens) for _ in range(BS + 1)]
    sched.add_request(make_request("warm", prompt, max_tokens=1))
    run(sched)
    compiling: Future = Future()
    # Its prompt is cached but for the last token, which samples: nothing to run yet.
    a = make_request("a", prompt, grammar=compiling)
    b = make_request("b", 10, max_tokens=1)
    sched.add_request(a)
    sched.add_request(b)
    out, _ = step(sched)
    assert out.scheduled == [(b, 10)] and list(sched.waiting) == [a]
    compiling.set_result(_Compiled())
    out, _ = step(sched)
    assert out.scheduled == [(a, 1)] and a.num_cached_tokens == BS
    run(sched)
    assert_all_free(sched)


def test_a_grammar_that_failed_is_reported_and_its_request_not_run() -> None:
    sched = make_scheduler(budget=64)
    failing: Future = Future()
    a = make_request("a", 20, grammar=failing)
    b = make_request("b", 5, max_tokens=3)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    assert out.scheduled == [(a, 20), (b, 5)] and not out.failed
    sched.advance(out)
    assert sched.settle_grammars(out) == []
    sched.update(out, {"b": FILLER})
    error = ValueError("invalid regex")
    failing.set_exception(error)
    out, _ = step(sched)
    assert out.failed == [(a, error)] and out.scheduled == [(b, 1)]
    sched.finish_request(a, RequestStatus.FINISHED_ERROR)
    run(sched)
    assert b.num_output_tokens == 3
    assert_all_free(sched)


def test_a_grammar_that_fails_while_its_step_runs_is_reported_at_sampling() -> None:
    sched = make_scheduler(budget=64)
    failing: Future = Future()
    a = make_request("a", 20, grammar=failing)
    sched.add_request(a)
    out = sched.schedule()
    assert out.unready == [a]
    sched.advance(out)
    error = ValueError("invalid regex")
    failing.set_exception(error)
    assert sched.settle_grammars(out) == [(a, error)]
    assert a.num_pending == 1  # not stepped back: the engine fails it


# -- LoRA adapters: fairness between them -----------------------------------------------------

LORA_A, LORA_B = (LoRARequest(name, i, f"/adapters/{name}") for i, name in enumerate("ab", 1))


def _adapter_stream(wait_steps: int, steps: int) -> tuple[int | None, list[int]]:
    """One GPU slot, both adapters in host memory; each step a new request of adapter A and one
    of the base model arrive, and one request of B arrives after the first A's. Returns the step
    in which B's request started (None if it did not within `steps`) and, per step, how many
    base-model requests waited after it."""
    slots = AdapterSlots(max_loras=1, max_cpu_loras=2)
    for lora in (LORA_A, LORA_B):
        assert slots.make_room() == []
        slots.host(lora)
    sched = Scheduler(KVCacheManager(256, BS, True), 32, 256, slots, max_lora_wait_steps=wait_steps)
    b = make_request("b", 4, max_tokens=3, lora=LORA_B)
    started = None
    base_waiting = []
    for k in range(steps):
        sched.add_request(make_request(f"a{k}", 4, max_tokens=3, lora=LORA_A))
        sched.add_request(make_request(f"base{k}", 4, max_tokens=3))
        if k == 0:
            sched.add_request(b)
        out, _ = step(sched)
        if b.request_id in out.started:
            started = k
        base_waiting.append(sum(r.lora is None for r in sched.waiting))
    return started, base_waiting


def test_a_request_of_an_adapter_without_a_slot_starts_within_the_bound() -> None:
    """A steady stream of adapter A's requests keeps the one slot pinned: FCFS with skipping
    alone never lets B's request in; with the bound, A's new requests are held back once B has
    waited it out, A's running ones finish (3 steps each), and B takes the slot. The base
    model's requests start as they arrive throughout."""
    started, base_waiting = _adapter_stream(wait_steps=4, steps=20)
    assert started is not None and started <= 4 + 3
    assert not any(base_waiting)
    # Without the bound (never reached here), B waits for as long as A's stream goes on.
    assert _adapter_stream(wait_steps=1000, steps=20)[0] is None


def test_the_starved_adapter_is_the_first_waiting_request_past_the_bound() -> None:
    slots = AdapterSlots(max_loras=1, max_cpu_loras=1)
    sched = Scheduler(KVCacheManager(64, BS, True), 8, 64, slots, max_lora_wait_steps=2)
    b = make_request("b", 4, lora=LORA_B)
    a = make_request("a", 4, lora=LORA_A)
    for req in (b, a):
        sched.add_request(req)
    # Neither adapter is in host memory: both are passed over, B first.
    for _ in range(2):
        assert sched.starved_lora() is None
        assert step(sched)[0].empty
    assert sched.starved_lora() == LORA_B
    # A's copy in host memory and a free slot: A is still held back for B.
    slots.host(LORA_A)
    assert step(sched)[0].empty and a.lora_waited_steps == 2
    assert slots.make_room(starved=True) == [LORA_A.lora_int_id]  # only waiting requests use A
    slots.host(LORA_B)
    out, _ = step(sched)
    assert out.started == {"b"} and b.lora_waited_steps == 0
    assert sched.starved_lora() == LORA_A  # A waited out the bound too: its turn is next
    with pytest.raises(ValueError, match=">= 1"):
        Scheduler(KVCacheManager(64, BS, True), 8, 64, slots, max_lora_wait_steps=0)


# -- property: random workloads ----------------------------------------------------------------

STOP = 9
FAMILIES = [[100 * (f + 1) + i for i in range(128)] for f in range(3)]


@st.composite
def workloads(draw: st.DrawFn) -> dict:
    reqs = draw(
        st.lists(
            st.fixed_dictionaries(
                {
                    "prompt_len": st.integers(1, 48),
                    "max_tokens": st.integers(1, 40),
                    "min_tokens": st.integers(0, 4),
                    "family": st.integers(0, len(FAMILIES) - 1),
                    "tail": st.lists(st.integers(10, 12), max_size=3),
                    "arrival": st.integers(0, 6),
                    "ignore_eos": st.booleans(),
                    "stop": st.booleans(),
                    "abort_at": st.none() | st.integers(0, 40),
                }
            ),
            min_size=1,
            max_size=10,
        )
    )
    return {
        "num_blocks": draw(st.sampled_from(range(2, 15))),
        "budget": draw(st.sampled_from([1, 3, 8, 16, 17, 32, 64, 256])),
        "max_num_seqs": draw(st.sampled_from(range(1, 7))),
        "max_model_len": draw(st.sampled_from([48, 64, 128])),
        "caching": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**16)),
        "requests": reqs,
    }


class KVShadow:
    """The tokens each block slot would hold after the forward passes the scheduler ordered."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.slots: dict[int, list[int | None]] = {}
        self.ctx: dict[int, tuple[int, ...]] = {}
        self.tables: dict[str, list[int]] = {}

    def on_finished(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.tables.pop(rid, None)  # None: aborted before it ever ran

    def on_schedule(self, out: SchedulerOutput) -> None:
        kv = self.sched.kv
        for rid in out.preempted:
            self.tables.pop(rid)
        for req, _ in out.scheduled:
            rid = req.request_id
            new = out.new_block_ids[rid]
            if rid in out.started:
                assert rid not in self.tables
                num_hits = req.num_computed_tokens // BS
                self.tables[rid] = list(new)
                fresh = new[num_hits:]
            else:
                self.tables[rid] += new
                fresh = new
            assert self.tables[rid] == kv.block_ids(req), f"{req}: block table out of sync"
            for bid in fresh:
                assert bid != 0
                self.slots[bid] = [None] * BS
                self.ctx.pop(bid, None)
        assert set(self.tables) == {r.request_id for r in self.sched.running}
        # The forward pass writes K/V for the scheduled tokens...
        for req, n in out.scheduled:
            table = self.tables[req.request_id]
            toks = req.all_token_ids
            for p in range(req.num_computed_tokens, req.num_computed_tokens + n):
                bid = table[p // BS]
                assert self.slots[bid][p % BS] is None, f"{req} overwrites block {bid}"
                self.slots[bid][p % BS] = toks[p]
                if p % BS == 0:
                    self.ctx[bid] = tuple(toks[:p])
        # ...and every scheduled request reads back exactly its own tokens, hits included.
        for req, n in out.scheduled:
            self.check(req, req.num_computed_tokens + n)

    def check(self, req: Request, upto: int) -> None:
        toks = req.all_token_ids
        for i, bid in enumerate(self.tables[req.request_id]):
            end = min((i + 1) * BS, upto)
            assert self.slots[bid][: end - i * BS] == toks[i * BS : end], f"{req}: block {i}"
            assert self.ctx[bid] == tuple(toks[: i * BS]), f"{req}: block {i} prefix"


@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(workloads())
def test_random_workloads_complete(w: dict) -> None:
    mml = w["max_model_len"]
    sched = make_scheduler(
        num_blocks=w["num_blocks"],
        max_num_seqs=w["max_num_seqs"],
        budget=w["budget"],
        caching=w["caching"],
    )
    usable = sched.kv.pool.num_usable_blocks
    admission = admission_for(sched, mml)
    rng = random.Random(w["seed"])
    choices = [FILLER] * 12 + [EOS, STOP, 10, 11]

    pending: list[tuple[int, str, list[int], SamplingParams]] = []
    for i, spec in enumerate(w["requests"]):
        prompt = (FAMILIES[spec["family"]][: spec["prompt_len"]] + spec["tail"])[: mml + 4]
        params = SamplingParams(
            max_tokens=spec["max_tokens"],
            min_tokens=min(spec["min_tokens"], spec["max_tokens"]),
            ignore_eos=spec["ignore_eos"],
            stop_token_ids=[STOP] if spec["stop"] else [],
        )
        pending.append((spec["arrival"], f"r{i}", prompt, params))

    accepted: list[Request] = []
    aborted: set[str] = set()
    shadow = KVShadow(sched)
    bound = 2
    steps = 0
    while pending or sched.has_unfinished():
        for entry in [e for e in pending if e[0] <= steps]:
            pending.remove(entry)
            _, rid, prompt, params = entry
            p = len(prompt)
            max_tokens = min(params.max_tokens or mml, mml - p)
            fits = (
                0 < p < mml
                and cdiv(p + max_tokens - 1, BS) <= usable
                and params.min_tokens <= mml - p
            )
            if fits:
                admitted = admission.admit(prompt, params)
                assert admitted.max_tokens == max_tokens
                req = Request(rid, prompt, params, frozenset({EOS}), admitted.max_tokens)
                sched.add_request(req)
                accepted.append(req)
                # Each step the oldest running request computes at least one token, and it is
                # never preempted: so every request adds at most its token count in steps.
                bound += p + req.max_tokens
            else:
                with pytest.raises(InvalidRequestError):
                    admission.admit(prompt, params)
        for i, spec in enumerate(w["requests"]):
            rid = f"r{i}"
            if spec["abort_at"] == steps and rid in sched.requests:
                sched.abort_request(rid)
                aborted.add(rid)
        shadow.on_finished(sched.take_finished())

        out = sched.schedule()
        assert out.num_batched_tokens <= w["budget"]
        assert len(out.scheduled) <= w["max_num_seqs"]
        assert len(sched.running) <= w["max_num_seqs"]
        ids = [r.request_id for r, _ in out.scheduled]
        assert len(ids) == len(set(ids))
        # Running requests come first, newly started ones after.
        started_flags = [rid in out.started for rid in ids]
        assert started_flags == sorted(started_flags)
        for req, n in out.scheduled:
            assert n >= 1
            assert req.num_computed_tokens + n <= req.num_tokens
        if sched.has_unfinished():
            assert not out.empty, "a step with unfinished requests scheduled nothing"
        shadow.on_schedule(out)
        sampled = {
            req.request_id: rng.choice(choices)
            for req, n in out.scheduled
            if req.num_computed_tokens + n == req.num_tokens
        }
        sched.update(out, sampled)
        shadow.on_finished(sched.take_finished())
        assert_pool_consistent(sched)
        for req in sched.running:
            shadow.check(req, req.num_computed_tokens)
        steps += 1
        assert steps <= bound + 7, "the workload did not finish in bounded steps"

    assert_all_free(sched)
    event(f"accepted {min(len(accepted), 4)}+ requests")
    if sched.stats.num_preemptions:
        event("preemption")
    if sched.stats.prefix_cache_hits:
        event("prefix-cache hit")
    for req in accepted:
        assert req.status.finished
        if req.status is RequestStatus.FINISHED_ABORTED:
            assert req.request_id in aborted
            continue
        sp = req.sampling_params
        out_toks = req.output_token_ids
        assert 1 <= len(out_toks) <= req.max_tokens

        def is_stop(t: int, sp: SamplingParams = sp) -> bool:
            return (not sp.ignore_eos and t == EOS) or t in sp.stop_token_ids

        # No token before the last one was allowed to stop it.
        assert not any(is_stop(t) for t in out_toks[max(sp.min_tokens - 1, 0) : -1])
        last = out_toks[-1]
        if req.status is RequestStatus.FINISHED_STOPPED:
            assert is_stop(last) and len(out_toks) >= sp.min_tokens
            assert req.stop_reason == (None if last == EOS else last)
        else:
            assert req.status is RequestStatus.FINISHED_LENGTH
            assert len(out_toks) == req.max_tokens
            assert not (is_stop(last) and len(out_toks) >= sp.min_tokens)
