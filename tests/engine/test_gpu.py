"""The CUDA path: Triton kernels, CUDA graphs, KV sizing. Skipped where no GPU is visible (CI);
run on a GPU machine with `pytest -q tests/engine/test_gpu.py`."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from kvfleet.engine import LLM, SamplingParams
from tests.support.engine import (
    MAX_TOKENS,
    assert_no_leak,
    first_token_logprob_gaps,
    long_random_prompts,
    recorded_cascade_prefixes,
)
from tests.support.tiny_model import ALL_ARCHITECTURES

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

BENCH_MODELS = Path(__file__).resolve().parents[2] / "bench" / "models"


@pytest.mark.parametrize("arch", ALL_ARCHITECTURES)
def test_triton_path_greedy_equals_hf_in_fp32(arch, model_dirs, prompts, hf_reference):
    llm = LLM(str(model_dirs[arch]), dtype="float32", device="cuda")
    assert llm.engine.runner.backend.name == "triton"
    assert llm.engine.runner.graphs is not None
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
    )
    assert [o.outputs[0].token_ids for o in outs] == hf_reference[arch]
    assert_no_leak(llm)


def test_triton_path_under_preemption_and_chunking(model_dirs, prompts, hf_reference):
    llm = LLM(
        str(model_dirs["llama"]),
        dtype="float32",
        device="cuda",
        num_gpu_blocks_override=20,
        max_num_batched_tokens=48,
    )
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
    )
    assert [o.outputs[0].token_ids for o in outs] == hf_reference["llama"]
    assert llm.engine.stats().num_preemptions > 0
    assert_no_leak(llm)


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_shared_prefix_decode_steps_equal_hf(arch, model_dirs):
    """Twelve requests on one cached 300-token system prompt: decode steps attend to it once
    per step (cascade pass, in CUDA graphs and eagerly); Gemma 2's sliding-window layers keep
    the plain kernel. Greedy output equals HF's."""
    from kvfleet.engine import model_runner
    from tests.support.engine import hf_greedy

    rng = torch.Generator().manual_seed(11)
    system = torch.randint(3, 500, (300,), generator=rng).tolist()
    prompts = [system + torch.randint(3, 500, (n,), generator=rng).tolist() for n in range(1, 13)]
    for eager in (False, True):
        llm = LLM(str(model_dirs[arch]), dtype="float32", device="cuda", enforce_eager=eager)
        with recorded_cascade_prefixes(llm.engine.runner) as prefixes:
            llm.generate({"prompt_token_ids": system}, SamplingParams(temperature=0, max_tokens=1))
            outs = llm.generate(
                [{"prompt_token_ids": p} for p in prompts],
                SamplingParams(temperature=0, max_tokens=16),
            )
        assert [o.outputs[0].token_ids for o in outs] == hf_greedy(model_dirs[arch], prompts, 16)
        assert max(prefixes) >= model_runner.CASCADE_MIN_PREFIX
        assert_no_leak(llm)
        del llm
        gc.collect()
        torch.cuda.empty_cache()


def test_bf16_triton_logprobs_close_to_reference_on_a_real_size_model():
    """Qwen3-0.6B architecture, dummy weights, bf16: the first token's top-20 logprobs from the
    Triton path (CUDA graphs on) against the PyTorch reference path (eager)."""
    common = dict(
        model=str(BENCH_MODELS / "Qwen3-0.6B"),
        load_format="dummy",
        dtype="bfloat16",
        skip_tokenizer_init=True,
        max_model_len=2048,
        max_num_seqs=16,
        gpu_memory_utilization=0.3,
    )
    prompts = long_random_prompts()
    sp = SamplingParams(temperature=0, max_tokens=4, logprobs=20, ignore_eos=True)
    fast = LLM(**common).generate(prompts, sp)
    torch.cuda.empty_cache()
    ref = LLM(**common, attention_backend="torch", enforce_eager=True).generate(prompts, sp)
    worst = max(gap for _, gap in first_token_logprob_gaps(fast, ref))
    assert worst < 0.05, worst


def test_kv_cache_is_sized_from_gpu_memory_utilization():
    llm = LLM(
        str(BENCH_MODELS / "Qwen3-0.6B"),
        load_format="dummy",
        dtype="bfloat16",
        skip_tokenizer_init=True,
        max_model_len=4096,
        gpu_memory_utilization=0.5,
    )
    runner = llm.engine.runner
    total = torch.cuda.get_device_properties(0).total_memory
    kv_bytes = runner.num_blocks * runner.block_bytes
    assert 0.2 * total < kv_bytes < 0.5 * total
    assert torch.cuda.memory_allocated() < 0.55 * total


@pytest.mark.parametrize(
    ("arch", "pooling"),
    [
        ("qwen3", "lasttoken"),
        ("qwen3", "mean"),
        ("gpt2", "mean"),
        ("gemma2", "lasttoken"),
        ("mixtral", "lasttoken"),
        ("qwen3_moe", "mean"),
    ],
)
def test_triton_path_embeddings_equal_hf_in_fp32(arch, pooling, tmp_path, prompts):
    """The pooling runner on the GPU (Triton attention, the fused experts, no CUDA graphs), a
    long prompt in chunks, for each family: each vector HF transformers' pooled final hidden
    states."""
    from tests.support.engine import hf_embeddings
    from tests.support.tiny_model import build_tiny_embedding_model

    model = build_tiny_embedding_model(tmp_path / "embed", pooling, arch=arch)
    with LLM(str(model), dtype="float32", device="cuda", max_num_batched_tokens=48) as llm:
        assert llm.engine.runner.backend.name == "triton" and llm.engine.runner.graphs is None
        outs = llm.embed([{"prompt_token_ids": p} for p in prompts])
        for out, ref in zip(outs, hf_embeddings(model, prompts, pooling), strict=True):
            got = torch.tensor(out.outputs.embedding)
            assert (got - ref).abs().max().item() < 1e-4
        assert_no_leak(llm)
