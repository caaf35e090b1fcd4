"""Batched LoRA in Triton: a batch whose tokens belong to different adapters, and to none (the
base model), gets each token's own adapter added to a projection's output by two kernels,
shrink (x @ A.T, K -> R) and expand (out += y @ B.T, R -> N), over the batch's token -> slot
map. The twin of ``reference.add_lora_slices``: the slices of a fused projection (q, k, v;
gate, up) in one launch each.

Nothing here reads the slot map on the host, and every shape depends only on the token count,
so the kernels run inside CUDA graphs. A program takes a block of tokens and works only for the
slots its tokens use: a block of the base model's tokens returns at once. Prefill's tokens come
in runs of one request, so a block sees one or two slots; a decode batch mixes them, and the
few weights are re-read from L2 by each block that needs them.

Shrink splits K over programs when there are few tokens (the adapters' A are the bytes to
stream; one program per slot would leave most SMs idle) and stores each split's fp32 partial
sums; expand adds a block's partials in split order in its registers as it loads y:
deterministic, no zeroed buffer or atomics, and no launch between the two."""

from __future__ import annotations

import bisect
import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvfleet.kernels.dependent_launch import enter, pdl_args
from kvfleet.kernels.launch import kernel

# Slices one launch takes: q, k and v of a fused qkv projection.
MAX_SLICES = 3
# The widest rank the tiles are sized for (a program holds [tokens, rank] fp32 sums).
MAX_RANK = 256


@dataclass(frozen=True)
class ShrinkTile:
    block_m: int  # tokens a program
    block_k: int
    split_k: int  # programs sharing one block's K (expand sums their partials)
    num_warps: int = 4
    num_stages: int = 3


@dataclass(frozen=True)
class ExpandTile:
    block_m: int
    block_n: int  # output columns a program
    num_warps: int = 4
    num_stages: int = 2


# (largest token count, shrink's tile, expand's tile) for 16-bit activations and ranks up to
# 32, first match: the H200 sweep's best at Llama-3.1-8B's projections, rank 16, 8 slots
# (``bench/lora_kernel.py --sweep``, bench/RESULTS.md). Few tokens: K split to spread A's bytes
# over the SMs, and narrow expand tiles so that a narrow projection (a k or v shard) still has
# enough programs.
TILES: tuple[tuple[int, ShrinkTile, ExpandTile], ...] = (
    (16, ShrinkTile(16, 128, 16), ExpandTile(16, 32)),
    (32, ShrinkTile(32, 128, 16), ExpandTile(32, 64)),
    (128, ShrinkTile(64, 64, 8), ExpandTile(32, 64)),
    (512, ShrinkTile(32, 128, 4), ExpandTile(32, 128)),
    (1 << 62, ShrinkTile(32, 128, 4), ExpandTile(32, 256)),
)


def _bucket(num_tokens: int) -> tuple[int, ShrinkTile, ExpandTile]:
    return TILES[bisect.bisect_left([bound for bound, _, _ in TILES], num_tokens)]


def block_r(rank: int) -> int:
    return max(16, triton.next_power_of_2(rank))  # tl.dot's smallest side


def fits_registers(block_m: int, rank_tile: int, block_k: int, num_warps: int) -> bool:
    """Whether a shrink thread loads at most 64 elements of x's and A's tiles (their addresses
    take registers too; more spills)."""
    return (block_m + rank_tile) * block_k <= 64 * 32 * num_warps


@functools.cache
def shrink_tile_for(num_tokens: int, rank: int, k: int, itemsize: int = 2) -> ShrinkTile:
    """The table's tile for this token count, fitted to the rank, dtype and K."""
    return fit_shrink_tile(_bucket(num_tokens)[1], rank, k, itemsize)


def fit_shrink_tile(tile: ShrinkTile, rank: int, k: int, itemsize: int = 2) -> ShrinkTile:
    """A table's tile (for a 16-bit row and ranks to 32) for this rank, dtype and K. Its K tile
    takes a quarter the elements of an fp32 row (whose exact dots stage more in shared memory),
    fewer for wider ranks (A's tile grows with the rank), so that the stages fit an SM's shared
    memory and the loads its registers: 8 warps, then a narrower K tile. K is split only while
    each split keeps two K tiles."""
    width = block_r(rank)
    block_k = max(16, tile.block_k // (1 if itemsize <= 2 else 4) // max(1, width // 32))
    warps = tile.num_warps
    while not fits_registers(tile.block_m, width, block_k, warps) and block_k > 16:
        if warps == 4:
            warps = 8
        else:
            block_k //= 2
    split = max(1, min(tile.split_k, k // (2 * block_k)))
    return ShrinkTile(tile.block_m, block_k, split, warps, tile.num_stages)


def expand_tile_for(num_tokens: int) -> ExpandTile:
    return _bucket(num_tokens)[2]


# Address arithmetic: a program's block start is a 64-bit scalar, the offsets within the block
# 32-bit tensors (the tile's pointers then cost one register each, not two).


@triton.jit
def _shrink_slice(
    x_block, a_ptr, out_block, rows, mine, slot, split, k, r, stride_xt, stride_as, stride_ar,
    stride_ot, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    """This program's K range of x @ A.T for the rows of one slot, stored (other rows: 0 in x)."""
    ranks = tl.arange(0, BLOCK_R)
    tiles = tl.cdiv(k, BLOCK_K)
    per_split = tl.cdiv(tiles, SPLIT_K)
    first = split * per_split
    last = tl.minimum(first + per_split, tiles)
    x_rows = x_block + rows[:, None] * stride_xt
    a_rows = a_ptr + slot * stride_as + ranks[:, None] * stride_ar
    acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for i in range(first, last):
        cols = i * BLOCK_K + tl.arange(0, BLOCK_K)
        in_k = cols < k
        x = tl.load(x_rows + cols[None, :], mask=mine[:, None] & in_k[None, :], other=0.0)
        a = tl.load(a_rows + cols[None, :], mask=(ranks[:, None] < r) & in_k[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(a.to(x.dtype)), acc, input_precision="ieee")
    out = out_block + rows[:, None] * stride_ot + ranks[None, :]
    tl.store(out, acc, mask=mine[:, None] & (ranks[None, :] < r))


@kernel
def _shrink_kernel(
    x_ptr, a0_ptr, a1_ptr, a2_ptr, slots_ptr, out_ptr,
    t, k, r, stride_xt, stride_as, stride_ar, stride_os, stride_ot,
    SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    # Grid (token blocks, slots, slices x K splits). out: fp32 partials [n_slices x SPLIT_K,
    # T, R], written for the adapters' rows only (expand reads no other). Each slice is its
    # own call of _shrink_slice (a branch per pointer, nothing merged after).
    enter(PDL)
    start = tl.program_id(0).to(tl.int64) * BLOCK_M
    slot = tl.program_id(1).to(tl.int64)
    pid_z = tl.program_id(2)
    piece = pid_z // SPLIT_K
    split = pid_z % SPLIT_K
    rows = tl.arange(0, BLOCK_M)
    toks = start + rows
    slot_of = tl.load(slots_ptr + toks, mask=toks < t, other=-1)
    x_block = x_ptr + start * stride_xt
    out_block = out_ptr + pid_z.to(tl.int64) * stride_os + start * stride_ot
    mine = slot_of == slot
    if tl.sum(mine.to(tl.int32), 0) != 0:
        if piece == 0:
            _shrink_slice(x_block, a0_ptr, out_block, rows, mine, slot, split, k, r, stride_xt,
                          stride_as, stride_ar, stride_ot, SPLIT_K, BLOCK_M, BLOCK_R,
                          BLOCK_K)  # fmt: skip
        elif piece == 1:
            _shrink_slice(x_block, a1_ptr, out_block, rows, mine, slot, split, k, r, stride_xt,
                          stride_as, stride_ar, stride_ot, SPLIT_K, BLOCK_M, BLOCK_R,
                          BLOCK_K)  # fmt: skip
        else:
            _shrink_slice(x_block, a2_ptr, out_block, rows, mine, slot, split, k, r, stride_xt,
                          stride_as, stride_ar, stride_ot, SPLIT_K, BLOCK_M, BLOCK_R,
                          BLOCK_K)  # fmt: skip


@triton.jit
def _expand_slice(
    parts_block, b_ptr, out_block, rows, slot_of, col_block, n, stride_ps, stride_pt,
    stride_ot, stride_bs, stride_bn, r, num_slots, SPLIT_K: tl.constexpr,
    Y_DTYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):  # fmt: skip
    """One column block of one slice: y, its partials summed in split order and rounded to x's
    dtype as the twin's shrink rounds it; per slot present, y's rows of that slot (the others
    zeroed) times the slot's B, then one read-modify-write of out for the adapters' rows."""
    active = slot_of >= 0
    ranks = tl.arange(0, BLOCK_R)
    cols = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
    in_n = cols < n
    y_offs = rows[:, None] * stride_pt + ranks[None, :]
    y_mask = active[:, None] & (ranks[None, :] < r)
    y_sum = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for s in range(SPLIT_K):
        y_sum += tl.load(parts_block + s * stride_ps + y_offs, mask=y_mask, other=0.0)
    y = y_sum.to(Y_DTYPE)
    b_offs = cols[None, :] * stride_bn + ranks[:, None]
    b_mask = (ranks[:, None] < r) & in_n[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    b_slot = b_ptr
    for s in range(num_slots):
        mine = slot_of == s
        if tl.sum(mine.to(tl.int32), 0) != 0:
            b = tl.load(b_slot + b_offs, mask=b_mask, other=0.0).to(y.dtype)
            y_s = tl.where(mine[:, None], y, tl.zeros_like(y))
            acc = tl.dot(y_s, b, acc, input_precision="ieee")
        b_slot += stride_bs
    out = out_block + rows[:, None] * stride_ot + cols[None, :]
    keep = active[:, None] & in_n[None, :]
    base = tl.load(out, mask=keep, other=0.0).to(tl.float32)
    tl.store(out, (base + acc).to(out_block.dtype.element_ty), mask=keep)


@kernel
def _expand_kernel(
    parts_ptr, b0_ptr, b1_ptr, b2_ptr, slots_ptr, out_ptr,
    t, r, num_slots, stride_ps, stride_pt, stride_bn, stride_ot,
    n0, n1, n2, sb0, sb1, sb2, off0, off1, off2, nb0, nb1,
    SPLIT_K: tl.constexpr, Y_DTYPE: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    # Grid (token blocks, the slices' column blocks one after another): slice i's blocks
    # follow the nb0 (+ nb1) of the slices before it, its partials the SPLIT_K of each slice
    # before it. A block of the base model's tokens only does nothing.
    enter(PDL)
    start = tl.program_id(0).to(tl.int64) * BLOCK_M
    pid_n = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    toks = start + rows
    slot_of = tl.load(slots_ptr + toks, mask=toks < t, other=-1)
    parts_block = parts_ptr + start * stride_pt
    per_slice = SPLIT_K * stride_ps
    out_block = out_ptr + start * stride_ot
    if tl.sum((slot_of >= 0).to(tl.int32), 0) != 0:
        if pid_n < nb0:
            _expand_slice(parts_block, b0_ptr, out_block + off0, rows, slot_of, pid_n, n0,
                          stride_ps, stride_pt, stride_ot, sb0, stride_bn, r, num_slots,
                          SPLIT_K, Y_DTYPE, BLOCK_M, BLOCK_N, BLOCK_R)  # fmt: skip
        elif pid_n < nb0 + nb1:
            _expand_slice(parts_block + per_slice, b1_ptr, out_block + off1, rows, slot_of,
                          pid_n - nb0, n1, stride_ps, stride_pt, stride_ot, sb1, stride_bn, r,
                          num_slots, SPLIT_K, Y_DTYPE, BLOCK_M, BLOCK_N,
                          BLOCK_R)  # fmt: skip
        else:
            _expand_slice(parts_block + 2 * per_slice, b2_ptr, out_block + off2, rows,
                          slot_of, pid_n - nb0 - nb1, n2, stride_ps, stride_pt, stride_ot, sb2,
                          stride_bn, r, num_slots, SPLIT_K, Y_DTYPE, BLOCK_M, BLOCK_N,
                          BLOCK_R)  # fmt: skip


# y's dtype in the expand kernel: x's, as the twin rounds the shrink's sums.
_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def _padded(items: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    # Unused slice arguments repeat the first (never read).
    return [*items, *[items[0]] * (MAX_SLICES - len(items))]


def _check(
    x: torch.Tensor,
    a_slices: Sequence[torch.Tensor],
    b_slices: Sequence[torch.Tensor],
    slots: torch.Tensor,
    out: torch.Tensor,
    offsets: Sequence[int],
) -> None:
    pieces = len(a_slices)
    if not 1 <= pieces <= MAX_SLICES:
        raise ValueError(f"a LoRA launch takes 1-{MAX_SLICES} slices, not {pieces}")
    if len(b_slices) != pieces or len(offsets) != pieces:
        raise ValueError(
            f"{pieces} slices of A need as many of B and offsets, not {len(b_slices)} and "
            f"{len(offsets)}"
        )
    t, k = x.shape
    num_slots, r, _ = a_slices[0].shape
    if r > MAX_RANK:
        raise ValueError(f"LoRA kernels take ranks up to {MAX_RANK}, not {r}")
    if x.dtype not in _TL_DTYPES:
        raise ValueError(f"LoRA kernels take activations in {list(_TL_DTYPES)}, not {x.dtype}")
    for a in a_slices:
        assert a.shape == (num_slots, r, k) and a.dtype == a_slices[0].dtype
        assert a.stride(2) == 1 and a.stride() == a_slices[0].stride()
    for b, offset in zip(b_slices, offsets, strict=True):
        n = b.shape[1]
        assert b.shape == (num_slots, n, r) and b.stride(2) == 1 and b.dtype == b_slices[0].dtype
        assert b.stride(1) == b_slices[0].stride(1)
        if not 0 <= offset <= out.shape[1] - n:
            raise ValueError(f"columns {offset}:{offset + n} are outside out's {out.shape[1]}")
    assert x.stride(1) == 1 and out.stride(1) == 1 and out.shape[0] == t and slots.shape == (t,)


def add_lora_slices(
    x: torch.Tensor,  # [T, K]
    a_slices: Sequence[torch.Tensor],  # each [S, R, K]
    b_slices: Sequence[torch.Tensor],  # each [S, N_i, R]
    slots: torch.Tensor,  # [T] int32, in [-1, S)
    out: torch.Tensor,  # [T, >= offsets[i] + N_i]
    offsets: Sequence[int],
    shrink: ShrinkTile | None = None,
    expand: ExpandTile | None = None,
) -> None:
    """out[:, offsets[i]:offsets[i] + N_i] += (x @ A_i.T) @ B_i.T of each token's slot, in
    place, for every slice i; the base model's rows untouched. Two launches: shrink, expand.
    `shrink` / `expand` override the token count's tiles (the benchmark's sweep). The twin of
    reference.add_lora_slices."""
    _check(x, a_slices, b_slices, slots, out, offsets)
    t, k = x.shape
    num_slots, r, _ = a_slices[0].shape
    if t == 0:
        return
    pieces = len(a_slices)
    shrink = shrink or shrink_tile_for(t, r, k, x.element_size())
    expand = expand or expand_tile_for(t)
    split = shrink.split_k
    parts = torch.empty((pieces * split, t, r), dtype=torch.float32, device=x.device)
    width = block_r(r)
    pdl = pdl_args(x.device)
    a = _padded(a_slices)
    _shrink_kernel[(triton.cdiv(t, shrink.block_m), num_slots, pieces * split)](
        x, a[0], a[1], a[2], slots, parts, t, k, r, x.stride(0), a[0].stride(0),
        a[0].stride(1), parts.stride(0), parts.stride(1), SPLIT_K=split,
        BLOCK_M=shrink.block_m, BLOCK_R=width, BLOCK_K=shrink.block_k,
        num_warps=shrink.num_warps, num_stages=shrink.num_stages, **pdl,
    )  # fmt: skip
    widths = [b.shape[1] for b in b_slices]
    blocks = [triton.cdiv(n, expand.block_n) for n in widths]
    b = _padded(b_slices)
    unused = MAX_SLICES - pieces
    _expand_kernel[(triton.cdiv(t, expand.block_m), sum(blocks))](
        parts, b[0], b[1], b[2], slots, out, t, r, num_slots, parts.stride(0), parts.stride(1),
        b[0].stride(1), out.stride(0), *widths, *[0] * unused, *[s.stride(0) for s in b],
        *offsets, *[0] * unused, *[*blocks, 0, 0][:2], SPLIT_K=split,
        Y_DTYPE=_TL_DTYPES[x.dtype], BLOCK_M=expand.block_m, BLOCK_N=expand.block_n,
        BLOCK_R=width, num_warps=expand.num_warps, num_stages=expand.num_stages, **pdl,
    )  # fmt: skip
