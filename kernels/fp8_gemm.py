"""The fp8 (W8A8) linear's GEMM at decode batch sizes, in one Triton kernel: out = (x_fp8 @
w_fp8.T) * x_scale * w_scale + bias, in the output dtype.

At a handful of tokens cuBLASLt reads the weights well below copy bandwidth and needs two more
launches (its split-K reduction and the scaling epilogue; figures in bench/RESULTS.md). Here the
weight is the MMA's M side ("swap AB"), so Hopper's fp8 tensor cores run with the few tokens
padded to BLOCK_M; K may be split over programs, and the last program of a column block adds
the partials in split order (deterministic), scales and writes: one launch either way. On Hopper
it starts early through programmatic dependent launch and prefetches its weights into L2. The
twin is the CPU path of engine.layers.fp8.fp8_linear (torch._scaled_mm)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvfleet.kernels.dependent_launch import (
    LINE,
    allow_dependents,
    pdl_args,
    prefetch_columns,
    prefetch_l2,
    wait_for_prior,
)
from kvfleet.kernels.launch import kernel

# Tokens a call may have: the MMA's N side, padded.
MAX_TOKENS = 16
_LINE = tl.constexpr(LINE)


@dataclass(frozen=True)
class GemmTile:
    block_n: int  # weight rows a program (the MMA's M: 64 per warpgroup on Hopper)
    block_k: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 4


@triton.jit
def _scale_and_store(
    acc, rows, toks, m, n, xs_ptr, ws_ptr, bias_ptr, out_ptr, stride_o, HAS_BIAS: tl.constexpr
):
    w_scale = tl.load(ws_ptr + rows, mask=rows < n, other=0.0)
    x_scale = tl.load(xs_ptr + toks, mask=toks < m, other=0.0)
    y = acc * w_scale[:, None] * x_scale[None, :]
    if HAS_BIAS:
        y += tl.load(bias_ptr + rows, mask=rows < n, other=0.0).to(tl.float32)[:, None]
    # The tile is [weight rows, tokens]: the output's transpose.
    out = out_ptr + toks[None, :].to(tl.int64) * stride_o + rows[:, None]
    tl.store(out, y.to(out_ptr.dtype.element_ty), mask=(rows[:, None] < n) & (toks[None, :] < m))


@kernel
def _small_batch_gemm_kernel(
    x_ptr, xs_ptr, w_ptr, ws_ptr, bias_ptr, out_ptr, part_ptr, count_ptr,
    m, n, k, stride_x, stride_w, stride_o,
    HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr, PREFETCH_K: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    toks = tl.arange(0, BLOCK_M)
    tiles = tl.cdiv(k, BLOCK_K)
    per_split = tl.cdiv(tiles, SPLIT_K)
    first = pid_k * per_split
    last = tl.minimum(first + per_split, tiles)
    w_rows = w_ptr + rows[:, None].to(tl.int64) * stride_w
    if PREFETCH_K > 0:
        # No kernel writes the weights, so they may be read before the wait: the rows' first
        # columns start moving while the kernel before this one finishes.
        lines = tl.minimum(first * BLOCK_K + tl.arange(0, PREFETCH_K // _LINE) * _LINE, k - 1)
        safe_rows = tl.minimum(rows, n - 1)
        prefetch_l2(w_ptr + safe_rows[:, None].to(tl.int64) * stride_w + lines[None, :])
    wait_for_prior(PDL)
    x_rows = x_ptr + toks[:, None] * stride_x
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for t in range(first, last):
        cols = t * BLOCK_K + tl.arange(0, BLOCK_K)
        w = tl.load(
            w_rows + cols[None, :], mask=(rows[:, None] < n) & (cols[None, :] < k), other=0.0
        )
        x = tl.load(
            x_rows + cols[None, :], mask=(toks[:, None] < m) & (cols[None, :] < k), other=0.0
        )
        acc = tl.dot(w, tl.trans(x), acc)
    # Not before the loop: a GEMM launched early behind this one would prefetch its weights
    # into L2 while this one streams its own through it.
    allow_dependents(PDL)
    if SPLIT_K == 1:
        _scale_and_store(
            acc, rows, toks, m, n, xs_ptr, ws_ptr, bias_ptr, out_ptr, stride_o, HAS_BIAS
        )
    else:
        # Partials [SPLIT_K, BLOCK_M, n]: padded token rows are written too (zeros), so the
        # sum below reads no uninitialised memory.
        part = part_ptr + toks[None, :] * n + rows[:, None]
        tl.store(part + pid_k * BLOCK_M * n, acc, mask=rows[:, None] < n)
        # Every thread's stores before the counter's release (acq_rel, GPU scope).
        tl.debug_barrier()
        done = tl.atomic_add(count_ptr + pid_n, 1)
        if done == SPLIT_K - 1:
            total = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            for s in range(SPLIT_K):
                total += tl.load(part + s * BLOCK_M * n, mask=rows[:, None] < n, other=0.0,
                                 cache_modifier=".cg")  # fmt: skip
            _scale_and_store(
                total, rows, toks, m, n, xs_ptr, ws_ptr, bias_ptr, out_ptr, stride_o, HAS_BIAS
            )
            tl.atomic_xchg(count_ptr + pid_n, 0)  # ready for the next call


# Column-block counters per device, zero between calls (the last program of a block resets its
# own). Made by the first call, which is a warm-up before any CUDA graph is captured. One stream
# at a time may use them: the engine's.
_COUNTERS: dict[torch.device, torch.Tensor] = {}
_MAX_BLOCKS = 1 << 14
# What all of a call's programs prefetch together: half of an H100's L2, so the first tiles
# are still there when the loop reaches them.
_PREFETCH_BYTES = 24 << 20


def _counters(device: torch.device) -> torch.Tensor:
    if device not in _COUNTERS:
        _COUNTERS[device] = torch.zeros(_MAX_BLOCKS, dtype=torch.int32, device=device)
    return _COUNTERS[device]


@functools.cache
def _sms(device: torch.device) -> int:
    return (
        torch.cuda.get_device_properties(device).multi_processor_count
        if device.type == "cuda"
        else 1
    )


@functools.cache
def default_tile(n: int, k: int, sms: int) -> GemmTile:
    """64 weight rows and 256 columns a tile, K unsplit from 64 column blocks up, six stages
    where an SM has at most two programs and four where it has more: the best of the H100 sweep
    in bench/RESULTS.md (bench/fp8_linear_bench.py --gemm-sweep). Below 64 blocks (a
    tensor-parallel shard of a small model) K is split until there are 64 programs, each with at
    least two K tiles: more programs streaming, for the partial sums' one extra pass."""
    block_n, block_k = 64, 256
    blocks = triton.cdiv(n, block_n)
    split = 1 if blocks >= 64 else max(1, min(triton.cdiv(64, blocks), k // (2 * block_k)))
    stages = 6 if blocks * split <= 2 * sms else 4
    return GemmTile(block_n, block_k, split, num_warps=4, num_stages=stages)


def small_batch_gemm(
    x: torch.Tensor,  # fp8 [m, k], m <= MAX_TOKENS
    x_scale: torch.Tensor,  # fp32 [m, 1]
    weight: torch.Tensor,  # fp8 [n, k]
    weight_scale: torch.Tensor,  # fp32 [n]
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    tile: GemmTile | None = None,
) -> torch.Tensor:
    m, k = x.shape
    n = weight.shape[0]
    if not 0 < m <= MAX_TOKENS:
        raise ValueError(f"small_batch_gemm takes 1-{MAX_TOKENS} tokens, not {m}")
    assert x.stride(1) == 1 and weight.stride(1) == 1 and weight.shape[1] == k
    if tile is None:
        tile = default_tile(n, k, _sms(x.device))
    blocks = triton.cdiv(n, tile.block_n)
    if blocks > _MAX_BLOCKS:
        raise ValueError(f"small_batch_gemm: {n} output columns is more than it counts")
    out = torch.empty((m, n), dtype=out_dtype, device=x.device)
    part = (
        torch.empty((tile.split_k, MAX_TOKENS, n), dtype=torch.float32, device=x.device)
        if tile.split_k > 1
        else out
    )
    pdl = pdl_args(x.device)
    prefetch = (
        prefetch_columns(
            triton.cdiv(k, tile.split_k), tile.block_n, blocks * tile.split_k, _PREFETCH_BYTES
        )
        if pdl["PDL"]
        else 0
    )
    _small_batch_gemm_kernel[(blocks, tile.split_k)](
        x, x_scale, weight, weight_scale, out if bias is None else bias, out, part,
        _counters(x.device), m, n, k, x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, SPLIT_K=tile.split_k, BLOCK_M=MAX_TOKENS,
        BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, PREFETCH_K=prefetch,
        num_warps=tile.num_warps, num_stages=tile.num_stages, **pdl,
    )  # fmt: skip
    return out
