"""Triton rotary embedding (rotate-half style), applied in place to q and k in one launch.
Twin of ``reference.apply_rotary``; unfused, rotary costs about a dozen small kernels a layer,
which at batch 1 decode is a large share of the step."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvfleet.kernels.dependent_launch import enter, pdl_args
from kvfleet.kernels.launch import kernel


@kernel
def _rotary_kernel(
    q_ptr,
    k_ptr,
    pos_ptr,
    cos_ptr,
    sin_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_table,
    num_q_heads,
    num_k_heads,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    PDL: tl.constexpr,
):
    enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, HALF)
    cos = tl.load(cos_ptr + pos * stride_table + d)[None, :]
    sin = tl.load(sin_ptr + pos * stride_table + d)[None, :]
    h = tl.arange(0, BLOCK_H)[:, None]

    q_mask = h < num_q_heads
    q1_ptrs = q_ptr + t * stride_qt + h * stride_qh + d[None, :]
    q1 = tl.load(q1_ptrs, mask=q_mask, other=0.0).to(tl.float32)
    q2 = tl.load(q1_ptrs + HALF, mask=q_mask, other=0.0).to(tl.float32)
    tl.store(q1_ptrs, (q1 * cos - q2 * sin).to(q_ptr.dtype.element_ty), mask=q_mask)
    tl.store(q1_ptrs + HALF, (q2 * cos + q1 * sin).to(q_ptr.dtype.element_ty), mask=q_mask)

    k_mask = h < num_k_heads
    k1_ptrs = k_ptr + t * stride_kt + h * stride_kh + d[None, :]
    k1 = tl.load(k1_ptrs, mask=k_mask, other=0.0).to(tl.float32)
    k2 = tl.load(k1_ptrs + HALF, mask=k_mask, other=0.0).to(tl.float32)
    tl.store(k1_ptrs, (k1 * cos - k2 * sin).to(k_ptr.dtype.element_ty), mask=k_mask)
    tl.store(k1_ptrs + HALF, (k2 * cos + k1 * sin).to(k_ptr.dtype.element_ty), mask=k_mask)


def apply_rotary(
    q: torch.Tensor,  # [tokens, heads, head_dim], last dim contiguous
    k: torch.Tensor,  # [tokens, kv_heads, head_dim]
    positions: torch.Tensor,  # [tokens]
    cos: torch.Tensor,  # [max_pos, head_dim] fp32, halves duplicated
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates q and k in place and returns them."""
    tokens, num_q, head_dim = q.shape
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and cos.stride(-1) == 1
    assert head_dim % 2 == 0 and (head_dim // 2) & (head_dim // 2 - 1) == 0, head_dim
    if tokens:
        _rotary_kernel[(tokens,)](
            q,
            k,
            positions,
            cos,
            sin,
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            cos.stride(0),
            num_q,
            k.shape[1],
            HALF=head_dim // 2,
            BLOCK_H=triton.next_power_of_2(max(num_q, k.shape[1])),
            num_warps=4,
            **pdl_args(q.device),
        )
    return q, k
