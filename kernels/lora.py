"""Batched LoRA in Triton: a batch whose tokens belong to different adapters, and to none (the
base model), gets each token's own adapter from two kernels per projection, shrink (x @ A.T,
K -> R) and expand (out += y @ B.T, R -> N), over the batch's token -> slot map. Twins of
``reference.lora_shrink`` / ``lora_expand`` and their multi-slice forms, which serve a fused
projection (q, k, v; gate, up) in one launch each.

Nothing here reads the slot map on the host, and every shape depends only on the token count,
so the kernels run inside CUDA graphs. A program takes a block of tokens and works only for the
slots its tokens use: a block of the base model's tokens returns at once. Prefill's tokens come
in runs of one request, so a block sees one or two slots; a decode batch mixes them, and the
few weights are re-read from L2 by each block that needs them.

Shrink splits K over programs when there are few tokens (the adapters' A are the bytes to
stream; one program per slot would leave most SMs idle) and sums the partials in split order in
a second small launch: deterministic, and no zeroed buffer or atomics. Expand needs no split:
its N is wide."""

from __future__ import annotations

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
    split_k: int  # programs sharing one block's K (partials summed by a second launch)
    num_warps: int = 4
    num_stages: int = 3


@dataclass(frozen=True)
class ExpandTile:
    block_m: int
    block_n: int  # output columns a program
    num_warps: int = 4
    num_stages: int = 2


# (largest token count, shrink's tokens a program, K split, expand's tokens and columns a
# program), first match. Few tokens: K split to spread A's bytes over the SMs, and narrow
# expand tiles so that a narrow projection (a k or v shard) still has enough programs.
_TILES = (
    (16, 16, 16, 16, 64),
    (128, 32, 4, 32, 64),
    (512, 64, 2, 64, 128),
    (1 << 62, 64, 1, 64, 128),
)


def _block_r(rank: int) -> int:
    return max(16, triton.next_power_of_2(rank))  # tl.dot's smallest side


@functools.cache
def shrink_tile(num_tokens: int, rank: int, k: int, itemsize: int = 2) -> ShrinkTile:
    """The table's row for this token count. The K tile holds 512 bytes of a 16-bit row (256 of
    an fp32 one, whose exact dots stage more in shared memory), less for ranks above 32 (A's
    tile grows with the rank), so that three stages fit an SM's shared memory. A thread loads
    at most 64 elements of x's and A's tiles (their addresses take registers too; more
    spills): 8 warps, then a narrower K tile. K is split only while each split keeps two K
    tiles."""
    _, block_m, split, _, _ = next(row for row in _TILES if num_tokens <= row[0])
    block_r = _block_r(rank)
    row_bytes = 512 if itemsize <= 2 else 256
    block_k = max(16, row_bytes // itemsize // max(1, block_r // 32))
    warps = 4
    while (block_m + block_r) * block_k > 64 * 32 * warps and block_k > 16:
        if warps == 4:
            warps = 8
        else:
            block_k //= 2
    split = max(1, min(split, k // (2 * block_k)))
    return ShrinkTile(block_m, block_k, split, num_warps=warps)


@functools.cache
def expand_tile(num_tokens: int, rank: int) -> ExpandTile:
    _, _, _, block_m, block_n = next(row for row in _TILES if num_tokens <= row[0])
    return ExpandTile(block_m, block_n, num_warps=8 if block_m * block_n >= 64 * 128 else 4)


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
    tl.store(out, acc.to(out_block.dtype.element_ty), mask=mine[:, None] & (ranks[None, :] < r))


@kernel
def _shrink_kernel(
    x_ptr, a0_ptr, a1_ptr, a2_ptr, slots_ptr, out_ptr,
    t, k, r, stride_xt, stride_as, stride_ar, stride_os, stride_ot,
    SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    # Grid (token blocks, slots, slices x K splits). out is y [n_slices, T, R] in x's dtype,
    # or, split, fp32 partials [n_slices x SPLIT_K, T, R] that _sum_splits_kernel adds. Each
    # slice is its own call of _shrink_slice (a branch per pointer, nothing merged after).
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
    # Nested, not `and`: a compile-time condition, then a runtime one.
    if SPLIT_K == 1:  # noqa: SIM102
        if slot == 0:
            # The base model's rows are zero (split, the partials' sum writes them).
            ranks = tl.arange(0, BLOCK_R)
            base = ((slot_of == -1) & (toks < t))[:, None] & (ranks[None, :] < r)
            tl.store(out_block + rows[:, None] * stride_ot + ranks[None, :],
                     tl.zeros([BLOCK_M, BLOCK_R], out_ptr.dtype.element_ty), mask=base)  # fmt: skip
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


@kernel
def _sum_splits_kernel(
    part_ptr, slots_ptr, out_ptr, t, r, stride_ps, stride_pt, stride_os, stride_ot,
    SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    # Grid (token blocks, slices): y[slice] = the sum of its splits in order, 0 for the base
    # model's rows (whose partials nothing wrote).
    enter(PDL)
    start = tl.program_id(0).to(tl.int64) * BLOCK_M
    piece = tl.program_id(1).to(tl.int64)
    rows = tl.arange(0, BLOCK_M)
    ranks = tl.arange(0, BLOCK_R)
    toks = start + rows
    active = tl.load(slots_ptr + toks, mask=toks < t, other=-1) >= 0
    valid = (toks[:, None] < t) & (ranks[None, :] < r)
    parts = part_ptr + piece * SPLIT_K * stride_ps + start * stride_pt
    offs = rows[:, None] * stride_pt + ranks[None, :]
    total = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for s in range(SPLIT_K):
        total += tl.load(parts + s * stride_ps + offs, mask=active[:, None] & valid, other=0.0)
    out = out_ptr + piece * stride_os + start * stride_ot + rows[:, None] * stride_ot
    tl.store(out + ranks[None, :], total.to(out_ptr.dtype.element_ty), mask=valid)


@triton.jit
def _expand_slice(
    y_block, b_ptr, out_block, rows, slot_of, col_block, n, stride_yt, stride_ot, stride_bs,
    stride_bn, r, num_slots, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):  # fmt: skip
    """One column block of one slice: per slot present, y's rows of that slot (the others
    zeroed) times the slot's B, then one read-modify-write of out for the adapters' rows."""
    active = slot_of >= 0
    ranks = tl.arange(0, BLOCK_R)
    cols = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
    in_n = cols < n
    y = tl.load(y_block + rows[:, None] * stride_yt + ranks[None, :],
                mask=active[:, None] & (ranks[None, :] < r), other=0.0)  # fmt: skip
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
    y_ptr, b0_ptr, b1_ptr, b2_ptr, slots_ptr, out_ptr,
    t, r, num_slots, stride_ys, stride_yt, stride_bn, stride_ot,
    n0, n1, n2, sb0, sb1, sb2, off0, off1, off2, nb0, nb1,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    # Grid (token blocks, the slices' column blocks one after another): slice i's blocks
    # follow the nb0 (+ nb1) of the slices before it. A block of the base model's tokens only
    # does nothing.
    enter(PDL)
    start = tl.program_id(0).to(tl.int64) * BLOCK_M
    pid_n = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    toks = start + rows
    slot_of = tl.load(slots_ptr + toks, mask=toks < t, other=-1)
    y_block = y_ptr + start * stride_yt
    out_block = out_ptr + start * stride_ot
    if tl.sum((slot_of >= 0).to(tl.int32), 0) != 0:
        if pid_n < nb0:
            _expand_slice(y_block, b0_ptr, out_block + off0, rows, slot_of, pid_n, n0,
                          stride_yt, stride_ot, sb0, stride_bn, r, num_slots, BLOCK_M, BLOCK_N,
                          BLOCK_R)  # fmt: skip
        elif pid_n < nb0 + nb1:
            _expand_slice(y_block + stride_ys, b1_ptr, out_block + off1, rows, slot_of,
                          pid_n - nb0, n1, stride_yt, stride_ot, sb1, stride_bn, r, num_slots,
                          BLOCK_M, BLOCK_N, BLOCK_R)  # fmt: skip
        else:
            _expand_slice(y_block + 2 * stride_ys, b2_ptr, out_block + off2, rows, slot_of,
                          pid_n - nb0 - nb1, n2, stride_yt, stride_ot, sb2, stride_bn, r,
                          num_slots, BLOCK_M, BLOCK_N, BLOCK_R)  # fmt: skip


def _padded(items: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    # Unused slice arguments repeat the first (never read).
    return [*items, *[items[0]] * (MAX_SLICES - len(items))]


def _check(count: int, rank: int) -> None:
    if not 1 <= count <= MAX_SLICES:
        raise ValueError(f"a LoRA launch takes 1-{MAX_SLICES} slices, not {count}")
    if rank > MAX_RANK:
        raise ValueError(f"LoRA kernels take ranks up to {MAX_RANK}, not {rank}")


def lora_shrink_slices(
    x: torch.Tensor, a_slices: Sequence[torch.Tensor], slots: torch.Tensor
) -> torch.Tensor:
    """[n_slices, T, R] in x's dtype: x @ A.T of each token's slot in each slice, zero for the
    base model's tokens (slot -1). The twin of reference.lora_shrink_slices."""
    t, k = x.shape
    num_slots, r, _ = a_slices[0].shape
    _check(len(a_slices), r)
    for a in a_slices:
        assert a.shape == a_slices[0].shape and a.dtype == a_slices[0].dtype and a.shape[2] == k
        assert a.stride(2) == 1 and a.stride() == a_slices[0].stride()
    assert x.stride(1) == 1 and slots.shape == (t,)
    pieces = len(a_slices)
    y = torch.empty((pieces, t, r), dtype=x.dtype, device=x.device)
    if t == 0:
        return y
    tile = shrink_tile(t, r, k, x.element_size())
    split = tile.split_k
    out = (
        y
        if split == 1
        else torch.empty((pieces * split, t, r), dtype=torch.float32, device=x.device)
    )
    block_r = _block_r(r)
    pdl = pdl_args(x.device)
    a = _padded(a_slices)
    _shrink_kernel[(triton.cdiv(t, tile.block_m), num_slots, pieces * split)](
        x, a[0], a[1], a[2], slots, out, t, k, r, x.stride(0), a[0].stride(0), a[0].stride(1),
        out.stride(0), out.stride(1), SPLIT_K=split, BLOCK_M=tile.block_m, BLOCK_R=block_r,
        BLOCK_K=tile.block_k, num_warps=tile.num_warps,
        num_stages=tile.num_stages, **pdl,
    )  # fmt: skip
    if split > 1:
        rows = min(64, 4096 // block_r)  # a program's sums: 32 floats a thread
        _sum_splits_kernel[(triton.cdiv(t, rows), pieces)](
            out, slots, y, t, r, out.stride(0), out.stride(1), y.stride(0), y.stride(1),
            SPLIT_K=split, BLOCK_M=rows, BLOCK_R=block_r, **pdl,
        )  # fmt: skip
    return y


def lora_expand_slices(
    y: torch.Tensor,  # [n_slices, T, R]
    b_slices: Sequence[torch.Tensor],  # each [S, N_i, R]
    slots: torch.Tensor,
    out: torch.Tensor,
    offsets: Sequence[int],
) -> None:
    """out[:, offsets[i]:offsets[i] + N_i] += y[i] @ B_i.T of each token's slot, in place, for
    every slice i; the base model's rows untouched. The twin of reference.lora_expand_slices."""
    pieces = len(b_slices)
    _, t, r = y.shape
    _check(pieces, r)
    if len(offsets) != pieces or y.shape[0] != pieces:
        raise ValueError(f"{pieces} slices need as many offsets and y's, not {len(offsets)}")
    num_slots = b_slices[0].shape[0]
    widths = [b.shape[1] for b in b_slices]
    for b, offset, n in zip(b_slices, offsets, widths, strict=True):
        assert b.shape == (num_slots, n, r) and b.stride(2) == 1 and b.dtype == b_slices[0].dtype
        assert b.stride(1) == b_slices[0].stride(1)
        if not 0 <= offset <= out.shape[1] - n:
            raise ValueError(f"columns {offset}:{offset + n} are outside out's {out.shape[1]}")
    assert y.stride(2) == 1 and out.stride(1) == 1 and out.shape[0] == t and slots.shape == (t,)
    if t == 0:
        return
    tile = expand_tile(t, r)
    blocks = [triton.cdiv(n, tile.block_n) for n in widths]
    b = _padded(b_slices)
    n_args = [*widths, *[0] * (MAX_SLICES - pieces)]
    sb = [x.stride(0) for x in b]
    off = [*offsets, *[0] * (MAX_SLICES - pieces)]
    nb = [*blocks, *[0] * (MAX_SLICES - pieces)]
    _expand_kernel[(triton.cdiv(t, tile.block_m), sum(blocks))](
        y, b[0], b[1], b[2], slots, out, t, r, num_slots, y.stride(0), y.stride(1),
        b[0].stride(1), out.stride(0), *n_args, *sb, *off, nb[0], nb[1],
        BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_R=_block_r(r),
        num_warps=tile.num_warps, num_stages=tile.num_stages,
        **pdl_args(y.device),
    )  # fmt: skip


def lora_shrink(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """[T, R]: the one-slice lora_shrink_slices (the twin of reference.lora_shrink)."""
    return lora_shrink_slices(x, [a], slots)[0]


def lora_expand(
    y: torch.Tensor, b: torch.Tensor, slots: torch.Tensor, out: torch.Tensor, offset: int = 0
) -> None:
    """The one-slice lora_expand_slices (the twin of reference.lora_expand)."""
    lora_expand_slices(y.unsqueeze(0), [b], slots, out, [offset])
