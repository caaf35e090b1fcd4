"""Greedy outputs equal HF transformers token for token, on every supported architecture (the
Llama family, GPT-2, Gemma 2, the mixtures of experts Mixtral and Qwen3-MoE), also when
preemption, chunked prefill or the prefix cache are in play."""

from __future__ import annotations

import pytest

from kvfleet.engine import LLM, SamplingParams
from tests.support.engine import MAX_TOKENS, assert_no_leak, hf_greedy
from tests.support.tiny_model import ALL_ARCHITECTURES, MOE_ARCHITECTURES, build_tiny_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
EVERY_ARCHITECTURE = ALL_ARCHITECTURES + MOE_ARCHITECTURES


def _generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("arch", EVERY_ARCHITECTURE)
def test_greedy_equals_hf(arch, model_dirs, prompts, hf_reference):
    llm = LLM(str(model_dirs[arch]), dtype="float32")
    assert _generate(llm, prompts) == hf_reference[arch]
    assert llm.engine.stats().num_preemptions == 0
    assert_no_leak(llm)


@pytest.mark.parametrize("arch", EVERY_ARCHITECTURE)
def test_greedy_equals_hf_under_preemption(arch, model_dirs, prompts, hf_reference):
    # 19 usable blocks hold one 232-token sequence (15 blocks) but never the whole batch.
    llm = LLM(str(model_dirs[arch]), dtype="float32", num_gpu_blocks_override=20)
    assert _generate(llm, prompts) == hf_reference[arch]
    assert llm.engine.stats().num_preemptions > 0
    assert_no_leak(llm)


@pytest.mark.parametrize("arch", EVERY_ARCHITECTURE)
def test_greedy_equals_hf_with_chunked_prefill(arch, model_dirs, prompts, hf_reference):
    budget = 48
    assert max(map(len, prompts)) > budget
    llm = LLM(str(model_dirs[arch]), dtype="float32", max_num_batched_tokens=budget)
    batched: list[int] = []
    partial_prefills = 0
    schedule = llm.engine.scheduler.schedule

    def spy():
        nonlocal partial_prefills
        out = schedule()
        batched.append(out.num_batched_tokens)
        # Read now: the requests move on once the step has run.
        partial_prefills += sum(
            req.num_computed_tokens + n < req.num_prompt_tokens for req, n in out.scheduled
        )
        return out

    llm.engine.scheduler.schedule = spy
    assert _generate(llm, prompts) == hf_reference[arch]
    assert max(batched) <= budget
    assert partial_prefills > 0
    assert_no_leak(llm)


@pytest.mark.parametrize("arch", ["llama", *MOE_ARCHITECTURES])
def test_prefix_cache_hit_equals_uncached_run(arch, model_dirs, prompts):
    path = str(model_dirs[arch])
    prefix = prompts[-1][:64]
    first, second = [*prefix, 11, 12, 13], [*prefix, 21, 22, 23, 24, 25]

    uncached = LLM(path, dtype="float32", enable_prefix_caching=False)
    expected = _generate(uncached, [second])
    assert uncached.generate({"prompt_token_ids": second}, GREEDY)[0].num_cached_tokens == 0

    llm = LLM(path, dtype="float32")
    llm.generate({"prompt_token_ids": first}, GREEDY)
    out = llm.generate({"prompt_token_ids": second}, GREEDY)[0]
    assert out.num_cached_tokens >= 64
    assert out.outputs[0].token_ids == expected[0]
    stats = llm.engine.stats()
    assert stats.prefix_cache_hits >= 64
    assert_no_leak(llm)
    assert_no_leak(uncached)


def test_prefix_cache_evicts_under_pressure_and_reuses_blocks(model_dirs, prompts):
    llm = LLM(str(model_dirs["llama"]), dtype="float32", num_gpu_blocks_override=20)
    pool = llm.engine.kv_cache_manager.pool
    shared = prompts[-1][:64]
    few = SamplingParams(temperature=0.0, max_tokens=4)

    llm.generate({"prompt_token_ids": [*shared, 1]}, few)
    cached_ids = {b.block_id for b in pool.cached.values()}
    assert len(cached_ids) >= 4
    hit = llm.generate({"prompt_token_ids": [*shared, 2]}, few)[0]
    assert hit.num_cached_tokens == 64

    # Fill the pool with unrelated prompts: the shared prefix must be evicted, its blocks reused.
    for i in range(3):
        other = [(t * 7 + i) % 497 + 3 for t in prompts[-1][:150]]
        llm.generate({"prompt_token_ids": other}, few)
    assert len(pool.cached) <= pool.num_usable_blocks
    assert llm.generate({"prompt_token_ids": [*shared, 3]}, few)[0].num_cached_tokens < 64
    reused = {b.block_id for b in pool.cached.values()}
    assert cached_ids & reused, "evicted blocks were never handed out again"
    assert_no_leak(llm)


def test_tied_sharded_llama3_rope_checkpoint(tmp_path, prompts):
    path = build_tiny_model(
        tmp_path / "llama3",
        "llama",
        tie_word_embeddings=True,
        max_shard_size="100KB",
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256,
        },
    )
    assert (path / "model.safetensors.index.json").is_file()
    assert len(list(path.glob("*.safetensors"))) > 1
    llm = LLM(str(path), dtype="float32")
    assert _generate(llm, prompts) == hf_greedy(path, prompts, MAX_TOKENS)
    assert_no_leak(llm)


def test_sliding_window_mistral(tmp_path, prompts):
    path = build_tiny_model(tmp_path / "mistral-sw", "mistral", sliding_window=24)
    llm = LLM(str(path), dtype="float32")
    assert _generate(llm, prompts) == hf_greedy(path, prompts, MAX_TOKENS)
    assert_no_leak(llm)
