"""LoRA adapters in the engine, against HF transformers + PEFT (fp32, CPU, greedy): adapters of
different ranks and target modules and the base model mixed in one batch; adapters evicted and
loaded again through one GPU slot; the prefix cache kept apart per adapter; two
tensor-parallel ranks generating what one does."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvfleet.engine import LLM, LoRARequest, SamplingParams
from kvfleet.engine.llm import TokensPrompt
from tests.support.engine import assert_no_leak, hf_greedy
from tests.support.lora_adapters import write_test_adapters

MAX_TOKENS = 12
# Lengths on and off the 16-token blocks, the longest two blocks and more.
PROMPTS = [
    [5, 17, 99, 3, 250, 42, 7, 311, 64, 12],
    [480, 33, 2, 91, 150, 77, 8, 402, 19, 6, 300, 11, 40, 70, 90, 100, 3, 9],
    [15, 25, 35, 45, 55, 65, 75, 85],
    [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30,
     31, 32, 33, 34, 35, 36, 37, 38, 39, 40],
]  # fmt: skip


@pytest.fixture(scope="module")
def adapters(model_dirs, tmp_path_factory) -> list[LoRARequest]:
    return write_test_adapters(model_dirs["llama"], tmp_path_factory.mktemp("adapters"))


@pytest.fixture(scope="module")
def expected(model_dirs, adapters) -> dict[str | None, list[list[int]]]:
    """HF + PEFT's greedy tokens for every prompt, per adapter (None: the base model)."""
    base = model_dirs["llama"]
    out: dict[str | None, list[list[int]]] = {None: hf_greedy(base, PROMPTS, MAX_TOKENS)}
    for lora in adapters:
        out[lora.lora_name] = hf_greedy(base, PROMPTS, MAX_TOKENS, lora_dir=Path(lora.lora_path))
    # Each adapter changes the base model's output: the comparisons below can fail.
    for lora in adapters:
        assert out[lora.lora_name] != out[None], lora.lora_name
    return out


def _mixed(adapters: list[LoRARequest]) -> list[LoRARequest | None]:
    """Per prompt, in turn: each adapter and the base model, two rounds."""
    cycle: list[LoRARequest | None] = [*adapters, None]
    return [cycle[i % len(cycle)] for i in range(2 * len(cycle))]


def _run(llm: LLM, loras: list[LoRARequest | None]) -> list[list[int]]:
    prompts = [TokensPrompt(prompt_token_ids=PROMPTS[i % len(PROMPTS)]) for i in range(len(loras))]
    outs = llm.generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), lora_request=loras
    )
    return [o.outputs[0].token_ids for o in outs]


def _want(expected, loras: list[LoRARequest | None]) -> list[list[int]]:
    return [
        expected[None if lora is None else lora.lora_name][i % len(PROMPTS)]
        for i, lora in enumerate(loras)
    ]


def _llm(model_dirs, **kwargs) -> LLM:
    return LLM(str(model_dirs["llama"]), device="cpu", dtype="float32", enable_lora=True,
               skip_tokenizer_init=True, **kwargs)  # fmt: skip


def test_adapters_and_the_base_model_in_one_batch_match_peft(model_dirs, adapters, expected):
    loras = _mixed(adapters)
    with _llm(model_dirs, max_loras=3) as llm:
        assert _run(llm, loras) == _want(expected, loras)
        assert_no_leak(llm)
        slots = llm.engine.lora_slots
        assert slots is not None and not slots.pins
        assert sum(slots.stats.loads.values()) == 3  # each loaded once, none evicted


def test_one_slot_pages_adapters_in_and_out(model_dirs, adapters, expected):
    """--max-loras 1 with three adapters: requests of an adapter wait for the slot while
    another's run, the base model's go on; host memory holds two, so one is read from disk
    again. Chunked prefill (a 24-token budget) and a cache small enough to preempt."""
    loras = _mixed(adapters)
    with _llm(model_dirs, max_loras=1, max_cpu_loras=2, max_num_batched_tokens=24,
              num_gpu_blocks_override=8, max_num_seqs=4) as llm:  # fmt: skip
        # Twice: the second round reads the first adapter from disk again.
        for _ in range(2):
            assert _run(llm, loras) == _want(expected, loras)
        assert_no_leak(llm)
        assert llm.engine.stats().num_preemptions > 0
        assert llm.engine.lora_slots is not None
        stats = llm.engine.lora_slots.stats
        assert sum(stats.evictions.values()) >= 4
        assert stats.disk_reads[adapters[0].lora_name] == 2
        assert len(llm.engine.runner.lora_host) == 2


def test_the_prefix_cache_is_kept_apart_per_adapter(model_dirs, adapters):
    prompt = [TokensPrompt(prompt_token_ids=PROMPTS[3])]  # two full blocks and more
    sp = SamplingParams(temperature=0.0, max_tokens=2)
    first, second = adapters[:2]
    with _llm(model_dirs, max_loras=2) as llm:
        assert llm.generate(prompt, sp, lora_request=first)[0].num_cached_tokens == 0
        assert llm.generate(prompt, sp, lora_request=second)[0].num_cached_tokens == 0
        assert llm.generate(prompt, sp)[0].num_cached_tokens == 0
        assert llm.generate(prompt, sp, lora_request=first)[0].num_cached_tokens == 32
        assert llm.generate(prompt, sp)[0].num_cached_tokens == 32


def test_two_ranks_generate_what_one_does(model_dirs, adapters, expected):
    """Column-parallel layers hold their rows of B, row-parallel ones their columns of A."""
    loras = _mixed(adapters)[:4]
    with _llm(model_dirs, max_loras=2, tensor_parallel_size=2) as llm:
        assert _run(llm, loras) == _want(expected, loras)
