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

from kvfleet.kernels.reference import FP8, FP8_MAX, GATED_ACTIVATIONS, MIN_SCALE

# The widest row the quantizing kernel keeps in registers (16 warps: 32 fp32 values a thread),
# Llama-3-8B's 14,336 included; wider rows take two passes.
_ONE_PASS_WIDTH = 16384
_TRITON_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def _load_input(
    x_row, cols, mask, row_scale, col_scale_ptr, UNSCALED: tl.constexpr, ROUND_TO: tl.constexpr
):
    x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    if UNSCALED:
        # An fp8 GEMM's fp32 accumulators: fp8_quant.scale_rows_cols' arithmetic and rounding.
        cs = tl.load(col_scale_ptr + cols, mask=mask, other=0.0)
        x = (x * (row_scale * cs)).to(ROUND_TO).to(tl.float32)
    return x


@triton.jit
def _act_and_mul_row(
    x_row, cols, mask, d, row_scale, col_scale_ptr, ACTIVATION: tl.constexpr,
    UNSCALED: tl.constexpr, ROUND_TO: tl.constexpr,
):  # fmt: skip
    gate = _load_input(x_row, cols, mask, row_scale, col_scale_ptr, UNSCALED, ROUND_TO)
    up = _load_input(x_row, d + cols, mask, row_scale, col_scale_ptr, UNSCALED, ROUND_TO)
    if ACTIVATION == "silu":  # the names are reference.GATED_ACTIVATIONS' keys
        act = gate / (1.0 + tl.exp(-gate))
    else:
        # 0.5 g (1 + tanh(u)) = g sigmoid(2u): no tanh needed, and exact at both tails.
        u = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        act = gate / (1.0 + tl.exp(-2.0 * u))
    return act * up


@triton.jit
def _act_and_mul_kernel(
    x_ptr, out_ptr, stride_x, stride_o, d, row_scale_ptr, col_scale_ptr,
    ACTIVATION: tl.constexpr, UNSCALED: tl.constexpr, ROUND_TO: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    row_scale = tl.load(row_scale_ptr + row) if UNSCALED else 1.0
    y = _act_and_mul_row(
        x_ptr + row * stride_x, cols, mask, d, row_scale, col_scale_ptr, ACTIVATION, UNSCALED,
        ROUND_TO,
    )  # fmt: skip
    tl.store(out_ptr + row * stride_o + cols, y.to(ROUND_TO), mask=mask)


@triton.jit
def _act_and_mul_quant_kernel(
    x_ptr, out_ptr, scale_ptr, static_ptr, stride_x, stride_o, d, row_scale_ptr, col_scale_ptr,
    ACTIVATION: tl.constexpr, STATIC: tl.constexpr, FP8_MAX: tl.constexpr,
    MIN_SCALE: tl.constexpr, UNSCALED: tl.constexpr, ROUND_TO: tl.constexpr,
    ONE_PASS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # One program a row: its amax is needed before any value is written. A row that fits one
    # block (ONE_PASS) is computed once and kept in registers; a wider one is computed twice
    # rather than kept.
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    row_scale = tl.load(row_scale_ptr + row) if UNSCALED else 1.0
    if ONE_PASS:
        cols = tl.arange(0, BLOCK)
        mask = cols < d
        y = _act_and_mul_row(
            x_row, cols, mask, d, row_scale, col_scale_ptr, ACTIVATION, UNSCALED, ROUND_TO
        )  # fmt: skip
        y = y.to(ROUND_TO).to(tl.float32)
        if STATIC:
            scale = tl.load(static_ptr).to(tl.float32)
        else:
            scale = tl.maximum(tl.max(tl.abs(y), 0) / FP8_MAX, MIN_SCALE)
        tl.store(scale_ptr + row, scale)
        q = tl.minimum(tl.maximum(tl.math.div_rn(y, scale), -FP8_MAX), FP8_MAX)
        tl.store(out_ptr + row * stride_o + cols, q.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        if STATIC:
            scale = tl.load(static_ptr).to(tl.float32)
        else:
            amax = tl.full([BLOCK], 0.0, tl.float32)
            for start in range(0, d, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                y = _act_and_mul_row(
                    x_row, cols, cols < d, d, row_scale, col_scale_ptr, ACTIVATION, UNSCALED,
                    ROUND_TO,
                ).to(ROUND_TO)  # fmt: skip
                amax = tl.maximum(amax, tl.abs(y.to(tl.float32)))
            scale = tl.maximum(tl.max(amax, 0) / FP8_MAX, MIN_SCALE)
        tl.store(scale_ptr + row, scale)
        for start in range(0, d, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < d
            y = _act_and_mul_row(
                x_row, cols, mask, d, row_scale, col_scale_ptr, ACTIVATION, UNSCALED, ROUND_TO
            )  # fmt: skip
            y = y.to(ROUND_TO).to(tl.float32)
            q = tl.minimum(tl.maximum(tl.math.div_rn(y, scale), -FP8_MAX), FP8_MAX)
            tl.store(out_ptr + row * stride_o + cols, q.to(out_ptr.dtype.element_ty), mask=mask)


def act_and_mul(
    x: torch.Tensor,
    activation: str,
    quantize: bool = False,
    static_scale: torch.Tensor | None = None,
    unscaled: tuple[torch.Tensor, torch.Tensor, torch.dtype] | None = None,
) -> Any:
    """act(gate) * up in x's dtype; with ``quantize``, ``(fp8 [..., d], fp32 scale [rows, 1])``
    instead, scaled per row or by ``static_scale``. With ``unscaled`` (row scales [rows, 1],
    column scales [2d], the model dtype), x is an fp8 GEMM's fp32 accumulators, scaled and
    rounded to that dtype here as the GEMM's epilogue would."""
    if activation not in GATED_ACTIVATIONS:
        raise ValueError(f"no fused kernel for {activation!r}; fused: {sorted(GATED_ACTIVATIONS)}")
    d = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * d)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    dtype = x.dtype if unscaled is None else unscaled[2]
    scales = (x2, x2) if unscaled is None else unscaled[:2]
    out = torch.empty((x2.shape[0], d), dtype=FP8 if quantize else dtype, device=x.device)
    if quantize:
        scale = torch.empty((x2.shape[0], 1), dtype=torch.float32, device=x.device)
        one_pass = d <= _ONE_PASS_WIDTH
        if x2.shape[0]:
            _act_and_mul_quant_kernel[(x2.shape[0],)](
                x2, out, scale, scale if static_scale is None else static_scale, x2.stride(0),
                out.stride(0), d, *scales, ACTIVATION=activation,
                STATIC=static_scale is not None, FP8_MAX=FP8_MAX, MIN_SCALE=MIN_SCALE,
                UNSCALED=unscaled is not None, ROUND_TO=_TRITON_DTYPES[dtype],
                ONE_PASS=one_pass, BLOCK=triton.next_power_of_2(d) if one_pass else 2048,
                num_warps=16 if one_pass else 8,
            )  # fmt: skip
        return out.view(*x.shape[:-1], d), scale
    if x2.shape[0]:
        block = 1024
        _act_and_mul_kernel[(x2.shape[0], triton.cdiv(d, block))](
            x2, out, x2.stride(0), out.stride(0), d, *scales, ACTIVATION=activation,
            UNSCALED=unscaled is not None, ROUND_TO=_TRITON_DTYPES[dtype], BLOCK=block,
            num_warps=4,
        )  # fmt: skip
    return out.view(*x.shape[:-1], d)
