"""A mixture of experts' routing in one launch: per token, the softmax of its router logits (in
fp32), its top_k experts, most probable first, and their probabilities renormalised when the
model's config says so. PyTorch takes four to five launches for it (softmax, top-k, sum,
divide), each a few microseconds at decode batch sizes, in every sparse layer. Twin of
``reference.route_experts``; equal probabilities go to the lowest expert id."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvfleet.kernels.launch import kernel


@kernel
def _route_kernel(
    logits_ptr, weights_ptr, ids_ptr, experts, stride,
    TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr, RENORMALIZE: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, E_PAD)
    x = tl.load(logits_ptr + token * stride + e, mask=e < experts, other=float("-inf"))
    x = x.to(tl.float32)
    p = tl.exp(x - tl.max(x, axis=0))
    p = p / tl.sum(p, axis=0)
    # Padding lanes are never picked: below every probability.
    left = tl.where(e < experts, p, -1.0)
    slots = tl.arange(0, K_PAD)
    weights = tl.zeros([K_PAD], dtype=tl.float32)
    ids = tl.zeros([K_PAD], dtype=tl.int32)
    for j in range(TOP_K):
        best = tl.max(left, axis=0)
        pick = tl.min(tl.where(left == best, e, E_PAD), axis=0)
        weights = tl.where(slots == j, best, weights)
        ids = tl.where(slots == j, pick, ids)
        left = tl.where(e == pick, -1.0, left)
    if RENORMALIZE:
        weights = weights / tl.sum(weights, axis=0)
    out = token * TOP_K + slots
    tl.store(weights_ptr + out, weights, mask=slots < TOP_K)
    tl.store(ids_ptr + out, ids.to(tl.int64), mask=slots < TOP_K)


def route_experts(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``reference.route_experts``: (weights fp32 [tokens, top_k], ids int64 [tokens, top_k])."""
    tokens, experts = router_logits.shape
    if not 0 < top_k <= experts:
        raise ValueError(f"top_k={top_k} of {experts} experts")
    if router_logits.stride(1) != 1:
        router_logits = router_logits.contiguous()
    weights = torch.empty((tokens, top_k), dtype=torch.float32, device=router_logits.device)
    ids = torch.empty((tokens, top_k), dtype=torch.int64, device=router_logits.device)
    if tokens:
        _route_kernel[(tokens,)](
            router_logits, weights, ids, experts, router_logits.stride(0), TOP_K=top_k,
            K_PAD=triton.next_power_of_2(top_k), E_PAD=triton.next_power_of_2(experts),
            RENORMALIZE=renormalize, num_warps=1 if experts <= 256 else 4,
        )  # fmt: skip
    return weights, ids
