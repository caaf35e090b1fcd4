"""Triton twins of the fp8 linear's elementwise work on CUDA, where PyTorch would launch one
kernel per operation and a decode step's tiny launches add up (measured on an H100 by
bench/fp8_linear_bench.py: ~15 us per per-token quantization, 4 per layer):

* `quantize_tokens`: a row's amax, its scale and its fp8 values in one kernel (twin of
  reference.quantize_tokens: same fp32 arithmetic, same clamping);
* `scale_rows_cols`: the FP8 GEMM's fp32 accumulators times the token and channel scales, plus
  the bias, in the output dtype: the epilogue for small batches, whose unscaled (per-tensor)
  cuBLASLt GEMM is up to twice as fast as its row-wise-scaled one;
* `small_batch_linear`: the whole linear for a decode-sized batch (quantization, GEMM, scales,
  bias) in one kernel, since at batch 1 cuBLASLt read the down projection's fp8 weight at 45-57%
  of copy bandwidth and the three launches around it cost as much again."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvfleet.kernels.reference import FP8, FP8_MAX, MIN_SCALE


@triton.jit
def _max(a, b):
    # tl.max and tl.zeros are jitted when triton is imported: a module that turns the
    # interpreter on (TRITON_INTERPRET=1) after that import could not run it.
    return tl.maximum(a, b)


@triton.jit
def _quantize_rows_kernel(
    x_ptr, out_ptr, scale_ptr, static_ptr, k, stride_x, stride_o,
    STATIC: tl.constexpr, FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    if STATIC:
        scale = tl.load(static_ptr).to(tl.float32)
    else:
        amax = tl.full([BLOCK], 0.0, tl.float32)
        for start in range(0, k, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            v = tl.load(x_row + cols, mask=cols < k, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(v))
        scale = tl.maximum(tl.reduce(amax, 0, _max) / FP8_MAX, MIN_SCALE)
    tl.store(scale_ptr + row, scale)
    for start in range(0, k, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        v = tl.load(x_row + cols, mask=cols < k, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(v / scale, -FP8_MAX), FP8_MAX)
        tl.store(out_ptr + row * stride_o + cols, q.to(out_ptr.dtype.element_ty), mask=cols < k)


def quantize_tokens(
    x: torch.Tensor, static_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """As reference.quantize_tokens, for a 2-D x with unit column stride."""
    m, k = x.shape
    out = torch.empty((m, k), dtype=FP8, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m:
        block = min(triton.next_power_of_2(k), 4096)
        _quantize_rows_kernel[(m,)](
            x, out, scale, scale if static_scale is None else static_scale, k, x.stride(0),
            out.stride(0), STATIC=static_scale is not None, FP8_MAX=FP8_MAX,
            MIN_SCALE=MIN_SCALE, BLOCK=block,
        )  # fmt: skip
    return out, scale


@triton.jit
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


@triton.jit
def _small_batch_linear_kernel(
    x_ptr, w_ptr, w_scale_ptr, static_ptr, bias_ptr, out_ptr, m, n, k, stride_x, stride_o,
    STATIC: tl.constexpr, HAS_BIAS: tl.constexpr, MODE: tl.constexpr, FP8_MAX: tl.constexpr,
    MIN_SCALE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    # Every program quantizes the whole (tiny) batch itself: re-reading M x K activations from L2
    # costs less than the two extra launches a separate quantization and epilogue would take.
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < m
    outs = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    out_ok = outs < n
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_x
    if STATIC:
        scale = tl.full([BLOCK_M], 0.0, tl.float32) + tl.load(static_ptr).to(tl.float32)
    else:
        amax = tl.full([BLOCK_M, BLOCK_K], 0.0, tl.float32)
        for start in range(0, k, BLOCK_K):
            cols = start + tl.arange(0, BLOCK_K)
            x_ok = row_ok[:, None] & (cols[None, :] < k)
            v = tl.load(x_rows + cols[None, :], mask=x_ok, other=0.0)
            amax = tl.maximum(amax, tl.abs(v.to(tl.float32)))
        scale = tl.maximum(tl.reduce(amax, 1, _max) / FP8_MAX, MIN_SCALE)
    w_rows = w_ptr + outs.to(tl.int64)[:, None] * k
    acc = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)
    for start in range(0, k, BLOCK_K):
        cols = start + tl.arange(0, BLOCK_K)
        col_ok = cols < k
        v = tl.load(x_rows + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0)
        q = tl.minimum(tl.maximum(v.to(tl.float32) / scale[:, None], -FP8_MAX), FP8_MAX)
        q = q.to(w_ptr.dtype.element_ty)
        w = tl.load(w_rows + cols[None, :], mask=out_ok[:, None] & col_ok[None, :], other=0.0)
        # Every e4m3 value is exact in fp16 and fp32, and every product of two exact in fp32:
        # the three modes sum the same products, in different orders.
        if MODE == 0:  # fp8 tensor cores
            acc = tl.dot(q, tl.trans(w), acc)
        elif MODE == 1:  # fp16 tensor cores (the interpreter has no fp8 arithmetic)
            acc = tl.dot(q.to(tl.float16), tl.trans(w.to(tl.float16)), acc)
        else:  # CUDA cores: one to a few rows, where a tensor-core tile would be mostly padding
            prod = q.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
            acc += tl.sum(prod, 2)
    y = acc * scale[:, None] * tl.load(w_scale_ptr + outs, mask=out_ok, other=0.0)[None, :]
    if HAS_BIAS:
        y += tl.load(bias_ptr + outs, mask=out_ok, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rows.to(tl.int64)[:, None] * stride_o + outs[None, :]
    tl.store(out, y.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & out_ok[None, :])


# The most tokens small_batch_linear takes: one tensor-core tile of rows.
SMALL_BATCH_TOKENS = 16
# small_batch_linear's arithmetic: tl.dot on fp8 or fp16 tensor cores (16 rows a tile, padded),
# or multiply-adds on CUDA cores over the next power of two of the batch.
DOT_FP8, DOT_FP16, FMA = 0, 1, 2


def small_batch_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor | None,
    bias: torch.Tensor | None,
    mode: int = FMA,
    block_n: int = 16,
    block_k: int = 256,
    num_warps: int = 4,
    num_stages: int = 3,
) -> torch.Tensor:
    """The whole W8A8 linear for up to SMALL_BATCH_TOKENS tokens in one kernel: x [M, K]
    (unit column stride) quantized per token (or by the static input_scale) as
    reference.quantize_tokens does, times the fp8 weight [N, K] in fp32, scaled by both scales,
    plus bias, in x's dtype. Where decode is a weight read, this streams the fp8 weight once with
    nothing launched around it."""
    m, k = x.shape
    n = weight.shape[0]
    if m > SMALL_BATCH_TOKENS:
        raise ValueError(f"small_batch_linear takes up to {SMALL_BATCH_TOKENS} tokens, not {m}")
    if mode == DOT_FP8 and not x.is_cuda:
        mode = DOT_FP16
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m:
        block_m = triton.next_power_of_2(m) if mode == FMA else SMALL_BATCH_TOKENS
        _small_batch_linear_kernel[(triton.cdiv(n, block_n),)](
            x, weight, weight_scale, x if input_scale is None else input_scale,
            x if bias is None else bias, out, m, n, k, x.stride(0), out.stride(0),
            STATIC=input_scale is not None, HAS_BIAS=bias is not None, MODE=mode,
            FP8_MAX=FP8_MAX, MIN_SCALE=MIN_SCALE, BLOCK_M=block_m, BLOCK_N=block_n,
            BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages,
        )  # fmt: skip
    return out
