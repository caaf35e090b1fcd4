"""Batched LoRA's Triton kernels at Llama-3.1-8B's sizes on the GPU against their PyTorch twins,
in bf16, directly and replayed from a CUDA graph (the engine's decode path). Skipped where no
GPU is visible (CI); run on one with `pytest -q tests/kernels/test_lora_gpu.py`
(bench/gpu_run.sh OUT lora-kernel)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import torch

from kvfleet.engine.layers import batched_lora
from kvfleet.kernels import lora, reference
from kvfleet.kernels.availability import triton_available

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# Llama-3.1-8B's projections: input width, output width of each slice.
PROJECTIONS = {
    "qkv": (4096, [4096, 1024, 1024]),
    "gate_up": (4096, [14336, 14336]),
    "down": (14336, [4096]),
}


def _adapters(
    num_slots: int, rank: int, k: int, widths: list[int], seed: int
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """A and B per slice in bf16, each slot's adapter of rank 8, 16 or the largest, padded with
    zeros to it; B scaled as the engine folds lora_alpha / r into it."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    ranks = [(8, 16, rank)[s % 3] for s in range(num_slots)]
    a_slices, b_slices = [], []
    for n in widths:
        a = torch.randn(num_slots, rank, k, device="cuda", generator=gen) / k**0.5
        b = torch.randn(num_slots, n, rank, device="cuda", generator=gen) * 0.5
        for s, r in enumerate(ranks):
            a[s, r:] = 0
            b[s, :, r:] = 0
        a_slices.append(a.to(torch.bfloat16))
        b_slices.append(b.to(torch.bfloat16))
    return a_slices, b_slices


def _slot_map(t: int, num_slots: int, seed: int) -> torch.Tensor:
    """Decode-sized batches mix slots token by token; a prefill-sized one holds runs of one
    request each. A fifth or so of the tokens are the base model's (-1)."""
    gen = torch.Generator().manual_seed(seed)
    if t <= 256:
        slots = torch.randint(-1, num_slots, (t,), generator=gen)
        slots[torch.rand(t, generator=gen) < 0.15] = -1
    else:
        ends = [*sorted(torch.randint(1, t, (15,), generator=gen).tolist()), t]
        slots, start = torch.empty(t, dtype=torch.long), 0
        for end in ends:
            slots[start:end] = int(torch.randint(-1, num_slots, (1,), generator=gen))
            start = end
    return slots.to(torch.int32).cuda()


AddLoRA = Callable[
    [
        torch.Tensor,
        Sequence[torch.Tensor],
        Sequence[torch.Tensor],
        torch.Tensor,
        torch.Tensor,
        Sequence[int],
    ],
    None,
]
KERNELS: AddLoRA = lora.add_lora_slices
ENGINE: AddLoRA = batched_lora.add_lora_slices
TWIN: AddLoRA = reference.add_lora_slices


def _run(
    x: torch.Tensor,
    a_slices: list[torch.Tensor],
    b_slices: list[torch.Tensor],
    slots: torch.Tensor,
    out: torch.Tensor,
    add: AddLoRA,
) -> None:
    """One projection's LoRA: the slices side by side into out."""
    offsets = [sum(b.shape[1] for b in b_slices[:i]) for i in range(len(b_slices))]
    add(x, a_slices, b_slices, slots, out, offsets)


def _assert_matches_twin(
    x: torch.Tensor,
    a_slices: list[torch.Tensor],
    b_slices: list[torch.Tensor],
    slots: torch.Tensor,
    base_out: torch.Tensor,
) -> None:
    out, want = base_out.clone(), base_out.clone()
    _run(x, a_slices, b_slices, slots, out, KERNELS)
    _run(x, a_slices, b_slices, slots, want, TWIN)
    base = slots == -1
    assert torch.isfinite(out).all()
    assert torch.equal(out[base], base_out[base])  # the base model's rows untouched
    # The kernels' bf16 y rounds the same fp32 sums in another order (split-K partials): a
    # last-bit difference at most, and the deltas added to out within bf16's rounding of them.
    delta, want_delta = (out - base_out).float(), (want - base_out).float()
    assert (delta - want_delta).norm() <= 1e-2 * want_delta.norm() + 1e-3


@pytest.mark.parametrize("t", [1, 64, 2048])
@pytest.mark.parametrize(("num_slots", "rank"), [(8, 16), (16, 64)])
@pytest.mark.parametrize("projection", sorted(PROJECTIONS))
def test_kernels_match_twins_at_llama_8b_sizes(
    projection: str, num_slots: int, rank: int, t: int
) -> None:
    k, widths = PROJECTIONS[projection]
    a_slices, b_slices = _adapters(num_slots, rank, k, widths, seed=rank + t)
    gen = torch.Generator(device="cuda").manual_seed(t)
    x = torch.randn(t, k, device="cuda", generator=gen).to(torch.bfloat16)
    base_out = torch.randn(t, sum(widths), device="cuda", generator=gen).to(torch.bfloat16)
    _assert_matches_twin(x, a_slices, b_slices, _slot_map(t, num_slots, t), base_out)


def test_kernels_replay_from_a_cuda_graph_as_the_slot_map_changes() -> None:
    """A decode step's qkv LoRA captured once, replayed with new inputs and slot maps in the
    captured tensors: mixed, all on the base model, all on one adapter. Through the engine's
    entry, which must pick the kernels here."""
    assert triton_available()
    k, widths = PROJECTIONS["qkv"]
    num_slots, rank, t = 16, 64, 32
    a_slices, b_slices = _adapters(num_slots, rank, k, widths, seed=3)
    x = torch.zeros(t, k, device="cuda", dtype=torch.bfloat16)
    out = torch.zeros(t, sum(widths), device="cuda", dtype=torch.bfloat16)
    slots = torch.full((t,), -1, device="cuda", dtype=torch.int32)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _run(x, a_slices, b_slices, slots, out, ENGINE)  # compiles before capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _run(x, a_slices, b_slices, slots, out, ENGINE)
    gen = torch.Generator(device="cuda").manual_seed(5)
    maps = [
        _slot_map(t, num_slots, 7),
        torch.full((t,), -1, dtype=torch.int32, device="cuda"),
        torch.full((t,), num_slots - 1, dtype=torch.int32, device="cuda"),
    ]
    for slot_map in maps:
        x.copy_(torch.randn(t, k, device="cuda", generator=gen))
        base_out = torch.randn(t, sum(widths), device="cuda", generator=gen).to(torch.bfloat16)
        out.copy_(base_out)
        slots.copy_(slot_map)
        graph.replay()
        want = base_out.clone()
        _run(x, a_slices, b_slices, slots, want, TWIN)
        delta, want_delta = (out - base_out).float(), (want - base_out).float()
        assert (delta - want_delta).norm() <= 1e-2 * want_delta.norm() + 1e-3
        assert torch.equal(out[slots == -1], base_out[slots == -1])
