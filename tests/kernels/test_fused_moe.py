"""The fused mixture-of-experts kernels (kernels.fused_moe) in Triton's interpreter on the CPU,
against their twin (reference.fused_experts) at tiny sizes, fp32 activations: the alignment of
the pairs by expert, experts with no tokens, ids of -1, top-k of 1 and more, token counts and
widths that no block divides, both activations, and fp8 weights with activations of the model
dtype (W8A16) or quantized to fp8 (W8A8). Real sizes, bf16 and CUDA graphs are in
tests/engine/test_moe_gpu.py."""

from __future__ import annotations

import dataclasses
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from kvfleet.engine.layers.fp8 import quantize_rows
from kvfleet.engine.layers.moe import route
from kvfleet.kernels import expert_routing, fused_moe, reference

TILE = fused_moe.MoeTile(block_m=16, block_n=32, block_k=32, group_m=2, num_warps=4, num_stages=2)


def _experts(gen: torch.Generator, experts: int, hidden: int, inter: int):
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    down = torch.randn(experts, hidden, inter, generator=gen) / inter**0.5
    return gate_up, down


# 128 experts: 32 pairs at a time. 100 pairs: in 4 programs of 32 pairs, or 2 of 64 (32 at a
# time); 24 pairs: one program that counts them itself.
@pytest.mark.parametrize(("tokens", "programs"), [(50, 64), (50, 2), (12, 64)])
def test_align_sorts_each_experts_pairs_into_padded_blocks(tokens, programs, monkeypatch):
    monkeypatch.setattr(fused_moe, "ALIGN_CHUNKS", programs)
    gen = torch.Generator().manual_seed(0)
    experts, top_k, block_m = 128, 2, 16  # most experts idle
    _, ids = route(torch.randn(tokens, experts, generator=gen) * 3, top_k, True)
    ids[::7, 1] = -1
    ids[: tokens // 2, 0] = 5  # one crowded expert (at 50 tokens, more than a block)
    sorted_pairs, block_expert = fused_moe.align(ids, experts, block_m)
    pairs = tokens * top_k
    assert sorted_pairs.shape == (fused_moe.max_padded_rows(pairs, experts, block_m),)
    assert block_expert.shape == (sorted_pairs.shape[0] // block_m,)

    flat = ids.flatten()
    counts = torch.bincount(flat[flat >= 0], minlength=experts)
    used = int(((counts + block_m - 1) // block_m).sum())
    assert (block_expert[used:] == -1).all()
    expected_blocks = [e for e in range(experts) for _ in range(-(-int(counts[e]) // block_m))]
    assert block_expert[:used].tolist() == expected_blocks
    runs = sorted_pairs[: used * block_m].view(used, block_m)
    for e in range(experts):
        run = runs[block_expert[:used] == e].flatten().tolist()
        # The expert's pairs in order (a stable sort), then the sentinel up to the block's end.
        mine = (flat == e).nonzero().flatten().tolist()
        assert run == mine + [pairs] * (len(run) - len(mine))


@pytest.mark.parametrize(
    ("tokens", "experts", "top_k", "hidden", "inter", "activation", "skip"),
    [
        (1, 4, 1, 64, 32, "silu", False),  # decode, top-1
        (5, 8, 2, 64, 32, "gelu_pytorch_tanh", True),  # most experts idle, slots on other ranks
        (37, 6, 3, 48, 40, "silu", True),  # no dimension a multiple of its block
    ],
)
def test_fused_experts_equals_the_twin(tokens, experts, top_k, hidden, inter, activation, skip):
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=gen)
    gate_up, down = _experts(gen, experts, hidden, inter)
    weights, ids = route(torch.randn(tokens, experts, generator=gen), top_k, True)
    if skip:
        ids = ids.masked_fill(ids % 3 == 1, -1)
    got = fused_moe.fused_experts(x, gate_up, down, weights, ids, activation, tile=TILE)
    want = reference.fused_experts(x, gate_up, down, weights, ids, activation)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_fused_experts_runs_on_the_routings_aligned_pairs():
    """route_and_align's sorted pairs in place of fused_experts' own align (an expert-parallel
    rank holding experts 4-7): the twin's output."""
    tokens, experts, top_k, hidden, inter = 3, 8, 2, 64, 32
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(tokens, hidden, generator=gen)
    gate_up, down = _experts(gen, experts // 2, hidden, inter)
    logits = torch.randn(tokens, experts, generator=gen)
    routing = expert_routing.route_and_align(logits, top_k, True, range(4, 8), TILE.block_m)
    aligned = (routing.sorted_pairs, routing.block_expert)
    got = fused_moe.fused_experts(
        x, gate_up, down, routing.weights, routing.ids, "silu", tile=TILE, aligned=aligned
    )
    weights, ids = reference.route_experts(logits, top_k, True)
    ids = torch.where(ids >= 4, ids - 4, -1)
    assert (ids == -1).any() and (ids >= 0).any()
    want = reference.fused_experts(x, gate_up, down, weights, ids, "silu")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="aligned pairs"):
        other = dataclasses.replace(TILE, block_m=64)
        fused_moe.fused_experts(x, gate_up, down, weights, ids, "silu", tile=other, aligned=aligned)


def _fp8_operands(tokens: int, experts: int, top_k: int, hidden: int, inter: int, skip: bool):
    gen = torch.Generator().manual_seed(tokens)
    # Tokens of very different magnitudes: a row's scale applied to the wrong row shows.
    x = torch.randn(tokens, hidden, generator=gen) * torch.logspace(-1, 1, tokens)[:, None]
    gate_up, down = _experts(gen, experts, hidden, inter)
    # Channels of very different magnitudes: a scale applied to the wrong column shows.
    gate_up = gate_up * torch.logspace(-2, 1, 2 * inter)[None, :, None]
    down = down * torch.logspace(1, -2, experts)[:, None, None]
    (gate_up_q, gate_up_scale), (down_q, down_scale) = (
        (q.view(w.shape), s.view(w.shape[:2]))
        for w in (gate_up, down)
        for q, s in [quantize_rows(w.reshape(-1, w.shape[-1]))]
    )
    weights, ids = route(torch.randn(tokens, experts, generator=gen), top_k, True)
    if skip:
        ids = ids.masked_fill(ids % 3 == 1, -1)
    return x, gate_up_q, down_q, weights, ids, "silu", gate_up_scale, down_scale


def test_fused_experts_with_fp8_weights_equals_the_twin():
    args = _fp8_operands(9, 4, 2, 64, 32, skip=False)
    got = fused_moe.fused_experts(*args, tile=TILE)
    want = reference.fused_experts(*args)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


# Row blocks of 16 put the weight tile on the MMA's row side (swap AB), of 64 the pairs.
@pytest.mark.parametrize(
    ("tokens", "experts", "top_k", "hidden", "inter", "skip", "block_m"),
    [
        (9, 4, 2, 64, 32, False, 16),
        (37, 6, 3, 48, 40, True, 16),  # no K a multiple of the block, slots on other ranks
        (37, 6, 3, 48, 40, True, 64),
    ],
)
def test_fused_experts_w8a8_equals_the_twin(tokens, experts, top_k, hidden, inter, skip, block_m,
                                            monkeypatch):  # fmt: skip
    args = _fp8_operands(tokens, experts, top_k, hidden, inter, skip)
    tile = dataclasses.replace(TILE, block_m=block_m)
    want = reference.fused_experts(*args, fp8_activations=True)
    # The interpreter's fp8 cast does not round to nearest (tests/kernels/test_fp8_quant.py),
    # so the kernel quantizes x and act(gate) * up with the twin's function here; on a GPU
    # the Triton quantization rounds alike (tests/engine/test_moe_gpu.py).
    monkeypatch.setattr(fused_moe, "quantize_tokens", reference.quantize_tokens)
    got = fused_moe.fused_experts(*args, fp8_activations=True, tile=tile)
    scale = float(want.abs().max())
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * scale)
    # A real comparison: quantizing the activations moves the result far more than that.
    w8a16 = reference.fused_experts(*args)
    assert float((w8a16 - want).abs().max()) > 1e-3 * scale


def test_fused_experts_refuses_mismatched_operands():
    gen = torch.Generator().manual_seed(2)
    gate_up, down = _experts(gen, 4, 32, 16)
    weights, ids = route(torch.randn(3, 4, generator=gen), 2, True)
    with pytest.raises(ValueError, match="hidden size 32"):
        fused_moe.fused_experts(torch.randn(3, 16), gate_up, down, weights, ids, "silu")
    with pytest.raises(ValueError, match="need gate_up_scale"):
        fused_moe.fused_experts(
            torch.randn(3, 32), gate_up.to(reference.FP8), down.to(reference.FP8), weights, ids,
            "silu",
        )  # fmt: skip
    x, weights, ids = torch.randn(3, 32), *route(torch.randn(3, 4, generator=gen), 2, True)
    for fused in (fused_moe.fused_experts, reference.fused_experts):
        with pytest.raises(ValueError, match=r"W8A8\) need fp8 experts"):
            fused(x, gate_up, down, weights, ids, "silu", fp8_activations=True)


def test_tile_buckets_cover_every_token_count():
    bounds = [bound for bound, _ in fused_moe.TILES]
    assert bounds == sorted(bounds)
    assert fused_moe.tile_for(1) == fused_moe.TILES[0][1]
    assert fused_moe.tile_for(bounds[0]) == fused_moe.TILES[0][1]
    assert fused_moe.tile_for(bounds[0] + 1) == fused_moe.TILES[1][1]
    assert fused_moe.tile_for(1 << 40) == fused_moe.TILES[-1][1]
