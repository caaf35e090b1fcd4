"""A mixture of experts' routing in one launch: per token, the softmax of its router logits (in
fp32), its top_k experts, most probable first, and their probabilities renormalised when the
model's config says so. PyTorch takes four to five launches for it (softmax, top-k, sum,
divide), each a few microseconds at decode batch sizes, in every sparse layer. Twin of
``reference.route_experts``; equal probabilities go to the lowest expert id.

At decode sizes (``ROUTE_ALIGN_MAX_PAIRS``) ``route_and_align`` also sorts the pairs by expert
in the same launch, as kernels.fused_moe.align does in its own: one program routes every token,
then aligns the pairs it wrote. Its twin is route_experts, the rank's local ids, then align."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvfleet.kernels.dependent_launch import enter, pdl_args
from kvfleet.kernels.fused_moe import AlignLayout, align_one_program
from kvfleet.kernels.launch import kernel

# The (token, slot) pairs up to which route_and_align runs in one program. Its serial work grows
# with pairs x experts (the one-hot counts and ranks of align's single chunk), while the launches
# it saves (route's and align's one or two) stay the same: past a few decode tokens the parallel
# launches win. Qwen3-30B-A3B (top-8): 16 tokens; Mixtral (top-2): 64.
ROUTE_ALIGN_MAX_PAIRS = 128

# A [tokens, E_PAD] tile of logits this many entries at most stays in registers.
_ROUTE_TILE = 2048


@triton.jit
def _top_k(
    x, experts, TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr,
    RENORMALIZE: tl.constexpr,
):  # fmt: skip
    """(weights fp32 [rows, K_PAD], ids int32 [rows, K_PAD]) of the logits x [rows, E_PAD]
    (-inf past `experts`): each row's top_k by softmax, the first of equal ones the lowest id."""
    e = tl.arange(0, E_PAD)[None, :]
    x = x.to(tl.float32)
    p = tl.exp(x - tl.max(x, axis=1, keep_dims=True))
    p = p / tl.sum(p, axis=1, keep_dims=True)
    # Padding lanes are never picked: below every probability.
    left = tl.where(e < experts, p, -1.0)
    slots = tl.arange(0, K_PAD)[None, :]
    weights = tl.zeros([x.shape[0], K_PAD], dtype=tl.float32)
    ids = tl.zeros([x.shape[0], K_PAD], dtype=tl.int32)
    for j in range(TOP_K):
        best = tl.max(left, axis=1, keep_dims=True)
        pick = tl.min(tl.where(left == best, e, E_PAD), axis=1, keep_dims=True)
        weights = tl.where(slots == j, best, weights)
        ids = tl.where(slots == j, pick, ids)
        left = tl.where(e == pick, -1.0, left)
    if RENORMALIZE:
        weights = weights / tl.sum(weights, axis=1, keep_dims=True)
    return weights, ids


@kernel
def _route_kernel(
    logits_ptr, weights_ptr, ids_ptr, experts, stride,
    TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr, RENORMALIZE: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    enter(PDL)
    token = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, E_PAD)[None, :]
    x = tl.load(logits_ptr + token * stride + e, mask=e < experts, other=float("-inf"))
    weights, ids = _top_k(x, experts, TOP_K, K_PAD, E_PAD, RENORMALIZE)
    slots = tl.arange(0, K_PAD)[None, :]
    out = token * TOP_K + slots
    tl.store(weights_ptr + out, weights, mask=slots < TOP_K)
    tl.store(ids_ptr + out, ids.to(tl.int64), mask=slots < TOP_K)


@kernel
def _route_align_kernel(
    logits_ptr, weights_ptr, ids_ptr, sorted_ptr, block_expert_ptr, tokens, experts, stride,
    first, local, chunk_size, max_blocks, TOP_K: tl.constexpr, K_PAD: tl.constexpr,
    E_PAD: tl.constexpr, RENORMALIZE: tl.constexpr, TOKENS_AT_ONCE: tl.constexpr,
    BLOCK_M: tl.constexpr, SUB: tl.constexpr, L_PAD: tl.constexpr, BLOCKS_AT_ONCE: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    enter(PDL)
    e = tl.arange(0, E_PAD)[None, :]
    slots = tl.arange(0, K_PAD)[None, :]
    for t0 in range(0, tokens, TOKENS_AT_ONCE):
        t = (t0 + tl.arange(0, TOKENS_AT_ONCE))[:, None]
        # Rows past the last token are zeros (routed, not stored): no -inf - -inf.
        x = tl.load(logits_ptr + t * stride + e, mask=(t < tokens) & (e < experts), other=0.0)
        x = tl.where(e < experts, x, float("-inf"))
        weights, ids = _top_k(x, experts, TOP_K, K_PAD, E_PAD, RENORMALIZE)
        # This rank's experts [first, first + local) as indices into its weights, -1 for
        # another rank's (kernels.fused_moe leaves those pairs out).
        ids = ids - first
        ids = tl.where((ids >= 0) & (ids < local), ids, -1)
        out = t * TOP_K + slots
        mask = (t < tokens) & (slots < TOP_K)
        tl.store(weights_ptr + out, weights, mask=mask)
        tl.store(ids_ptr + out, ids.to(tl.int64), mask=mask)
    # align reads the ids back as pairs: every thread's stores before any thread's loads (a
    # barrier orders global memory within the program).
    tl.debug_barrier()
    align_one_program(
        ids_ptr, sorted_ptr, block_expert_ptr, tokens * TOP_K, local, chunk_size, max_blocks,
        BLOCK_M, SUB, L_PAD, BLOCKS_AT_ONCE,
    )  # fmt: skip


def _check(router_logits: torch.Tensor, top_k: int) -> torch.Tensor:
    experts = router_logits.shape[1]
    if not 0 < top_k <= experts:
        raise ValueError(f"top_k={top_k} of {experts} experts")
    return router_logits if router_logits.stride(1) == 1 else router_logits.contiguous()


def route_experts(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``reference.route_experts``: (weights fp32 [tokens, top_k], ids int64 [tokens, top_k])."""
    router_logits = _check(router_logits, top_k)
    tokens, experts = router_logits.shape
    weights = torch.empty((tokens, top_k), dtype=torch.float32, device=router_logits.device)
    ids = torch.empty((tokens, top_k), dtype=torch.int64, device=router_logits.device)
    if tokens:
        _route_kernel[(tokens,)](
            router_logits, weights, ids, experts, router_logits.stride(0), TOP_K=top_k,
            K_PAD=triton.next_power_of_2(top_k), E_PAD=triton.next_power_of_2(experts),
            RENORMALIZE=renormalize, num_warps=1 if experts <= 256 else 4,
            **pdl_args(router_logits.device),
        )  # fmt: skip
    return weights, ids


@dataclass(frozen=True)
class AlignedRouting:
    """A call's routing with its pairs sorted for kernels.fused_moe.fused_experts."""

    weights: torch.Tensor  # fp32 [tokens, top_k]
    ids: torch.Tensor  # int64 [tokens, top_k]: indices into the rank's experts, -1 for others'
    sorted_pairs: torch.Tensor  # int32 [max_padded_rows]: align's
    block_expert: torch.Tensor  # int32 [blocks]: align's


def routes_and_aligns_at_once(tokens: int, top_k: int) -> bool:
    return 0 < tokens * top_k <= ROUTE_ALIGN_MAX_PAIRS


def route_and_align(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, local: range, block_m: int
) -> AlignedRouting:
    """route_experts, its ids made indices into the rank's experts ``local`` (a range of the
    global ids, -1 outside it), and fused_moe.align(ids, len(local), block_m), in one launch:
    the same buffers, of the same shapes per token count. For tokens * top_k up to
    ROUTE_ALIGN_MAX_PAIRS."""
    router_logits = _check(router_logits, top_k)
    tokens, experts = router_logits.shape
    if not routes_and_aligns_at_once(tokens, top_k):
        raise ValueError(
            f"route_and_align: {tokens} tokens x top_k {top_k} is not 1 to "
            f"{ROUTE_ALIGN_MAX_PAIRS} pairs"
        )
    if local.step != 1 or not 0 <= local.start < local.stop <= experts:
        raise ValueError(f"route_and_align: local experts {local} of {experts}")
    device = router_logits.device
    pairs = tokens * top_k
    layout = AlignLayout.of(pairs, len(local), block_m)
    routing = AlignedRouting(
        weights=torch.empty((tokens, top_k), dtype=torch.float32, device=device),
        ids=torch.empty((tokens, top_k), dtype=torch.int64, device=device),
        sorted_pairs=torch.empty(layout.rows, dtype=torch.int32, device=device),
        block_expert=torch.empty(layout.rows // block_m, dtype=torch.int32, device=device),
    )
    e_pad = triton.next_power_of_2(experts)
    _route_align_kernel[(1,)](
        router_logits, routing.weights, routing.ids, routing.sorted_pairs, routing.block_expert,
        tokens, experts, router_logits.stride(0), local.start, len(local),
        triton.cdiv(pairs, layout.sub) * layout.sub, routing.block_expert.shape[0], TOP_K=top_k,
        K_PAD=triton.next_power_of_2(top_k), E_PAD=e_pad, RENORMALIZE=renormalize,
        TOKENS_AT_ONCE=max(1, min(triton.next_power_of_2(tokens), _ROUTE_TILE // e_pad)),
        BLOCK_M=block_m, SUB=layout.sub, L_PAD=layout.e_pad, BLOCKS_AT_ONCE=layout.at_once,
        num_warps=4, **pdl_args(device),
    )  # fmt: skip
    return routing
