"""Triton RMSNorm with the residual add fused in, the twin of ``reference.rms_norm`` and of the
``engine.layers.layernorm`` RMSNorms.

Rounding follows the PyTorch twin step by step (:func:`rms_norm` says where), so results agree
to the last bit up to the order of the fp32 sum of squares. With ``quantize`` it also writes the
row in fp8 for the next linear, as ``reference.quantize_tokens`` would: one launch less per
layer input on the fp8 path, whose decode step is made of such small launches.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from kvfleet.kernels.dependent_launch import enter, pdl_args
from kvfleet.kernels.fp8_quant import store_fp8_row
from kvfleet.kernels.launch import kernel
from kvfleet.kernels.reference import FP8, FP8_MAX, MIN_SCALE


@kernel
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    new_residual_ptr,
    stride_x,
    stride_r,
    stride_o,
    stride_nr,
    n_cols,
    eps,
    scale_ptr,
    static_ptr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    ZERO_CENTRED: tl.constexpr,
    QUANTIZE: tl.constexpr,  # 0: no, 1: per-row amax, 2: the static scale
    FP8_MAX: tl.constexpr,
    MIN_SCALE: tl.constexpr,
    PDL: tl.constexpr,
):
    enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    in_dtype = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        x = (x + r).to(in_dtype)
        tl.store(new_residual_ptr + row * stride_nr + cols, x, mask=mask)
        x = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, 0) / n_cols + eps)
    x = x * inv_rms
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if ZERO_CENTRED:
        w = w + 1.0
    else:
        x = x.to(in_dtype).to(tl.float32)
    if QUANTIZE:
        # Rounded to the input dtype first: the row the unfused path would quantize.
        y = (w * x).to(in_dtype).to(tl.float32)
        store_fp8_row(y, cols, mask, row, out_ptr + row * stride_o, scale_ptr, static_ptr,
                      QUANTIZE == 2, FP8_MAX, MIN_SCALE)  # fmt: skip
    else:
        tl.store(out_ptr + row * stride_o + cols, (w * x).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor,  # [..., hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # like x
    zero_centred: bool = False,
    quantize: bool = False,
    static_scale: torch.Tensor | None = None,
) -> Any:
    """``norm(x)``, or ``(norm(x + residual), x + residual)`` when a residual is given, the sum
    rounded to x's dtype. Llama style: the normalised row is rounded to x's dtype before the
    weight multiply, and the output dtype is ``promote_types(weight.dtype, x.dtype)``; Gemma style
    (``zero_centred``): the row is scaled by ``1 + weight`` in fp32 and rounded once, to x's
    dtype. With ``quantize``, ``norm(x)`` is ``(fp8 [..., hidden], fp32 scale [rows, 1])``,
    scaled per row or by ``static_scale``; the weight must be of x's dtype. Inputs are never
    written."""
    hidden = x.shape[-1]
    assert weight.shape == (hidden,) and weight.is_contiguous(), (weight.shape, x.shape)
    x2 = x.reshape(-1, hidden)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    out_dtype = x.dtype if zero_centred else torch.promote_types(weight.dtype, x.dtype)
    if quantize:
        assert out_dtype == x.dtype, (weight.dtype, x.dtype)
        out_dtype = FP8
    out = torch.empty((rows, hidden), dtype=out_dtype, device=x.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device) if quantize else out
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype, (residual.shape, x.shape)
        r2 = residual.reshape(-1, hidden)
        if r2.stride(-1) != 1:
            r2 = r2.contiguous()
        new_residual = torch.empty((rows, hidden), dtype=x.dtype, device=x.device)
    else:
        # Never dereferenced: HAS_RESIDUAL=False compiles the residual path out.
        r2 = new_residual = x2
    if rows > 0:
        block = triton.next_power_of_2(hidden)
        _rms_norm_kernel[(rows,)](
            x2,
            r2,
            weight,
            out,
            new_residual,
            x2.stride(0),
            r2.stride(0),
            out.stride(0),
            new_residual.stride(0),
            hidden,
            eps,
            scale,
            scale if static_scale is None else static_scale,
            BLOCK=block,
            HAS_RESIDUAL=residual is not None,
            ZERO_CENTRED=zero_centred,
            QUANTIZE=0 if not quantize else 1 if static_scale is None else 2,
            FP8_MAX=FP8_MAX,
            MIN_SCALE=MIN_SCALE,
            num_warps=min(max(block // 256, 1), 16),
            **pdl_args(x.device),
        )
    out = out.view(x.shape)
    if quantize:
        out = (out, scale)
    if residual is None:
        return out
    return out, new_residual.view(x.shape)
