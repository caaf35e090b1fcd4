"""The host KV tier on a GPU: pinned host memory, stores queued ahead of the step that reuses a
block, copies back on a side stream while other requests' steps run (CUDA graphs included).
Skipped where no GPU is visible (CI); run on a GPU machine with
`pytest -q tests/engine/test_host_kv_tier_gpu.py`."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvfleet.engine import LLM, SamplingParams
from tests.support.engine import MAX_TOKENS, assert_no_leak

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_blocks_come_back_from_pinned_memory_with_hf_tokens(model_dirs, prompts, hf_reference):
    """Two passes over prompts that overflow a 19-block device cache, all at once: the second
    finds blocks in host memory, copied back while other requests decode, and every token is
    HF's."""
    model = str(model_dirs["llama"])
    kwargs: dict[str, Any] = dict(dtype="float32", device="cuda", num_gpu_blocks_override=20,
                                  max_num_batched_tokens=48)  # fmt: skip
    llm = LLM(model, **kwargs)
    block_bytes = llm.engine.runner.block_bytes
    del llm
    llm = LLM(model, **kwargs, cpu_kv_cache_bytes=64 * block_bytes)
    core = llm.engine
    host_kv = core.runner.host_kv
    assert host_kv is not None and host_kv.host.is_pinned() and host_kv.stream is not None
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    for _ in range(2):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        assert [o.outputs[0].token_ids for o in outs] == hf_reference["llama"]
    stats = core.stats()
    assert stats.host_cache_hits > 0
    assert 0 < stats.num_host_cache_blocks <= 64
    # One at a time as well: each prompt's blocks come back with nothing else to overlap.
    for p, want in zip(prompts, hf_reference["llama"], strict=True):
        (out,) = llm.generate([{"prompt_token_ids": p}], params)
        assert out.outputs[0].token_ids == want
    assert_no_leak(llm)
    assert not core.scheduler.loading and not core.kv_cache_manager.loads
    assert core.kv_cache_manager.reset_prefix_cache()
    assert core.stats().num_host_cache_blocks == 0
