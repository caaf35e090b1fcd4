"""Triton rotary embedding (rotate-half style), applied in place to q and k in one launch, with
the per-head q/k RMSNorms of the families that have them (Qwen3) fused in front. Twin of
``reference.apply_rotary``; unfused, rotary costs about a dozen small kernels a layer, and the
two norms a launch each, which at batch 1 decode is a large share of the step."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvfleet.kernels.dependent_launch import enter, pdl_args
from kvfleet.kernels.launch import kernel
from kvfleet.kernels.reference import QKNorm


@triton.jit
def _norm_heads(
    x1, x2, w_ptr, d, eps, HALF: tl.constexpr, ZERO_CENTRED: tl.constexpr, dtype: tl.constexpr
):
    """Each row (a head; its halves x1, x2 in fp32) RMS-normalised and scaled by the weight,
    rounded to ``dtype`` as the rms_norm kernel rounds its output, so the rotation that follows
    sees what the unfused norm would have written."""
    inv_rms = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF) + eps)[:, None]
    w1 = tl.load(w_ptr + d).to(tl.float32)[None, :]
    w2 = tl.load(w_ptr + HALF + d).to(tl.float32)[None, :]
    x1 = x1 * inv_rms
    x2 = x2 * inv_rms
    if ZERO_CENTRED:
        w1 = w1 + 1.0
        w2 = w2 + 1.0
    else:
        x1 = x1.to(dtype).to(tl.float32)
        x2 = x2.to(dtype).to(tl.float32)
    return (w1 * x1).to(dtype).to(tl.float32), (w2 * x2).to(dtype).to(tl.float32)


@kernel
def _rotary_kernel(
    q_ptr,
    k_ptr,
    pos_ptr,
    cos_ptr,
    sin_ptr,
    q_weight_ptr,
    k_weight_ptr,
    eps,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_table,
    num_q_heads,
    num_k_heads,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    QK_NORM: tl.constexpr,
    ZERO_CENTRED: tl.constexpr,
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
    q_dtype = q_ptr.dtype.element_ty
    q1_ptrs = q_ptr + t * stride_qt + h * stride_qh + d[None, :]
    q1 = tl.load(q1_ptrs, mask=q_mask, other=0.0).to(tl.float32)
    q2 = tl.load(q1_ptrs + HALF, mask=q_mask, other=0.0).to(tl.float32)
    if QK_NORM:
        q1, q2 = _norm_heads(q1, q2, q_weight_ptr, d, eps, HALF, ZERO_CENTRED, q_dtype)
    tl.store(q1_ptrs, (q1 * cos - q2 * sin).to(q_dtype), mask=q_mask)
    tl.store(q1_ptrs + HALF, (q2 * cos + q1 * sin).to(q_dtype), mask=q_mask)

    k_mask = h < num_k_heads
    k_dtype = k_ptr.dtype.element_ty
    k1_ptrs = k_ptr + t * stride_kt + h * stride_kh + d[None, :]
    k1 = tl.load(k1_ptrs, mask=k_mask, other=0.0).to(tl.float32)
    k2 = tl.load(k1_ptrs + HALF, mask=k_mask, other=0.0).to(tl.float32)
    if QK_NORM:
        k1, k2 = _norm_heads(k1, k2, k_weight_ptr, d, eps, HALF, ZERO_CENTRED, k_dtype)
    tl.store(k1_ptrs, (k1 * cos - k2 * sin).to(k_dtype), mask=k_mask)
    tl.store(k1_ptrs + HALF, (k2 * cos + k1 * sin).to(k_dtype), mask=k_mask)


def apply_rotary(
    q: torch.Tensor,  # [tokens, heads, head_dim], last dim contiguous
    k: torch.Tensor,  # [tokens, kv_heads, head_dim]
    positions: torch.Tensor,  # [tokens]
    cos: torch.Tensor,  # [max_pos, head_dim] fp32, halves duplicated
    sin: torch.Tensor,
    qk_norm: QKNorm | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates q and k in place and returns them; with ``qk_norm``, normalises each head first
    (in place too, so the norms' weights must be of q's and k's dtype)."""
    tokens, num_q, head_dim = q.shape
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and cos.stride(-1) == 1
    assert head_dim % 2 == 0 and (head_dim // 2) & (head_dim // 2 - 1) == 0, head_dim
    if qk_norm is not None:
        for w, x in ((qk_norm.q_weight, q), (qk_norm.k_weight, k)):
            assert w.shape == (head_dim,) and w.is_contiguous(), (w.shape, head_dim)
            assert w.dtype == x.dtype, (w.dtype, x.dtype)
    if tokens:
        _rotary_kernel[(tokens,)](
            q,
            k,
            positions,
            cos,
            sin,
            # Never dereferenced without QK_NORM, which compiles the norms out.
            q if qk_norm is None else qk_norm.q_weight,
            k if qk_norm is None else qk_norm.k_weight,
            0.0 if qk_norm is None else qk_norm.eps,
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            cos.stride(0),
            num_q,
            k.shape[1],
            HALF=head_dim // 2,
            BLOCK_H=triton.next_power_of_2(max(num_q, k.shape[1])),
            QK_NORM=qk_norm is not None,
            ZERO_CENTRED=qk_norm is not None and qk_norm.zero_centred,
            num_warps=4,
            **pdl_args(q.device),
        )
    return q, k
