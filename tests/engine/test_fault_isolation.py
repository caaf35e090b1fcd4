"""One request cannot take the engine down: a failure planted in one request's sampling or
detokenization fails that request alone (RequestFailedError; its KV blocks freed) while a
concurrent request completes exactly as it would alone; out-of-range sampling parameters are
refused before they reach the sampler; abort_all ends every stream and frees every block."""

from __future__ import annotations

import asyncio
import math

import pytest
from pydantic import ValidationError

from kvfleet.engine.async_engine import (
    AsyncEngine,
    EngineDeadError,
    RequestAbortedError,
    RequestFailedError,
)
from kvfleet.engine.config import EngineArgs
from kvfleet.engine.detokenizer import IncrementalDetokenizer
from kvfleet.engine.engine_core import EngineCore
from kvfleet.engine.llm import LLM
from kvfleet.engine.outputs import RequestOutput
from kvfleet.engine.sampler import Sampler
from kvfleet.engine.sampling_params import SEED_MAX, SEED_MIN, SamplingParams, child_seed
from tests.support.engine import assert_no_leak

# The planted faults pick their victim by this seed (greedy requests never use their seed) or
# this stop string (which the tiny model never produces), and strike at its third token: by
# then it holds KV blocks and has streamed output.
POISON_SEED = 4242
POISON_STOP = "\x00poison"
STRIKE_AT = 2
VICTIM = [7, 99, 250, 3, 18, 402, 61]
BYSTANDER = [5, 17, 99, 3, 250, 42, 7, 311, 64, 12, 480, 33, 2, 91]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


class PlantedFault(RuntimeError):
    pass


@pytest.fixture
def poisoned_sampling(monkeypatch):
    prepare = Sampler._prepare

    def planted(self, req, row):
        if req.sampling_params.seed == POISON_SEED and req.num_output_tokens == STRIKE_AT:
            raise PlantedFault("planted in the penalty state")
        return prepare(self, req, row)

    monkeypatch.setattr(Sampler, "_prepare", planted)


@pytest.fixture
def poisoned_detokenizer(monkeypatch):
    add_token = IncrementalDetokenizer.add_token

    def planted(self, token_id):
        self.seen_tokens = getattr(self, "seen_tokens", 0) + 1
        if POISON_STOP in self.stop and self.seen_tokens > STRIKE_AT:
            raise PlantedFault("planted in the detokenizer")
        return add_token(self, token_id)

    monkeypatch.setattr(IncrementalDetokenizer, "add_token", planted)


def _victim(fault: str, n: int = 1) -> SamplingParams:
    # Penalties give it sampler state that must go with it.
    update: dict = {"n": n, "repetition_penalty": 1.2}
    if fault == "sampling":
        update["seed"] = POISON_SEED
    else:
        update["stop"] = [POISON_STOP]
    return GREEDY.model_copy(update=update)


def _kv_idle(core: EngineCore) -> bool:
    stats = core.stats()
    return core.num_requests == 0 and stats.num_free_blocks == stats.num_usable_blocks


# -- the offline front end (EngineCore driven in this thread) ------------------------------


@pytest.fixture(scope="module")
def llm(model_dirs) -> LLM:
    return LLM(str(model_dirs["llama"]), dtype="float32")


@pytest.fixture(scope="module")
def alone(llm) -> list[int]:
    """The bystander's greedy tokens with nothing else in the engine."""
    out = llm.generate({"prompt_token_ids": BYSTANDER}, GREEDY)[0]
    assert_no_leak(llm)
    return out.outputs[0].token_ids


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("fault", ["sampling", "detokenization"])
def test_a_planted_fault_fails_one_request_and_the_others_complete(
    llm, alone, fault, n, request, caplog
):
    request.getfixturevalue(f"poisoned_{'sampling' if fault == 'sampling' else 'detokenizer'}")
    prompts = [{"prompt_token_ids": VICTIM}, {"prompt_token_ids": BYSTANDER}]
    with caplog.at_level("ERROR", logger="kvfleet.engine.output_processor"):
        victim, bystander = llm.generate(prompts, [_victim(fault, n), GREEDY])

    assert victim.finished and victim.error == f"{fault} failed: planted in the " + (
        "penalty state" if fault == "sampling" else "detokenizer"
    )
    # With n > 1 the whole request fails, every choice of it.
    assert [c.finish_reason for c in victim.outputs] == ["error"] * n
    assert all(len(c.token_ids) <= STRIKE_AT for c in victim.outputs)
    assert bystander.error is None
    assert bystander.outputs[0].token_ids == alone
    assert bystander.outputs[0].finish_reason == "length"
    # Logged once, with its traceback, whatever n.
    logged = [r for r in caplog.records if "failed: planted" in r.getMessage()]
    assert len(logged) == 1 and logged[0].exc_info is not None
    assert_no_leak(llm)
    assert not llm.engine.runner.sampler._penalties  # held by the victim until it failed

    # The engine goes on: the same request, now unpoisoned, runs as before.
    again = llm.generate({"prompt_token_ids": BYSTANDER}, GREEDY)[0]
    assert again.outputs[0].token_ids == alone
    assert_no_leak(llm)


def test_a_fault_in_the_batched_sampling_ops_is_not_blamed_on_a_request(llm, monkeypatch):
    """Only per-request work is isolated: an error in a batched op belongs to every request
    and must still surface (the async front end marks the engine dead on it)."""

    def broken(self, logits, rows):
        raise PlantedFault("batched")

    monkeypatch.setattr(Sampler, "_choose", broken)
    with pytest.raises(PlantedFault):
        llm.generate({"prompt_token_ids": BYSTANDER}, GREEDY)
    monkeypatch.undo()
    assert_no_leak(llm)


# -- bounds the sampler needs --------------------------------------------------------------


@pytest.mark.parametrize(
    "params",
    [
        {"seed": 2**64},
        {"seed": SEED_MIN - 1},
        {"seed": 2**64 - 1, "n": 2},
        {"top_k": 2**63},
        {"temperature": math.nan},
        {"top_p": math.nan},
        {"presence_penalty": math.inf},
        {"repetition_penalty": -math.inf},
        {"min_p": math.nan},
        {"n": 129},
        {"logprobs": 21},
        {"max_tokens": 2**31},
        {"min_tokens": 2**63},
        {"stop_token_ids": [-1]},
        {"stop": ["x"] * 17},
        {"stop": ["x" * 1025]},
        {"stop": [""]},
    ],
)
def test_sampling_params_out_of_range_are_refused(params):
    with pytest.raises(ValidationError):
        SamplingParams(**params)


def test_bounds_that_depend_on_the_model_are_refused_before_queueing(llm):
    core = llm.engine
    assert core.vocab_size == 512
    cases = {
        "top_k": SamplingParams(top_k=513),
        "stop_token_ids": SamplingParams(stop_token_ids=[3, 512]),
        "min_tokens": SamplingParams(min_tokens=10_000, max_tokens=20_000),
    }
    for name, sp in cases.items():
        with pytest.raises(ValueError, match=name):
            core.admit(BYSTANDER, sp)
        with pytest.raises(ValueError, match=name):
            llm.generate({"prompt_token_ids": BYSTANDER}, sp)
    assert_no_leak(llm)
    core.admit(BYSTANDER, SamplingParams(top_k=512, stop_token_ids=[511]))


def test_child_seeds_wrap_within_the_64_bit_range(llm):
    assert [child_seed(SEED_MAX, i) for i in range(3)] == [SEED_MAX, SEED_MIN, SEED_MIN + 1]
    assert child_seed(5, 2) == 7
    sp = SamplingParams(seed=SEED_MAX, n=3, max_tokens=8, ignore_eos=True)
    together = llm.generate({"prompt_token_ids": BYSTANDER}, sp)[0]
    # Each child is the n=1 request with its derived seed.
    for i, choice in enumerate(together.outputs):
        one = sp.model_copy(update={"n": 1, "seed": child_seed(SEED_MAX, i)})
        alone = llm.generate({"prompt_token_ids": BYSTANDER}, one)[0]
        assert choice.token_ids == alone.outputs[0].token_ids
        assert len(choice.token_ids) == 8
    for seed in (SEED_MIN, -1):
        out = llm.generate({"prompt_token_ids": BYSTANDER}, sp.model_copy(update={"seed": seed}))
        assert [len(c.token_ids) for c in out[0].outputs] == [8, 8, 8]
    assert_no_leak(llm)


# -- the async front end -------------------------------------------------------------------


@pytest.fixture(scope="module")
def core(model_dirs) -> EngineCore:
    return EngineCore(EngineArgs(model=str(model_dirs["llama"]), dtype="float32"))


async def _collect(engine: AsyncEngine, rid: str, ids: list[int], sp: SamplingParams):
    result: RequestOutput | None = None
    async for delta in engine.generate(rid, engine.core.admit(ids, sp)):
        if result is None:
            result = delta
        else:
            result.add(delta)
    assert result is not None and result.finished
    return result


async def _wait_idle(core: EngineCore, engine: AsyncEngine | None = None) -> None:
    """Until every request has left the engine (and, given the engine, none is still on its
    way to the engine thread) and every KV block is free."""
    async with asyncio.timeout(10):
        while not _kv_idle(core) or (engine is not None and engine.num_waiting_sequences):
            await asyncio.sleep(0.01)


@pytest.mark.asyncio
@pytest.mark.parametrize("fault", ["sampling", "detokenization"])
async def test_async_engine_fails_the_request_alone(core, fault, request):
    request.getfixturevalue(f"poisoned_{'sampling' if fault == 'sampling' else 'detokenizer'}")
    engine = AsyncEngine(core)
    engine.start()
    try:
        reference = await _collect(engine, "ref", BYSTANDER, GREEDY)
        victim = asyncio.create_task(_collect(engine, "victim", VICTIM, _victim(fault, n=2)))
        bystander = asyncio.create_task(_collect(engine, "bystander", BYSTANDER, GREEDY))
        with pytest.raises(RequestFailedError, match=f"^{fault} failed: planted"):
            await victim
        out = await bystander
        assert out.outputs[0].token_ids == reference.outputs[0].token_ids
        await _wait_idle(core)
        assert engine.is_healthy() and engine.num_unfinished == 0
        after = await _collect(engine, "after", BYSTANDER, GREEDY)
        assert after.outputs[0].token_ids == reference.outputs[0].token_ids
        await _wait_idle(core)
    finally:
        await engine.stop()


@pytest.mark.asyncio
async def test_async_engine_refuses_out_of_range_params_and_stays_healthy(core):
    engine = AsyncEngine(core)
    engine.start()
    try:
        for sp in (SamplingParams(top_k=513), SamplingParams(stop_token_ids=[600])):
            with pytest.raises(ValueError):
                await _collect(engine, "bad", BYSTANDER, sp)
        sp = SamplingParams(seed=SEED_MAX, n=3, max_tokens=6, ignore_eos=True)
        out = await _collect(engine, "wrapping-seeds", BYSTANDER, sp)
        assert [len(c.token_ids) for c in out.outputs] == [6, 6, 6]
        assert engine.is_healthy()
        await _wait_idle(core)
    finally:
        await engine.stop()


@pytest.mark.asyncio
async def test_a_batched_fault_still_kills_the_loop(core, monkeypatch):
    def broken(self, logits, rows):
        raise PlantedFault("batched")

    monkeypatch.setattr(Sampler, "_choose", broken)
    engine = AsyncEngine(core)
    engine.start()
    try:
        with pytest.raises(EngineDeadError, match="the engine loop died"):
            await _collect(engine, "doomed", BYSTANDER, GREEDY)
        assert not engine.is_alive()
    finally:
        await engine.stop()
        monkeypatch.undo()
        # Leave the shared core as the next test expects it.
        for rid in list(core.output_processor._parents):
            core.abort_request(rid)


@pytest.mark.asyncio
async def test_abort_all_ends_every_stream_and_frees_every_block(core):
    engine = AsyncEngine(core)
    engine.start()
    try:
        long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        streams = [engine.generate(f"r{i}", core.admit(BYSTANDER[: 4 + i], long)) for i in range(4)]
        for s in streams:
            await anext(s)  # each is running and holds blocks
        assert core.stats().kv_cache_usage_perc > 0
        engine.abort_all("the server is shutting down")
        assert engine.num_unfinished == 0
        async with asyncio.timeout(5):
            for s in streams:
                with pytest.raises(RequestAbortedError, match="the server is shutting down"):
                    async for _ in s:
                        pass
        await _wait_idle(core)
        assert core.stats().kv_cache_usage_perc == 0.0
        assert not core.runner.rows
        assert engine.is_healthy()
        out = await _collect(engine, "after", BYSTANDER, GREEDY)
        assert out.outputs[0].finish_reason == "length"
    finally:
        await engine.stop()


@pytest.mark.asyncio
async def test_num_waiting_sequences_counts_every_child_until_it_runs(core):
    engine = AsyncEngine(core)
    engine.start()
    try:
        assert engine.num_waiting_sequences == 0
        engine.fault_stall.set()  # the loop takes requests in but schedules none
        sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        tasks = [
            asyncio.create_task(
                _collect(engine, "three", BYSTANDER, sp.model_copy(update={"n": 3}))
            ),
            asyncio.create_task(_collect(engine, "two", VICTIM, sp.model_copy(update={"n": 2}))),
        ]
        await asyncio.sleep(0)  # the streams send their requests
        # Counted from the moment they are sent, whether or not the engine thread took them.
        assert engine.num_waiting_sequences == 5
        async with asyncio.timeout(5):
            while core.scheduler.num_waiting < 5:
                await asyncio.sleep(0.01)
        assert engine.num_waiting_sequences == 5
        engine.fault_stall.clear()
        await asyncio.gather(*tasks)
        assert engine.num_waiting_sequences == 0
        # Requests aborted while still waiting leave no count behind either.
        engine.fault_stall.set()
        task = asyncio.create_task(_collect(engine, "w", BYSTANDER, sp.model_copy(update={"n": 4})))
        await asyncio.sleep(0)
        assert engine.num_waiting_sequences == 4
        engine.abort_all("draining")
        with pytest.raises(RequestAbortedError):
            await task
        engine.fault_stall.clear()
        await _wait_idle(core, engine)
        assert core.scheduler.num_waiting == 0
    finally:
        engine.fault_stall.clear()
        await engine.stop()
