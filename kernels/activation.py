"""Triton gated activations for MLPs: out = act(gate) * up, where the input holds gate and up side
by side. One kernel instead of the three (SiLU) to nine (tanh GELU) PyTorch launches, which a
small model's decode step at low batch cannot hide. Twin of ``reference.act_and_mul``; computes
in fp32 and rounds once. With ``quantize`` the rounded row is also quantized per row (or by a
static scale) for an fp8 down projection, as ``reference.quantize_tokens`` would: one launch
instead of two."""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from kvfleet.kernels.dependent_launch import enter, pdl_args
from kvfleet.kernels.fp8_quant import row_launch, row_scale, store_fp8_row, to_fp8
from kvfleet.kernels.launch import kernel
from kvfleet.kernels.reference import FP8, FP8_MAX, GATED_ACTIVATIONS, MIN_SCALE


@triton.jit
def gated(gate, up, ACTIVATION: tl.constexpr):
    """act(gate) * up in fp32, for any kernel that fuses a gated MLP's activation."""
    if ACTIVATION == "silu":  # the names are reference.GATED_ACTIVATIONS' keys
        act = gate / (1.0 + tl.exp(-gate))
    else:
        # 0.5 g (1 + tanh(u)) = g sigmoid(2u): no tanh needed, and exact at both tails.
        u = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        act = gate / (1.0 + tl.exp(-2.0 * u))
    return act * up


@triton.jit
def _act_and_mul_row(x_row, cols, mask, d, ACTIVATION: tl.constexpr):
    gate = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_row + d + cols, mask=mask, other=0.0).to(tl.float32)
    return gated(gate, up, ACTIVATION)


@kernel
def _act_and_mul_kernel(
    x_ptr, out_ptr, stride_x, stride_o, d,
    ACTIVATION: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    y = _act_and_mul_row(x_ptr + row * stride_x, cols, mask, d, ACTIVATION)
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@kernel
def _act_and_mul_quant_kernel(
    x_ptr, out_ptr, scale_ptr, static_ptr, stride_x, stride_o, d,
    ACTIVATION: tl.constexpr, STATIC: tl.constexpr, FP8_MAX: tl.constexpr,
    MIN_SCALE: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    # One program a row: its amax is needed before any value is written. A row that fits
    # (fp8_quant.row_launch) is computed once and kept in registers; a wider one twice.
    enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    round_to = x_ptr.dtype.element_ty
    out_row = out_ptr + row * stride_o
    if d <= BLOCK:
        cols = tl.arange(0, BLOCK)
        mask = cols < d
        y = _act_and_mul_row(x_row, cols, mask, d, ACTIVATION).to(round_to).to(tl.float32)
        store_fp8_row(y, cols, mask, row, out_row, scale_ptr, static_ptr, STATIC, FP8_MAX,
                      MIN_SCALE)  # fmt: skip
    else:
        amax = tl.full([BLOCK], 0.0, tl.float32)
        if not STATIC:
            for start in range(0, d, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                y = _act_and_mul_row(x_row, cols, cols < d, d, ACTIVATION).to(round_to)
                amax = tl.maximum(amax, tl.abs(y.to(tl.float32)))
        scale = row_scale(amax, static_ptr, STATIC, FP8_MAX, MIN_SCALE)
        tl.store(scale_ptr + row, scale)
        for start in range(0, d, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < d
            y = _act_and_mul_row(x_row, cols, mask, d, ACTIVATION).to(round_to).to(tl.float32)
            q = to_fp8(y, scale, FP8_MAX)
            tl.store(out_row + cols, q.to(out_ptr.dtype.element_ty), mask=mask)


def act_and_mul(
    x: torch.Tensor,
    activation: str,
    quantize: bool = False,
    static_scale: torch.Tensor | None = None,
) -> Any:
    """act(gate) * up in x's dtype; with ``quantize``, ``(fp8 [..., d], fp32 scale [rows, 1])``
    instead, scaled per row or by ``static_scale``."""
    if activation not in GATED_ACTIVATIONS:
        raise ValueError(f"no fused kernel for {activation!r}; fused: {sorted(GATED_ACTIVATIONS)}")
    d = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * d)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty((x2.shape[0], d), dtype=FP8 if quantize else x.dtype, device=x.device)
    if quantize:
        scale = torch.empty((x2.shape[0], 1), dtype=torch.float32, device=x.device)
        if x2.shape[0]:
            block, warps = row_launch(d)
            _act_and_mul_quant_kernel[(x2.shape[0],)](
                x2, out, scale, scale if static_scale is None else static_scale, x2.stride(0),
                out.stride(0), d, ACTIVATION=activation, STATIC=static_scale is not None,
                FP8_MAX=FP8_MAX, MIN_SCALE=MIN_SCALE, BLOCK=block, num_warps=warps,
                **pdl_args(x.device),
            )  # fmt: skip
        return out.view(*x.shape[:-1], d), scale
    if x2.shape[0]:
        block = 1024
        _act_and_mul_kernel[(x2.shape[0], triton.cdiv(d, block))](
            x2, out, x2.stride(0), out.stride(0), d, ACTIVATION=activation, BLOCK=block,
            num_warps=4, **pdl_args(x.device),
        )  # fmt: skip
    return out.view(*x.shape[:-1], d)
