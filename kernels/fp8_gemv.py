"""The fp8 linear for a decode step of a few tokens: the weights' e4m3 values widened in
registers and multiplied into the activations as they are (W8A16), one kernel with the row
scales and the bias. At batch 1 a W8A8 linear is three launches (the activations' quantization,
cuBLASLt's unscaled FP8 GEMM, the scaling epilogue), about 4 us of a layer's ~15 us of weight
reads per linear on an H100, and cuBLASLt's GEMM read qkv, o and down at 64-77% of copy
bandwidth there (bench/fp8_linear_bench.py). A matrix-vector product needs no tensor cores: the
weight bytes are the whole cost, so this kernel only keeps enough of them in flight. The
activations stay unquantized, which moves the result closer to the bf16 model, not further.

Twin: reference.weight_only_fp8_linear (same products, fp32 sums in another order)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# The most tokens this kernel takes: past a few rows a tensor-core GEMM reads the weights once
# for many more tokens than a program's registers hold.
GEMV_MAX_TOKENS = 4

# Rows of the weight per program, columns per loop turn, warps. Small row blocks give a few
# hundred to a few thousand programs at Llama-3-8B's shapes, enough loads in flight on every
# SM; the autotuner picks per (N, K, tokens) at the first call, which the engine makes while
# warming up, before CUDA graphs are captured.
_CONFIGS = [
    triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=s)
    for n, k, w, s in [
        (2, 1024, 4, 2),
        (4, 1024, 4, 2),
        (4, 512, 4, 3),
        (8, 512, 4, 2),
        (8, 1024, 8, 2),
        (16, 256, 4, 3),
        (4, 2048, 8, 2),
    ]
]


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr, m, n, k, stride_x, stride_o,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < n
    toks = tl.arange(0, BLOCK_M)
    tok_ok = toks < m
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * k
    # Products summed per column slot across the loop, reduced once at the end: a reduction
    # per turn would cost shuffles on every loaded tile.
    acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
    for start in range(0, k, BLOCK_K):
        cols = start + tl.arange(0, BLOCK_K)
        col_ok = cols < k
        w = tl.load(w_rows + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0)
        x = tl.load(
            x_ptr + toks[:, None] * stride_x + cols[None, :],
            mask=tok_ok[:, None] & col_ok[None, :],
            other=0.0,
        )
        acc += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
    y = tl.sum(acc, 2) * tl.load(scale_ptr + rows, mask=row_ok, other=0.0)[None, :]
    if HAS_BIAS:
        y += tl.load(bias_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + toks[:, None] * stride_o + rows[None, :]
    tl.store(out, y.to(out_ptr.dtype.element_ty), mask=tok_ok[:, None] & row_ok[None, :])


_tuned_kernel = triton.autotune(configs=_CONFIGS, key=["n", "k", "BLOCK_M"])(_gemv_kernel)


def fp8_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    config: dict[str, int] | None = None,
) -> torch.Tensor:
    """x [M, K] (unit column stride, M <= GEMV_MAX_TOKENS) @ (weight fp8 [N, K] row-major *
    weight_scale [N] fp32).T + bias, in x's dtype. config: BLOCK_N, BLOCK_K, num_warps and
    num_stages instead of the autotuner's choice (benchmarks, the interpreter)."""
    m, k = x.shape
    n = weight.shape[0]
    if m > GEMV_MAX_TOKENS:
        raise ValueError(f"fp8_gemv takes up to {GEMV_MAX_TOKENS} tokens, not {m}")
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if not m:
        return out
    args = (
        x, weight, weight_scale, out if bias is None else bias, out, m, n, k, x.stride(0),
        out.stride(0),
    )  # fmt: skip
    meta = dict(HAS_BIAS=bias is not None, BLOCK_M=triton.next_power_of_2(m))
    if config is None:
        _tuned_kernel[lambda c: (triton.cdiv(n, c["BLOCK_N"]),)](*args, **meta)
    else:
        config = dict(config)
        warps, stages = config.pop("num_warps", 4), config.pop("num_stages", 2)
        _gemv_kernel[(triton.cdiv(n, config["BLOCK_N"]),)](
            *args, **meta, **config, num_warps=warps, num_stages=stages
        )
    return out
