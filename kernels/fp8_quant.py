"""Triton twins of the fp8 linear's elementwise work on CUDA, where PyTorch would launch one
kernel per operation and a decode step's tiny launches add up (measured on an H100 by
bench/fp8_linear_bench.py: ~15 us per per-token quantization, 4 per layer):

* `quantize_tokens`: a row's amax, its scale and its fp8 values in one kernel (twin of
  reference.quantize_tokens: same fp32 arithmetic, same clamping);
* `scale_rows_cols`: the FP8 GEMM's fp32 accumulators times the token and channel scales, plus
  the bias, in the output dtype: the epilogue for small batches, whose unscaled (per-tensor)
  cuBLASLt GEMM is up to twice as fast as its row-wise-scaled one."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvfleet.kernels.dependent_launch import enter, pdl_args
from kvfleet.kernels.launch import kernel
from kvfleet.kernels.reference import FP8, FP8_MAX, MIN_SCALE


@triton.jit
def _max(a, b):
    # tl.max and tl.zeros are jitted when triton is imported: a module that turns the
    # interpreter on (TRITON_INTERPRET=1) after that import could not run it.
    return tl.maximum(a, b)


@triton.jit
def to_fp8(y, scale, FP8_MAX: tl.constexpr):
    """fp32 values over their scale, rounded as reference.quantize_tokens rounds (an exact
    division, then saturation): to be cast to e4m3 by the store."""
    return tl.minimum(tl.maximum(tl.math.div_rn(y, scale), -FP8_MAX), FP8_MAX)


@triton.jit
def row_scale(magnitudes, static_ptr, STATIC: tl.constexpr, FP8_MAX: tl.constexpr,
              MIN_SCALE: tl.constexpr):  # fmt: skip
    """A row's scale: the static one, or its largest magnitude (of `magnitudes`, a vector whose
    maximum is the row's) over FP8_MAX, floored as reference.quantize_tokens floors it."""
    if STATIC:
        scale = tl.load(static_ptr).to(tl.float32)
    else:
        scale = tl.maximum(tl.reduce(magnitudes, 0, _max) / FP8_MAX, MIN_SCALE)
    return scale


@triton.jit
def store_fp8_row(
    y, cols, mask, row, out_row_ptr, scale_ptr, static_ptr,
    STATIC: tl.constexpr, FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr,
):  # fmt: skip
    """A whole row held in fp32 registers, quantized and stored: its scale (from its amax, or
    the static one) at scale_ptr + row, its e4m3 values at out_row_ptr + cols. Shared by every
    kernel that quantizes a row it produced (this module's, the fused RMSNorm and activation),
    so all of them round alike."""
    scale = row_scale(tl.abs(y), static_ptr, STATIC, FP8_MAX, MIN_SCALE)
    tl.store(scale_ptr + row, scale)
    q = to_fp8(y, scale, FP8_MAX)
    tl.store(out_row_ptr + cols, q.to(out_row_ptr.dtype.element_ty), mask=mask)


@kernel
def _quantize_rows_kernel(
    x_ptr, out_ptr, scale_ptr, static_ptr, k, stride_x, stride_o,
    STATIC: tl.constexpr, FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr, BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    out_row = out_ptr + row * stride_o
    if k <= BLOCK:
        # The whole row in registers, read once: at decode a row is one program's work, and
        # the second read of a looped pass is what kept it slow (9 us at 14,336 on an H100).
        cols = tl.arange(0, BLOCK)
        v = tl.load(x_row + cols, mask=cols < k, other=0.0).to(tl.float32)
        store_fp8_row(v, cols, cols < k, row, out_row, scale_ptr, static_ptr, STATIC, FP8_MAX,
                      MIN_SCALE)  # fmt: skip
    else:
        amax = tl.full([BLOCK], 0.0, tl.float32)
        if not STATIC:
            for start in range(0, k, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                v = tl.load(x_row + cols, mask=cols < k, other=0.0).to(tl.float32)
                amax = tl.maximum(amax, tl.abs(v))
        scale = row_scale(amax, static_ptr, STATIC, FP8_MAX, MIN_SCALE)
        tl.store(scale_ptr + row, scale)
        for start in range(0, k, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            v = tl.load(x_row + cols, mask=cols < k, other=0.0).to(tl.float32)
            q = to_fp8(v, scale, FP8_MAX)
            tl.store(out_row + cols, q.to(out_ptr.dtype.element_ty), mask=cols < k)


# Rows up to this wide are read once, in registers (16 warps: 32 values a thread).
ONE_PASS_MAX = 16384


def row_launch(k: int) -> tuple[int, int]:
    """(BLOCK, num_warps) of a per-row quantizing kernel over k columns: the whole row when it
    fits ONE_PASS_MAX, else 4,096-column passes."""
    block = triton.next_power_of_2(k)
    if block > ONE_PASS_MAX:
        return 4096, 8
    return block, min(max(block // 512, 1), 16)


def quantize_tokens(
    x: torch.Tensor, static_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """As reference.quantize_tokens, for a 2-D x with unit column stride."""
    m, k = x.shape
    out = torch.empty((m, k), dtype=FP8, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m:
        block, warps = row_launch(k)
        _quantize_rows_kernel[(m,)](
            x, out, scale, scale if static_scale is None else static_scale, k, x.stride(0),
            out.stride(0), STATIC=static_scale is not None, FP8_MAX=FP8_MAX,
            MIN_SCALE=MIN_SCALE, BLOCK=block, num_warps=warps, **pdl_args(x.device),
        )  # fmt: skip
    return out, scale


@kernel
def _scale_rows_cols_kernel(
    acc_ptr, row_scale_ptr, col_scale_ptr, bias_ptr, out_ptr, n,
    HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    acc = tl.load(acc_ptr + row * n + cols, mask=mask, other=0.0)
    y = acc * (tl.load(row_scale_ptr + row) * tl.load(col_scale_ptr + cols, mask=mask, other=0.0))
    if HAS_BIAS:
        y += tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * n + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def scale_rows_cols(
    acc: torch.Tensor,
    row_scale: torch.Tensor,
    col_scale: torch.Tensor,
    bias: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """acc [M, N] fp32 (contiguous) * row_scale [M, 1] * col_scale [N] + bias, in dtype."""
    m, n = acc.shape
    out = torch.empty((m, n), dtype=dtype, device=acc.device)
    block = 1024
    if m:
        _scale_rows_cols_kernel[(m, triton.cdiv(n, block))](
            acc, row_scale, col_scale, acc if bias is None else bias, out, n,
            HAS_BIAS=bias is not None, BLOCK=block,
        )  # fmt: skip
    return out
