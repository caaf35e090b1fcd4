"""The routing kernel (kernels.expert_routing) in Triton's interpreter on the CPU, against its
twin (reference.route_experts): Mixtral's renormalised top-2 of 8 and Qwen3-MoE's unnormalised
top-8 of a count that is no power of two, logits of the model dtype, and ties. The routing and
alignment in one launch (route_and_align) against route_experts then align, up to its bound."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from kvfleet.kernels import expert_routing, fused_moe, reference


@pytest.mark.parametrize(
    ("tokens", "experts", "top_k", "renormalize", "dtype"),
    [
        (7, 8, 2, True, torch.float32),
        (5, 60, 8, False, torch.bfloat16),
        (3, 4, 4, True, torch.float32),
    ],
)
def test_route_experts_equals_the_twin(tokens, experts, top_k, renormalize, dtype):
    gen = torch.Generator().manual_seed(experts)
    logits = (torch.randn(tokens, experts, generator=gen) * 3).to(dtype)
    weights, ids = expert_routing.route_experts(logits, top_k, renormalize)
    want_weights, want_ids = reference.route_experts(logits, top_k, renormalize)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    torch.testing.assert_close(weights, want_weights, rtol=1e-6, atol=1e-7)
    # bf16 logits tie, and torch.topk orders equal values as it likes: the picks are checked
    # as a top-k (each token's own, distinct experts, of the twin's probabilities).
    picked = torch.softmax(logits.float(), dim=-1).gather(1, ids)
    if renormalize:
        picked = picked / picked.sum(dim=-1, keepdim=True)
    torch.testing.assert_close(picked, weights, rtol=1e-6, atol=1e-7)
    assert all(len(set(row)) == top_k for row in ids.tolist())
    if dtype == torch.float32:
        assert torch.equal(ids, want_ids)


def test_equal_probabilities_go_to_the_lowest_expert():
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0, 1.0, 2.0]])
    weights, ids = expert_routing.route_experts(logits, 4, renormalize=True)
    assert ids.tolist() == [[1, 3, 5, 2]]
    assert abs(float(weights.sum()) - 1.0) < 1e-6


def _route_then_align(logits, top_k, renormalize, local, block_m):
    """route_and_align's twin: the two launches it replaces, with the rank's local ids between."""
    weights, ids = expert_routing.route_experts(logits, top_k, renormalize)
    ids = ids - local.start
    ids = torch.where((ids >= 0) & (ids < len(local)), ids, -1)
    return weights, ids, *fused_moe.align(ids, len(local), block_m)


@pytest.mark.parametrize(
    ("tokens", "experts", "top_k", "renormalize", "shard", "block_m"),
    [
        (1, 128, 8, True, None, 16),  # Qwen3-30B-A3B at batch 1
        (16, 128, 8, False, None, 16),  # its largest batch in one launch: 128 pairs
        (5, 60, 4, True, (30, 60), 64),  # an expert-parallel rank's half
        (30, 256, 4, False, (64, 128), 16),  # tokens routed 8 at a time, a middle quarter
    ],
)
def test_route_and_align_equals_route_then_align(tokens, experts, top_k, renormalize, shard,
                                                 block_m):  # fmt: skip
    gen = torch.Generator().manual_seed(tokens)
    # Integer logits: many ties, broken alike (the lowest id first) by both.
    logits = torch.randint(-3, 4, (tokens, experts), generator=gen).float()
    local = range(*shard) if shard else range(experts)
    # The experts either side of the rank's share picked by some tokens (-1 here), its first
    # and last by others.
    for token, expert in enumerate((local.start - 1, local.stop, local.start, local.stop - 1)):
        if 0 <= expert < experts:
            logits[token % tokens, expert] = 10.0
    got = expert_routing.route_and_align(logits, top_k, renormalize, local, block_m)
    weights, ids, sorted_pairs, block_expert = _route_then_align(
        logits, top_k, renormalize, local, block_m
    )
    torch.testing.assert_close(got.weights, weights, rtol=0, atol=0)
    assert got.ids.dtype == torch.int64 and torch.equal(got.ids, ids)
    assert (ids == -1).any() == (shard is not None)
    assert got.sorted_pairs.shape == sorted_pairs.shape
    assert torch.equal(got.block_expert, block_expert)
    # Rows of the blocks past the last run are never written (nor read).
    used = int((block_expert >= 0).sum()) * block_m
    assert torch.equal(got.sorted_pairs[:used], sorted_pairs[:used])
    want_weights, _ = reference.route_experts(logits, top_k, renormalize)
    torch.testing.assert_close(got.weights, want_weights, rtol=1e-6, atol=1e-7)


def test_route_and_align_takes_decode_sizes_only():
    bound = expert_routing.ROUTE_ALIGN_MAX_PAIRS
    assert expert_routing.routes_and_aligns_at_once(bound // 8, 8)
    assert not expert_routing.routes_and_aligns_at_once(bound // 8 + 1, 8)
    assert not expert_routing.routes_and_aligns_at_once(0, 8)
    with pytest.raises(ValueError, match="pairs"):
        expert_routing.route_and_align(torch.randn(bound // 8 + 1, 128), 8, True, range(128), 16)
    with pytest.raises(ValueError, match="local experts"):
        expert_routing.route_and_align(torch.randn(2, 8), 2, True, range(4, 12), 16)
