"""The routing kernel (kernels.expert_routing) in Triton's interpreter on the CPU, against its
twin (reference.route_experts): Mixtral's renormalised top-2 of 8 and Qwen3-MoE's unnormalised
top-8 of a count that is no power of two, logits of the model dtype, and ties."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from kvfleet.kernels import expert_routing, reference


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
