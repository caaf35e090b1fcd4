"""Structured outputs on the CUDA path: the bitmask applied on the device as on the CPU, and
constrained rows mixed with free ones through CUDA graphs (the mask is applied after the graph),
with the per-step cost of the masks against the forward printed. Skipped where no GPU is
visible (CI); run on a GPU machine with `pytest -q -s tests/engine/test_structured_gpu.py`."""

from __future__ import annotations

import json
import time

import pytest
import torch

from kvfleet.engine import LLM, SamplingParams
from kvfleet.engine.structured_output import apply_bitmask
from tests.support.engine import assert_no_leak

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

COLORS = ["red", "green", "blue"]
SCHEMA = {
    "type": "object",
    "properties": {"color": {"enum": COLORS}, "size": {"type": "integer", "maximum": 99}},
    "required": ["color", "size"],
    "additionalProperties": False,
}


def test_apply_bitmask_on_cuda_equals_the_cpu():
    rows, vocab = 32, 128256
    gen = torch.Generator().manual_seed(0)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (rows, (vocab + 31) // 32), generator=gen).int()
    logits = torch.randn(rows, vocab, generator=gen)
    on_cpu = logits.clone()
    apply_bitmask(on_cpu, bitmask)
    on_gpu = logits.cuda()
    mask_gpu = bitmask.cuda()
    apply_bitmask(on_gpu, mask_gpu)
    assert torch.equal(on_gpu.cpu(), on_cpu)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(100):
        apply_bitmask(on_gpu, mask_gpu)
    end.record()
    torch.cuda.synchronize()
    print(f"\napply_bitmask, {rows} x {vocab} on the GPU: {start.elapsed_time(end) * 10:.1f} us")
    # The same calls replayed from a CUDA graph: the device time alone, without the host's
    # launch cost (which overlaps the forward in the engine's step).
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(100):
            apply_bitmask(on_gpu, mask_gpu)
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    print(f"apply_bitmask, {rows} x {vocab}, device time: {start.elapsed_time(end) * 10:.1f} us")


def test_constrained_and_free_rows_through_cuda_graphs(model_dirs, prompts):
    llm = LLM(str(model_dirs["llama"]), dtype="float32", device="cuda")
    assert llm.engine.runner.graphs is not None
    constrained = SamplingParams(
        max_tokens=40,
        temperature=0.8,
        seed=1,
        structured_outputs={"json": SCHEMA, "disable_any_whitespace": True},
    )
    free = SamplingParams(max_tokens=40, temperature=0)
    batch = [{"prompt_token_ids": p} for p in prompts]
    alone = [o.outputs[0].token_ids for o in llm.generate(batch, free)]
    masks = llm.engine.structured.masks
    spent: list[float] = []

    def timed_masks(reqs):
        t = time.perf_counter()
        out = masks(reqs)
        spent.append(time.perf_counter() - t)
        # Pinned, so the sampler's copy to the GPU does not wait for the device.
        assert out is None or out.bitmask.is_pinned()
        return out

    llm.engine.structured.masks = timed_masks
    t0 = time.perf_counter()
    outs = llm.generate(batch * 2, [constrained] * len(batch) + [free] * len(batch))
    total = time.perf_counter() - t0
    del llm.engine.structured.masks
    for out in outs[: len(batch)]:
        c = out.outputs[0]
        value = json.loads(c.text)
        assert c.finish_reason == "stop" and value["color"] in COLORS, c.text
    assert [o.outputs[0].token_ids for o in outs[len(batch) :]] == alone
    print(
        f"\nmasks: {len(spent)} steps, {sum(spent) / len(spent) * 1e3:.3f} ms a step "
        f"({sum(spent) / total:.1%} of the run)"
    )
    assert_no_leak(llm)
