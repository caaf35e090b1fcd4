"""`--kv-cache-dtype fp8` on the GPU (Triton kernels, CUDA graphs, cascade) at a real model's
shapes: the block count against a bf16 cache in the same memory, and the first token's logprobs
against the bf16 cache's. Skipped where no GPU of compute capability 8.9+ is visible (CI); run on
one with `pytest -q -s tests/engine/test_fp8_kv_gpu.py` (bench/gpu_run.sh OUT check)."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from kvfleet.engine import LLM, SamplingParams
from tests.support.engine import first_token_logprob_gaps, long_random_prompts

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="needs a CUDA GPU of compute capability 8.9+",
)

QWEN3 = Path(__file__).resolve().parents[2] / "bench" / "models" / "Qwen3-0.6B"


def _run(kv_cache_dtype: str, **extra) -> tuple[list, int, list[float]]:
    """Outputs, KV blocks and the layers' k/v scales of one engine, its memory freed after."""
    prompts = long_random_prompts()
    sp = SamplingParams(temperature=0, max_tokens=4, logprobs=20, ignore_eos=True)
    with LLM(
        model=str(QWEN3), load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True,
        max_model_len=2048, max_num_seqs=16, gpu_memory_utilization=0.3,
        kv_cache_dtype=kv_cache_dtype, **extra,
    ) as llm:  # fmt: skip
        outs = llm.generate(prompts, sp)
        runner = llm.engine.runner
        assert runner.graphs is not None and not runner.kv_scales_pending
        blocks = runner.num_blocks
        scales = [float(s) for a in runner.model.attention_layers() for s in (a.k_scale, a.v_scale)]
    del llm, runner
    gc.collect()
    torch.cuda.empty_cache()
    return outs, blocks, scales


def test_fp8_cache_logprobs_close_to_bf16_and_twice_the_blocks():
    """Dummy weights give K/V of ~1e-2, deep in e4m3's subnormals at scale 1.0, so the scales
    are calibrated on the first batch (which runs eagerly; later steps replay CUDA graphs that
    read the calibrated scales). The first token's top-20 logprobs within 0.1 nats of the bf16
    cache's (the assertion's message and the printout give the measured gaps)."""
    bf16, bf16_blocks, _ = _run("auto")
    fp8, fp8_blocks, scales = _run("fp8", calculate_kv_scales=True)
    assert all(s != 1.0 and s > 0 for s in scales), scales
    gaps = first_token_logprob_gaps(fp8, bf16)
    print(f"fp8 vs bf16 KV cache, first-token top-20 logprobs: {gaps}; blocks {fp8_blocks} vs "
          f"{bf16_blocks}")  # fmt: skip
    assert max(gap for _, gap in gaps) < 0.1, gaps
    assert min(shared for shared, _ in gaps) >= 10, gaps
    # The same memory budget (the weights and activations do not change): twice the blocks.
    assert 1.9 < fp8_blocks / bf16_blocks < 2.1, (fp8_blocks, bf16_blocks)
