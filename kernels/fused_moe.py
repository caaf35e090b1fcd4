"""A mixture of experts' MLP on the GPU: the twin of ``reference.fused_experts``, in five launches
(four at decode sizes, three where the routing's launch aligned the pairs too, two more for W8A8
below) whatever the number of experts, with no host synchronisation and every buffer's shape
fixed by the token count (as a CUDA graph captured per batch size needs). Every launch takes
programmatic dependent launch (kernels.dependent_launch), so that at decode sizes each one's
start overlaps the end of the one before.

1. align (two kernels, one at decode sizes, none after kernels.expert_routing.route_and_align,
   which computes its buffers with the routing): the (token, slot) pairs sorted by expert, each
   expert's run padded to a multiple of BLOCK_M, and the expert of each block of BLOCK_M rows.
   Pairs whose id is -1 (an expert on another rank) are left out. The buffers are sized by
   the bound of ``T * top_k + min(E, T * top_k) * (BLOCK_M - 1)`` rows; blocks past the used
   ones are marked -1 and their programs exit at once, so padding and skipped pairs cost no
   FLOPs.
2. gate/up: one grouped GEMM; a program computes matching gate and up columns of its block's
   expert and writes act(gate) * up, so the [pairs, 2I] product never reaches memory.
3. down: one grouped GEMM whose epilogue multiplies each row by its routing weight and writes
   it to the pair's own row.
4. combine: each token's top_k rows summed in slot order.

The combine reads the pairs' rows back instead of the down GEMM adding them into the output with
atomics: a fixed summation order makes the result deterministic (a batch's output does not depend
on which program finished first). It moves about as many bytes as the atomics would (each pair's
row written and read in the model dtype, against an fp32 read-modify-write in L2 plus zeroing and
rounding passes), and one launch.

FP8 (e4m3) weights run in one of two modes, both with the per-expert, per-output-channel weight
scale multiplying the fp32 accumulator:

- W8A16: weight tiles are converted to the activations' dtype in registers, in the inner loop,
  and the tensor cores multiply in that dtype. No extra launch, but the conversions hold the
  GEMMs well above their weight-read floor once the experts have rows to share a tile.
- W8A8 (``fp8_activations``): the activations are quantized per row to e4m3 (one fp32 scale a
  row, from its largest magnitude, by kernels.fp8_quant.quantize_tokens) and both GEMMs run on
  the fp8 tensor cores, the row's scale then the column's multiplying the fp32 accumulator
  (row blocks smaller than the fp8 MMA's 64 rows swap its operands: ``FP8_MMA_ROWS``). x is
  quantized once per token before gate/up. The gate/up output act(gate) * up is written in
  the activations' dtype and a second launch quantizes it per row before down: a row's scale
  needs its largest magnitude over all of the intermediate columns, which are spread over
  several gate/up programs, so no single program's epilogue can compute it. That pass reads
  the [rows, I] buffer once more and writes it in half the bytes (at 4,096 of Qwen3-30B-A3B's
  tokens about 50 MB more than W8A16 moves, against 600 MB of expert weights); at decode sizes
  its launch, and x's, may cost more than the conversions they save: the caller chooses the
  mode per token count (engine.layers.moe.W8A8_MIN_TOKENS).

The tile per token-count bucket comes from ``TILES`` (``W8A8_TILES`` for W8A8), swept by
``bench/moe_kernel.py``."""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvfleet.kernels.activation import gated
from kvfleet.kernels.dependent_launch import allow_dependents, enter, pdl_args, wait_for_prior
from kvfleet.kernels.fp8_quant import quantize_tokens
from kvfleet.kernels.launch import kernel
from kvfleet.kernels.reference import FP8, GATED_ACTIVATIONS


@dataclass(frozen=True)
class MoeTile:
    block_m: int  # pairs a program (each expert's run is padded to a multiple)
    block_n: int  # output columns a program
    block_k: int
    group_m: int  # row blocks that sweep the column blocks together, sharing weight tiles in L2
    num_warps: int = 4
    num_stages: int = 3


# (largest token count, tile), ascending. Decode sizes give each active expert a few rows: the
# smallest BLOCK_M the tensor cores take, narrow column blocks so that the few active experts
# still make a program per SM to stream their weights; prefill sizes give each expert hundreds
# of rows: larger blocks, so that each weight tile is reused more. The rows from 512 tokens up
# are the H200 sweep's best at Qwen3-30B-A3B's shapes (bench/moe_kernel.py --sweep, RESULTS).
TILES: tuple[tuple[int, MoeTile], ...] = (
    (32, MoeTile(16, 32, 128, 1, 4, 4)),
    (128, MoeTile(16, 64, 128, 4, 4, 4)),
    (512, MoeTile(64, 64, 64, 8, 4, 3)),
    (2048, MoeTile(128, 128, 64, 8, 8, 3)),
    (1 << 62, MoeTile(128, 128, 64, 8, 8, 3)),
)
# W8A8's: TILES' shapes with fp8's K tile of 128 (twice the elements a byte, so twice the K a
# tile for the same shared memory), and column blocks of at least FP8_MMA_ROWS where the row
# blocks are smaller (the weight rows are then the MMA's rows). Not yet swept on a GPU
# (bench/moe_kernel.py --sweep --dtypes fp8 sweeps them).
W8A8_TILES: tuple[tuple[int, MoeTile], ...] = (
    (32, MoeTile(16, 64, 128, 1, 4, 4)),
    (128, MoeTile(16, 64, 128, 4, 4, 4)),
    (512, MoeTile(64, 64, 128, 8, 4, 3)),
    (2048, MoeTile(128, 128, 128, 8, 8, 3)),
    (1 << 62, MoeTile(128, 128, 128, 8, 8, 3)),
)


# Hopper's fp8 MMA (wgmma) takes 64 rows a warpgroup; Triton lowers an fp8 dot of fewer rows to
# f16 mma.sync, converting both operands in registers as W8A16 does. W8A8 row blocks smaller
# than this put the weight tile on the MMA's row side instead ("swap AB": BLOCK_N weight rows,
# at least 64, times the block's pairs) and transpose the accumulator once for the epilogue.
FP8_MMA_ROWS = 64

# The align kernels' programs at most: each reads every program's expert counts.
ALIGN_CHUNKS = 64


def tile_for(num_tokens: int, tiles: tuple[tuple[int, MoeTile], ...] = TILES) -> MoeTile:
    return tiles[bisect.bisect_left([bound for bound, _ in tiles], num_tokens)][1]


def call_tile(num_tokens: int, fp8_activations: bool) -> MoeTile:
    """The tile fused_experts takes for a call of `num_tokens` (and so the BLOCK_M its aligned
    pairs need)."""
    return tile_for(num_tokens, W8A8_TILES if fp8_activations else TILES)


def max_padded_rows(pairs: int, num_experts: int, block_m: int) -> int:
    """The rows the sorted pairs can take: each expert that has pairs (at most min(E, pairs))
    pads its run by fewer than BLOCK_M rows; rounded up to whole blocks."""
    bound = pairs + min(num_experts, pairs) * (block_m - 1)
    return triton.cdiv(bound, block_m) * block_m


@triton.jit
def _chunk_counts(ids_ptr, pairs, chunk, chunk_size, SUB: tl.constexpr, E_PAD: tl.constexpr):
    """Per expert, its pairs among the chunk's, SUB at a time (a [SUB, E_PAD] one-hot)."""
    e = tl.arange(0, E_PAD)
    count = tl.zeros([E_PAD], dtype=tl.int32)
    for s in range(0, chunk_size, SUB):
        offs = chunk * chunk_size + s + tl.arange(0, SUB)
        ids = tl.load(ids_ptr + offs, mask=offs < pairs, other=-1)
        count += tl.sum((ids[:, None] == e[None, :]).to(tl.int32), axis=0)
    return count


@kernel
def _count_kernel(
    ids_ptr, counts_ptr, pairs, experts, chunk_size, SUB: tl.constexpr, E_PAD: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    enter(PDL)
    chunk = tl.program_id(0)
    e = tl.arange(0, E_PAD)
    count = _chunk_counts(ids_ptr, pairs, chunk, chunk_size, SUB, E_PAD)
    tl.store(counts_ptr + chunk * experts + e, count, mask=e < experts)


@triton.jit
def _place_chunk(
    ids_ptr, sorted_ptr, pairs, chunk, chunk_size, before, SUB: tl.constexpr, E_PAD: tl.constexpr
):
    """Writes the chunk's pairs to their experts' runs: `before` holds each expert's next free
    row (its run's start plus its pairs of earlier chunks), so the sort is stable."""
    e = tl.arange(0, E_PAD)
    for s in range(0, chunk_size, SUB):
        offs = chunk * chunk_size + s + tl.arange(0, SUB)
        ids = tl.load(ids_ptr + offs, mask=offs < pairs, other=-1)
        hits = (ids[:, None] == e[None, :]).to(tl.int32)
        # A pair's rank among its expert's pairs here: the inclusive count, less one.
        dest = tl.sum(hits * (tl.cumsum(hits, axis=0) - 1 + before[None, :]), axis=1)
        tl.store(sorted_ptr + dest, offs, mask=(offs < pairs) & (ids >= 0))
        before += tl.sum(hits, axis=0)


@triton.jit
def _pad_runs(
    sorted_ptr, block_expert_ptr, start, total, end, pairs, experts, max_blocks,
    BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, BLOCKS_AT_ONCE: tl.constexpr,
):  # fmt: skip
    """The runs' padding rows and each block's expert, from every expert's run (`start`,
    `total` pairs, padded `end`)."""
    e = tl.arange(0, E_PAD)
    # Padding rows hold the sentinel `pairs`: the GEMMs read zeros and write nothing there.
    j = tl.arange(0, BLOCK_M)
    slot = (start + total)[:, None] + j[None, :]
    sentinel = tl.zeros([E_PAD, BLOCK_M], dtype=tl.int32) + pairs
    tl.store(sorted_ptr + slot, sentinel, mask=(slot < end[:, None]) & (e[:, None] < experts))
    # A block's expert: the first whose padded run ends after the block's first row (runs of no
    # rows end where they start); -1 past the last run.
    for b0 in range(0, max_blocks, BLOCKS_AT_ONCE):
        b = b0 + tl.arange(0, BLOCKS_AT_ONCE)
        ended = (end[None, :] <= (b * BLOCK_M)[:, None]) & (e[None, :] < experts)
        owner = tl.sum(ended.to(tl.int32), axis=1)
        tl.store(block_expert_ptr + b, tl.where(owner < experts, owner, -1), mask=b < max_blocks)


@triton.jit
def align_one_program(
    ids_ptr, sorted_ptr, block_expert_ptr, pairs, experts, chunk_size, max_blocks,
    BLOCK_M: tl.constexpr, SUB: tl.constexpr, E_PAD: tl.constexpr, BLOCKS_AT_ONCE: tl.constexpr,
):  # fmt: skip
    """align's work in one program, which counts the pairs itself (decode sizes)."""
    total = _chunk_counts(ids_ptr, pairs, 0, chunk_size, SUB, E_PAD)
    padded = (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    end = tl.cumsum(padded, axis=0)
    start = end - padded
    _place_chunk(ids_ptr, sorted_ptr, pairs, 0, chunk_size, start, SUB, E_PAD)
    _pad_runs(
        sorted_ptr, block_expert_ptr, start, total, end, pairs, experts, max_blocks, BLOCK_M,
        E_PAD, BLOCKS_AT_ONCE,
    )  # fmt: skip


@kernel
def _place_kernel(
    ids_ptr, counts_ptr, sorted_ptr, block_expert_ptr, pairs, experts, num_chunks, chunk_size,
    max_blocks, BLOCK_M: tl.constexpr, SUB: tl.constexpr, E_PAD: tl.constexpr,
    CHUNKS_AT_ONCE: tl.constexpr, BLOCKS_AT_ONCE: tl.constexpr, ONE_CHUNK: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    # Each chunk's pairs go to their expert's run, after the same expert's pairs of earlier
    # chunks: a stable sort, computed by every program from the counts alone. A single chunk
    # (decode sizes) counts its own pairs: one launch fewer.
    enter(PDL)
    if ONE_CHUNK:
        align_one_program(
            ids_ptr, sorted_ptr, block_expert_ptr, pairs, experts, chunk_size, max_blocks,
            BLOCK_M, SUB, E_PAD, BLOCKS_AT_ONCE,
        )  # fmt: skip
    else:
        chunk = tl.program_id(0)
        e = tl.arange(0, E_PAD)
        before = tl.zeros([E_PAD], dtype=tl.int32)
        total = tl.zeros([E_PAD], dtype=tl.int32)
        for c0 in range(0, num_chunks, CHUNKS_AT_ONCE):
            c = c0 + tl.arange(0, CHUNKS_AT_ONCE)
            rows = tl.load(
                counts_ptr + c[:, None] * experts + e[None, :],
                mask=(c[:, None] < num_chunks) & (e[None, :] < experts),
                other=0,
            )
            total += tl.sum(rows, axis=0)
            before += tl.sum(tl.where(c[:, None] < chunk, rows, 0), axis=0)
        padded = (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        end = tl.cumsum(padded, axis=0)
        start = end - padded
        _place_chunk(ids_ptr, sorted_ptr, pairs, chunk, chunk_size, before + start, SUB, E_PAD)
        if chunk == 0:
            _pad_runs(
                sorted_ptr, block_expert_ptr, start, total, end, pairs, experts, max_blocks,
                BLOCK_M, E_PAD, BLOCKS_AT_ONCE,
            )  # fmt: skip


@triton.jit
def _block_of(max_blocks, n, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(row block, column block) of this program: GROUP_M row blocks sweep the column blocks
    together, so an expert's weight tile is read once for its consecutive blocks."""
    pid = tl.program_id(0)
    n_blocks = tl.cdiv(n, BLOCK_N)
    in_group = GROUP_M * n_blocks
    first_m = (pid // in_group) * GROUP_M
    size_m = tl.minimum(max_blocks - first_m, GROUP_M)
    return first_m + (pid % in_group) % size_m, (pid % in_group) // size_m


@triton.jit
def _weight_tile(w_ptr, expert, stride_we, stride_wn, cols, ks, SWAP_AB: tl.constexpr):
    """Pointers to the expert's weight rows `cols` over the K offsets `ks`: the MMA's B operand
    [BLOCK_K, BLOCK_N], or swapped its A operand [BLOCK_N, BLOCK_K]."""
    base = w_ptr + expert.to(tl.int64) * stride_we
    if SWAP_AB:
        tile = base + cols[:, None] * stride_wn + ks[None, :]
    else:
        tile = base + cols[None, :] * stride_wn + ks[:, None]
    return tile


@triton.jit
def _load_weight(tile, k0, col_ok, k_ok, EVEN_K: tl.constexpr, SWAP_AB: tl.constexpr):
    """A weight tile at K offset k0: zeros past the last column, and past K unless EVEN_K."""
    if SWAP_AB:
        mask = col_ok[:, None]
        if not EVEN_K:
            mask = mask & k_ok[None, :]
    else:
        mask = col_ok[None, :]
        if not EVEN_K:
            mask = mask & k_ok[:, None]
    return tl.load(tile + k0, mask=mask, other=0.0)


@triton.jit
def _accumulator(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SWAP_AB: tl.constexpr):
    if SWAP_AB:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    return acc


@triton.jit
def _mma(a, w, acc, SWAP_AB: tl.constexpr, PRECISION: tl.constexpr):
    """acc + a @ w; swapped, the transpose: acc.T + w.T @ a.T (transposed back after the loop)."""
    return tl.dot(w, tl.trans(a), acc) if SWAP_AB else tl.dot(a, w, acc, input_precision=PRECISION)


@triton.jit
def _rows_by_cols(acc, SWAP_AB: tl.constexpr):
    """The accumulator as [BLOCK_M, BLOCK_N] for the epilogue."""
    if SWAP_AB:
        acc = tl.trans(acc)
    return acc


@kernel
def _gate_up_kernel(
    x_ptr, x_scale_ptr, w_ptr, scale_ptr, out_ptr, sorted_ptr, block_expert_ptr,
    pairs, inter, hidden, max_blocks, stride_x, stride_we, stride_wn, stride_se, stride_o,
    TOP_K: tl.constexpr, ACTIVATION: tl.constexpr, FP8_W: tl.constexpr, FP8_A: tl.constexpr,
    SWAP_AB: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    # The block's expert is align's output: nothing can be read before the wait (the weights
    # to prefetch depend on it).
    wait_for_prior(PDL)
    pid_m, pid_n = _block_of(max_blocks, inter, BLOCK_N, GROUP_M)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + rows)
    valid = pair < pairs
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter
    ks = tl.arange(0, BLOCK_K)
    token = pair // TOP_K
    x_rows = x_ptr + token[:, None].to(tl.int64) * stride_x + ks[None, :]
    # The expert's gate rows `cols` and its up rows `inter + cols`.
    gate = _weight_tile(w_ptr, expert, stride_we, stride_wn, cols, ks, SWAP_AB)
    up = gate + inter * stride_wn
    acc_gate = _accumulator(BLOCK_M, BLOCK_N, SWAP_AB)
    acc_up = _accumulator(BLOCK_M, BLOCK_N, SWAP_AB)
    for k0 in range(0, hidden, BLOCK_K):
        k_ok = k0 + ks < hidden
        if EVEN_K:
            a = tl.load(x_rows + k0, mask=valid[:, None], other=0.0)
        else:
            a = tl.load(x_rows + k0, mask=valid[:, None] & k_ok[None, :], other=0.0)
        bg = _load_weight(gate, k0, col_ok, k_ok, EVEN_K, SWAP_AB)
        bu = _load_weight(up, k0, col_ok, k_ok, EVEN_K, SWAP_AB)
        if FP8_W and not FP8_A:
            bg = bg.to(a.dtype)
            bu = bu.to(a.dtype)
        acc_gate = _mma(a, bg, acc_gate, SWAP_AB, PRECISION)
        acc_up = _mma(a, bu, acc_up, SWAP_AB, PRECISION)
    # Not before the loop: the next GEMM launched early would stream its weights through L2
    # while this one streams its own (as kernels.fp8_gemm's).
    allow_dependents(PDL)
    acc_gate = _rows_by_cols(acc_gate, SWAP_AB)
    acc_up = _rows_by_cols(acc_up, SWAP_AB)
    if FP8_A:
        x_scale = tl.load(x_scale_ptr + token, mask=valid, other=0.0)[:, None]
        acc_gate *= x_scale
        acc_up *= x_scale
    if FP8_W:
        scales = scale_ptr + expert.to(tl.int64) * stride_se + cols
        acc_gate *= tl.load(scales, mask=col_ok, other=0.0)[None, :]
        acc_up *= tl.load(scales + inter, mask=col_ok, other=0.0)[None, :]
    # Rounded to the activations' dtype first, as the twin's gate/up GEMM output is.
    dtype = out_ptr.dtype.element_ty
    g = acc_gate.to(dtype).to(tl.float32)
    u = acc_up.to(dtype).to(tl.float32)
    out = out_ptr + rows[:, None].to(tl.int64) * stride_o + cols[None, :]
    tl.store(out, gated(g, u, ACTIVATION).to(dtype), mask=col_ok[None, :])


@kernel
def _down_kernel(
    h_ptr, h_scale_ptr, w_ptr, scale_ptr, weights_ptr, out_ptr, sorted_ptr, block_expert_ptr,
    pairs, hidden, inter, max_blocks, stride_h, stride_we, stride_wn, stride_se, stride_o,
    FP8_W: tl.constexpr, FP8_A: tl.constexpr, SWAP_AB: tl.constexpr, EVEN_K: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    wait_for_prior(PDL)
    pid_m, pid_n = _block_of(max_blocks, hidden, BLOCK_N, GROUP_M)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + rows)
    valid = pair < pairs
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    ks = tl.arange(0, BLOCK_K)
    # The gate/up kernel's output is in sorted order: its rows are read in place.
    h_rows = h_ptr + rows[:, None].to(tl.int64) * stride_h + ks[None, :]
    w = _weight_tile(w_ptr, expert, stride_we, stride_wn, cols, ks, SWAP_AB)
    acc = _accumulator(BLOCK_M, BLOCK_N, SWAP_AB)
    for k0 in range(0, inter, BLOCK_K):
        k_ok = k0 + ks < inter
        a = tl.load(h_rows + k0) if EVEN_K else tl.load(h_rows + k0, mask=k_ok[None, :], other=0.0)
        b = _load_weight(w, k0, col_ok, k_ok, EVEN_K, SWAP_AB)
        if FP8_W and not FP8_A:
            b = b.to(a.dtype)
        acc = _mma(a, b, acc, SWAP_AB, PRECISION)
    allow_dependents(PDL)
    acc = _rows_by_cols(acc, SWAP_AB)
    if FP8_A:
        # Every row of the buffer has its scale (padding rows quantized zeros).
        acc *= tl.load(h_scale_ptr + rows)[:, None]
    if FP8_W:
        scales = scale_ptr + expert.to(tl.int64) * stride_se + cols
        acc *= tl.load(scales, mask=col_ok, other=0.0)[None, :]
    acc *= tl.load(weights_ptr + pair, mask=valid, other=0.0)[:, None]
    out = out_ptr + pair[:, None].to(tl.int64) * stride_o + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & col_ok[None, :])


@kernel
def _combine_kernel(
    ids_ptr, y_ptr, out_ptr, hidden, TOP_K: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr
):
    enter(PDL)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in range(TOP_K):
        pair = token * TOP_K + j
        # A skipped slot's row was never written: none of its columns are read.
        width = tl.where(tl.load(ids_ptr + pair) >= 0, hidden, 0)
        y = tl.load(y_ptr + pair * hidden + cols, mask=cols < width, other=0.0)
        acc += y.to(tl.float32)
    tl.store(out_ptr + token * hidden + cols, acc.to(out_ptr.dtype.element_ty), mask=cols < hidden)


@dataclass(frozen=True)
class AlignLayout:
    """align's buffers and register tiles for a call's pairs, experts and BLOCK_M."""

    rows: int  # the sorted pairs' buffer: max_padded_rows
    e_pad: int
    sub: int  # pairs a one-hot [SUB, E_PAD] takes at a time
    at_once: int  # chunks' counts or blocks a program reads or writes at a time

    @classmethod
    def of(cls, pairs: int, num_experts: int, block_m: int) -> AlignLayout:
        e_pad = triton.next_power_of_2(num_experts)
        # A one-hot matrix [SUB, E_PAD] of 4,096 entries stays in registers.
        sub = max(16, min(4096 // e_pad, triton.next_power_of_2(pairs)))
        rows = max_padded_rows(pairs, num_experts, block_m)
        return cls(rows, e_pad, sub, max(1, 2048 // e_pad))


def align(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted pairs int32 [max_padded_rows], block experts int32 [blocks]): the pair indices
    (token * top_k + slot) of ids [tokens, top_k] sorted by expert, stably, each expert's run
    padded with the sentinel ``tokens * top_k`` to a multiple of ``block_m``; each block's
    expert, -1 for the blocks past the last run. Ids of -1 are left out."""
    pairs = ids.numel()
    layout = AlignLayout.of(pairs, num_experts, block_m)
    sub = layout.sub
    # Each program (chunk) takes whole SUBs; at most ALIGN_CHUNKS of them, since each one reads
    # every chunk's counts.
    chunk_size = triton.cdiv(triton.cdiv(pairs, ALIGN_CHUNKS), sub) * sub
    num_chunks = triton.cdiv(pairs, chunk_size)
    counts = torch.empty((num_chunks, num_experts), dtype=torch.int32, device=ids.device)
    sorted_pairs = torch.empty(layout.rows, dtype=torch.int32, device=ids.device)
    block_expert = torch.empty(layout.rows // block_m, dtype=torch.int32, device=ids.device)
    pdl = pdl_args(ids.device)
    if num_chunks > 1:
        _count_kernel[(num_chunks,)](
            ids, counts, pairs, num_experts, chunk_size, SUB=sub, E_PAD=layout.e_pad, **pdl
        )
    _place_kernel[(num_chunks,)](
        ids, counts, sorted_pairs, block_expert, pairs, num_experts, num_chunks, chunk_size,
        block_expert.shape[0], BLOCK_M=block_m, SUB=sub, E_PAD=layout.e_pad,
        CHUNKS_AT_ONCE=layout.at_once, BLOCKS_AT_ONCE=layout.at_once,
        ONE_CHUNK=num_chunks == 1, **pdl,
    )  # fmt: skip
    return sorted_pairs, block_expert


def _check(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    activation: str,
    gate_up_scale: torch.Tensor | None,
    down_scale: torch.Tensor | None,
    fp8_activations: bool,
) -> None:
    if activation not in GATED_ACTIVATIONS:
        raise ValueError(f"no fused kernel for {activation!r}; fused: {sorted(GATED_ACTIVATIONS)}")
    experts, two_inter, hidden = gate_up.shape
    if x.dim() != 2 or x.shape[1] != hidden:
        raise ValueError(f"x {tuple(x.shape)} for experts of hidden size {hidden}")
    if two_inter % 2 or down.shape != (experts, hidden, two_inter // 2):
        raise ValueError(f"gate_up {tuple(gate_up.shape)} and down {tuple(down.shape)} disagree")
    if ids.dim() != 2 or ids.shape[0] != x.shape[0] or weights.shape != ids.shape:
        raise ValueError(f"ids {tuple(ids.shape)} and weights {tuple(weights.shape)} per token")
    fp8 = gate_up.dtype == FP8
    if fp8 != (down.dtype == FP8):
        raise ValueError(f"gate_up is {gate_up.dtype} but down is {down.dtype}")
    if not fp8 and gate_up.dtype != x.dtype:
        raise ValueError(f"x is {x.dtype} but the experts are {gate_up.dtype}")
    if fp8:
        if gate_up_scale is None or down_scale is None:
            raise ValueError("fp8 expert weights need gate_up_scale and down_scale")
        if gate_up_scale.shape != gate_up.shape[:2] or down_scale.shape != down.shape[:2]:
            raise ValueError("fp8 scales are per expert and output channel: [E, 2I] and [E, H]")
    elif fp8_activations:
        raise ValueError(f"fp8 activations (W8A8) need fp8 experts, not {gate_up.dtype}")


def fused_experts(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    activation: str,
    gate_up_scale: torch.Tensor | None = None,
    down_scale: torch.Tensor | None = None,
    fp8_activations: bool = False,
    tile: MoeTile | None = None,
    aligned: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """``reference.fused_experts`` (same arguments and result) in Triton; ``tile`` overrides the
    bucket's (the benchmark's sweep). ``aligned``: ``align(ids, experts, tile.block_m)``'s
    result, already computed (kernels.expert_routing.route_and_align's, with the routing)."""
    _check(x, gate_up, down, weights, ids, activation, gate_up_scale, down_scale, fp8_activations)
    num_tokens, top_k = ids.shape
    experts, two_inter, hidden = gate_up.shape
    inter = two_inter // 2
    out = torch.empty((num_tokens, hidden), dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    tile = tile or call_tile(num_tokens, fp8_activations)
    x = x.contiguous()
    ids = ids.contiguous()
    weights = weights.contiguous().float()
    gate_up_scale = gate_up_scale.contiguous() if gate_up_scale is not None else None
    down_scale = down_scale.contiguous() if down_scale is not None else None
    assert gate_up.stride(2) == 1 and down.stride(2) == 1
    fp8 = gate_up.dtype == FP8
    pairs = num_tokens * top_k
    bm = tile.block_m
    device = x.device

    if aligned is None:
        aligned = align(ids, experts, bm)
    elif aligned[0].shape != (max_padded_rows(pairs, experts, bm),):
        raise ValueError(f"aligned pairs {tuple(aligned[0].shape)} for {pairs} pairs of {bm} rows")
    sorted_pairs, block_expert = aligned
    pdl = pdl_args(device)
    max_blocks = block_expert.shape[0]
    rows = max_blocks * bm

    # fp32 models multiply in fp32 (not TF32): their outputs are compared with HF's exactly.
    # (input_precision does not apply to fp8 operands.)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    h = torch.empty((rows, inter), dtype=x.dtype, device=device)
    gu_scale = gate_up_scale if gate_up_scale is not None else h
    # W8A8: the GEMMs read fp8 rows and their scales; otherwise the scale arguments are unread.
    a, a_scale = quantize_tokens(x) if fp8_activations else (x, h)
    swap_ab = fp8_activations and bm < FP8_MMA_ROWS
    _gate_up_kernel[(max_blocks * triton.cdiv(inter, tile.block_n),)](
        a, a_scale, gate_up, gu_scale, h, sorted_pairs, block_expert, pairs, inter, hidden,
        max_blocks, a.stride(0), gate_up.stride(0), gate_up.stride(1), gu_scale.stride(0),
        h.stride(0), TOP_K=top_k, ACTIVATION=activation, FP8_W=fp8, FP8_A=fp8_activations,
        SWAP_AB=swap_ab, EVEN_K=hidden % tile.block_k == 0, PRECISION=precision, BLOCK_M=bm,
        BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, GROUP_M=tile.group_m,
        num_warps=tile.num_warps, num_stages=tile.num_stages, **pdl,
    )  # fmt: skip
    y = torch.empty((pairs, hidden), dtype=x.dtype, device=device)
    d_scale = down_scale if down_scale is not None else h
    # Rows of the blocks past the last run hold whatever the buffer held: quantized too, never
    # read (their programs exit at once).
    h, h_scale = quantize_tokens(h) if fp8_activations else (h, h)
    _down_kernel[(max_blocks * triton.cdiv(hidden, tile.block_n),)](
        h, h_scale, down, d_scale, weights, y, sorted_pairs, block_expert, pairs, hidden,
        inter, max_blocks, h.stride(0), down.stride(0), down.stride(1), d_scale.stride(0),
        y.stride(0), FP8_W=fp8, FP8_A=fp8_activations, SWAP_AB=swap_ab,
        EVEN_K=inter % tile.block_k == 0,
        PRECISION=precision, BLOCK_M=bm, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
        GROUP_M=tile.group_m, num_warps=tile.num_warps, num_stages=tile.num_stages, **pdl,
    )  # fmt: skip
    block = min(1024, triton.next_power_of_2(hidden))
    _combine_kernel[(num_tokens, triton.cdiv(hidden, block))](
        ids, y, out, hidden, TOP_K=top_k, BLOCK=block, num_warps=4, **pdl
    )
    return out
