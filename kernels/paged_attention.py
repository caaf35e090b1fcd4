"""Paged attention in Triton, the twin of ``reference.paged_attention`` (tested against it).

Decode is split-KV ("flash decoding"): each sequence's range is cut into slices on the device,
so the grid depends only on static sizes (CUDA-graph safe), and a second kernel merges the
slices' partials; a batch that shares a cached prefix reads it once for all its queries
(cascade). Prefill is flash attention over ragged query chunks. Both put a KV head's whole GQA
group in one tile, so each K/V tile is read once per KV head. Scores are fp32 in the log2
domain, and running maxima start finite, so a row that sees no key gives zeros, not NaN. The
measurements behind the tiles and split counts are in bench/RESULTS.md.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvfleet.kernels.dependent_launch import enter, pdl_args
from kvfleet.kernels.reference import is_fp8, kv_scales

# Pyright reads Triton's typing, which does not describe JIT code: `kernel[grid]` has the
# kernel's own signature (no launch options), a tl.constexpr parameter takes no plain value,
# tl.range iterates only under @triton.jit, and reductions may be tuples. The pyright ignores
# below are those four.
_LOG2E = tl.constexpr(1.4426950408889634)
_NEG_INIT = tl.constexpr(-1.0e30)
# Stands in for "no sliding window": k_pos > q_pos - 2**30 holds for every real position, so one
# code path serves both cases.
_NO_WINDOW = 1 << 30
# A decode split's fixed costs (a program slot, a partial written and read back) only pay off once
# it reads at least this many tokens.
_MIN_TOKENS_PER_SPLIT = 256
# Query rows (sequence x query head) per program of the cascade kernel's shared-prefix pass.
_PREFIX_BLOCK_M = 64
# Prefill's big tile by the operands' element size and head_dim: (BLOCK_M rows, BLOCK_N keys,
# num_warps, num_stages), each the fastest of a sweep (bench/RESULTS.md); the 16-bit tiles use
# up to ~220 KB of shared memory, Hopper-sized. 1: 16-bit queries over an FP8 cache, whose V by
# dimension puts 8 pages of a 128-key tile on the same shared-memory banks (4 with 64 keys).
# fp32 (ieee products, a correctness path) gets tiles that fit the same memory.
_PREFILL_TILE = {
    1: {64: (128, 64, 4, 2), 128: (128, 64, 4, 3), 256: (128, 64, 8, 2)},
    2: {64: (128, 64, 4, 2), 128: (128, 128, 8, 3), 256: (128, 64, 8, 2)},
    4: {64: (64, 64, 4, 2), 128: (64, 32, 4, 2), 256: (32, 32, 4, 2)},
}


@triton.jit
def _scaled_scores(s, scale, soft_cap, HAS_SOFT_CAP: tl.constexpr):
    """Raw q.k products -> scaled (and soft-capped) scores in the log2 domain."""
    s = s * scale
    if HAS_SOFT_CAP:
        # tanh(x) = 1 - 2 / (exp(2x) + 1): overflow of exp gives exactly +1, underflow -1, and
        # no NaN either way, so no clamping is needed.
        s = soft_cap * (1.0 - 2.0 / (tl.exp(2.0 * s / soft_cap) + 1.0))
    return s * _LOG2E


@triton.jit
def _head_bases(kv_ptr, kv_head, stride_ckv, stride_chead, HEAD_DIM, PAGE_SIZE, V_BY_DIM):
    """Where this KV head's keys and values start within block 0."""
    k_base = kv_ptr + kv_head * stride_chead
    if V_BY_DIM:
        v_base = kv_ptr + stride_ckv + kv_head * (HEAD_DIM * PAGE_SIZE)
    else:
        v_base = k_base + stride_ckv
    return k_base, v_base


@triton.jit
def _attend_tile(
    q,
    m_i,
    l_i,
    acc,
    k_base,
    v_base,
    bt_row,
    start,
    lo,
    hi,
    q_pos,
    window,
    scale,
    soft_cap,
    stride_cblk,
    stride_ctok,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    MASK: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_SOFT_CAP: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    V_BY_DIM: tl.constexpr,
):
    """One online-softmax step over keys [start, start + BLOCK_N). With MASK, keys outside
    [lo, hi) are dropped, and with CAUSAL also keys that row's q_pos and window hide. Without
    MASK the caller guarantees that every key is in the context and visible to every row, and the
    tile runs with no mask arithmetic at all. V_BY_DIM: an FP8 cache (reference's layout), whose
    pages are read whole; `start` must then be a multiple of min(PAGE_SIZE, BLOCK_N), as every
    caller's tiles are (they start on a page, a split or a tile boundary)."""
    toks = start + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, HEAD_DIM)
    if MASK:
        kv_ok = (toks >= lo) & (toks < hi)
    if V_BY_DIM:
        # The tile as runs of keys that share a page: one block-table read per run, and loads
        # whose contiguity the compiler can see (16 bytes of V per dimension and page), where a
        # per-key mask or page would make it load byte by byte. Unmasked: slots past the context
        # hold finite values (no NaN in an FP8 cache) and get zero weight from the scores' mask;
        # runs past `hi` read block 0.
        RUN: tl.constexpr = min(PAGE_SIZE, BLOCK_N)
        # `start` is a multiple of RUN; rounding it down says so to the compiler, which drops
        # a multiple_of hint on a loop's induction variable.
        runs = start // RUN * RUN + tl.arange(0, BLOCK_N // RUN) * RUN
        if MASK:
            pages = tl.load(bt_row + runs // PAGE_SIZE, mask=runs < hi, other=0)
        else:
            pages = tl.load(bt_row + runs // PAGE_SIZE)
        page_base = pages.to(tl.int64) * stride_cblk
        in_page = runs % PAGE_SIZE
        j = tl.arange(0, RUN)[None, :, None]
        d = dims[None, None, :]
        k_off = (page_base + in_page * stride_ctok)[:, None, None] + j * stride_ctok + d
        v_off = (page_base + in_page)[:, None, None] + j + d * PAGE_SIZE
        k = tl.reshape(tl.load(k_base + k_off), [BLOCK_N, HEAD_DIM]).to(DOT_DTYPE)
        v = tl.reshape(tl.load(v_base + v_off), [BLOCK_N, HEAD_DIM]).to(DOT_DTYPE)
    elif MASK:
        pages = tl.load(bt_row + toks // PAGE_SIZE, mask=kv_ok, other=0).to(tl.int64)
        kv_off = (pages * stride_cblk + (toks % PAGE_SIZE) * stride_ctok)[:, None] + dims[None, :]
        # Masked lanes read as 0: never-written cache slots may hold NaN, and 0 * NaN is NaN.
        k = tl.load(k_base + kv_off, mask=kv_ok[:, None], other=0.0).to(DOT_DTYPE)
        v = tl.load(v_base + kv_off, mask=kv_ok[:, None], other=0.0).to(DOT_DTYPE)
    else:
        pages = tl.load(bt_row + toks // PAGE_SIZE).to(tl.int64)
        kv_off = (pages * stride_cblk + (toks % PAGE_SIZE) * stride_ctok)[:, None] + dims[None, :]
        k = tl.load(k_base + kv_off).to(DOT_DTYPE)
        v = tl.load(v_base + kv_off).to(DOT_DTYPE)
    s = tl.dot(q, tl.trans(k), input_precision="ieee")
    s = _scaled_scores(s, scale, soft_cap, HAS_SOFT_CAP)
    if MASK:
        if CAUSAL:
            visible = (
                kv_ok[None, :]
                & (toks[None, :] <= q_pos[:, None])
                & (toks[None, :] > q_pos[:, None] - window)
            )
        else:
            visible = kv_ok[None, :]
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(DOT_DTYPE), v, acc * alpha[:, None], input_precision="ieee")  # pyright: ignore[reportArgumentType]
    return m_new, l_i, acc


@triton.jit
def _decode_split_kernel(
    q_ptr,
    kv_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,
    part_o_ptr,
    part_m_ptr,
    part_l_ptr,
    prefix_len_ptr,
    k_scale_ptr,
    v_scale_ptr,
    scale,
    soft_cap,
    window,
    stride_qb,
    stride_qh,
    stride_ob,
    stride_oh,
    stride_ckv,
    stride_cblk,
    stride_ctok,
    stride_chead,
    stride_bt,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    NUM_PARTS: tl.constexpr,
    HAS_PREFIX: tl.constexpr,
    HAS_SOFT_CAP: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    KV_FP8: tl.constexpr,
    PDL: tl.constexpr,
):
    enter(PDL)
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)

    # The query is position seq_len - 1; keys visible iff k_pos > seq_len - 1 - window.
    lo = tl.maximum(seq_len - window, 0)
    first_tok = (lo // PAGE_SIZE) * PAGE_SIZE
    if HAS_PREFIX:
        # The shared prefix (whole pages, no window) is the prefix kernel's part.
        first_tok = tl.maximum(first_tok, tl.load(prefix_len_ptr).to(tl.int32))
    # Split the visible range in whole tiles, so consecutive splits never share a tile.
    num_tiles = tl.cdiv(seq_len - first_tok, BLOCK_N)
    tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    tok_start = first_tok + split * tiles_per_split * BLOCK_N
    tok_end = tl.minimum(tok_start + tiles_per_split * BLOCK_N, seq_len)

    g = tl.arange(0, BLOCK_G)
    dims = tl.arange(0, HEAD_DIM)
    heads = kv_head * GROUP + g
    g_ok = g < GROUP
    q = tl.load(
        q_ptr + seq.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + dims[None, :],
        mask=g_ok[:, None],
        other=0.0,
    ).to(DOT_DTYPE)

    k_base, v_base = _head_bases(
        kv_ptr, kv_head, stride_ckv, stride_chead, HEAD_DIM, PAGE_SIZE, V_BY_DIM=KV_FP8
    )
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    if KV_FP8:
        scale = scale * tl.load(k_scale_ptr)
    m_i = tl.full([BLOCK_G], _NEG_INIT, tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    for start in tl.range(tok_start, tok_end, BLOCK_N):  # pyright: ignore[reportGeneralTypeIssues]
        # Not CAUSAL: the one query sees all of [lo, tok_end); `lo` fills the unused q_pos.
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, k_base, v_base, bt_row, start, lo, tok_end, lo, window, scale,
            soft_cap, stride_cblk, stride_ctok, BLOCK_N, HEAD_DIM, PAGE_SIZE,
            MASK=True, CAUSAL=False, HAS_SOFT_CAP=HAS_SOFT_CAP, DOT_DTYPE=DOT_DTYPE,  # pyright: ignore[reportArgumentType]
            V_BY_DIM=KV_FP8,
        )  # fmt: skip
    if KV_FP8:
        acc = acc * tl.load(v_scale_ptr)

    if NUM_PARTS == 1:
        o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(
            out_ptr + seq.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + dims[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=g_ok[:, None],
        )
    else:
        # Partials are [num_seqs, num_heads, NUM_PARTS] (+ [HEAD_DIM]), contiguous: the splits'
        # first, then the prefix kernel's.
        part = (seq.to(tl.int64) * (tl.num_programs(1) * GROUP) + heads) * NUM_PARTS + split
        _store_partial(part_o_ptr, part_m_ptr, part_l_ptr, part, m_i, l_i, acc, g_ok, HEAD_DIM)


@triton.jit
def _store_partial(part_o_ptr, part_m_ptr, part_l_ptr, part, m_i, l_i, acc, ok, HEAD_DIM):
    dims = tl.arange(0, HEAD_DIM)
    tl.store(part_m_ptr + part, m_i, mask=ok)
    tl.store(part_l_ptr + part, l_i, mask=ok)
    tl.store(part_o_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc, mask=ok[:, None])


@triton.jit
def _decode_prefix_kernel(
    q_ptr,
    kv_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    prefix_len_ptr,
    part_o_ptr,
    part_m_ptr,
    part_l_ptr,
    k_scale_ptr,
    v_scale_ptr,
    num_seqs,
    scale,
    soft_cap,
    stride_qb,
    stride_qh,
    stride_ckv,
    stride_cblk,
    stride_ctok,
    stride_chead,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    PREFIX_SPLITS: tl.constexpr,
    HAS_SOFT_CAP: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    KV_FP8: tl.constexpr,
    PDL: tl.constexpr,
):
    """Grid (row tiles, num_kv_heads, PREFIX_SPLITS). A row is one (sequence, query head of this
    KV head); every row sees the whole prefix [0, prefix_len), whose pages are block-table row
    0's. Padding rows (seq_len 0 < prefix_len) store an empty partial, so they come out zero."""
    enter(PDL)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    prefix_len = tl.load(prefix_len_ptr).to(tl.int32)
    r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    seq = r // GROUP
    head = kv_head * GROUP + r % GROUP
    in_batch = r < num_seqs * GROUP
    seq_len = tl.load(seq_lens_ptr + seq, mask=in_batch, other=0).to(tl.int32)
    ok = in_batch & (seq_len >= prefix_len)
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(
        q_ptr + seq.to(tl.int64)[:, None] * stride_qb + head[:, None] * stride_qh + dims[None, :],
        mask=ok[:, None],
        other=0.0,
    ).to(DOT_DTYPE)

    num_tiles = tl.cdiv(prefix_len, BLOCK_N)
    tiles_per_split = tl.cdiv(num_tiles, PREFIX_SPLITS)
    tok_start = split * tiles_per_split * BLOCK_N
    tok_end = tl.minimum(tok_start + tiles_per_split * BLOCK_N, prefix_len)
    k_base, v_base = _head_bases(
        kv_ptr, kv_head, stride_ckv, stride_chead, HEAD_DIM, PAGE_SIZE, V_BY_DIM=KV_FP8
    )
    if KV_FP8:
        scale = scale * tl.load(k_scale_ptr)
    m_i = tl.full([BLOCK_M], _NEG_INIT, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for start in tl.range(tok_start, tok_end, BLOCK_N):  # pyright: ignore[reportGeneralTypeIssues]
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, k_base, v_base, block_tables_ptr, start, 0, tok_end,
            0, 0, scale, soft_cap, stride_cblk, stride_ctok, BLOCK_N, HEAD_DIM, PAGE_SIZE,
            MASK=True, CAUSAL=False, HAS_SOFT_CAP=HAS_SOFT_CAP, DOT_DTYPE=DOT_DTYPE,  # pyright: ignore[reportArgumentType]
            V_BY_DIM=KV_FP8,
        )  # fmt: skip
    if KV_FP8:
        acc = acc * tl.load(v_scale_ptr)
    acc = tl.where(ok[:, None], acc, 0.0)  # a padding row's zero query still scores keys
    num_heads = tl.num_programs(1) * GROUP
    part = (seq.to(tl.int64) * num_heads + head) * (NUM_SPLITS + PREFIX_SPLITS) + NUM_SPLITS + split
    _store_partial(part_o_ptr, part_m_ptr, part_l_ptr, part, m_i, l_i, acc, in_batch, HEAD_DIM)


@triton.jit
def _decode_reduce_kernel(
    part_o_ptr,
    part_m_ptr,
    part_l_ptr,
    out_ptr,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    NUM_PARTS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    PDL: tl.constexpr,
):
    enter(PDL)
    seq = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, BLOCK_S)
    dims = tl.arange(0, HEAD_DIM)
    s_ok = splits < NUM_PARTS
    base = (seq.to(tl.int64) * tl.num_programs(1) + head) * NUM_PARTS + splits
    m = tl.load(part_m_ptr + base, mask=s_ok, other=_NEG_INIT)
    l_s = tl.load(part_l_ptr + base, mask=s_ok, other=0.0)
    o = tl.load(
        part_o_ptr + base[:, None] * HEAD_DIM + dims[None, :], mask=s_ok[:, None], other=0.0
    )
    # Empty splits carry (m=_NEG_INIT, l=0, o=0): weight <= 1 times zeros, so they drop out.
    w = tl.exp2(m - tl.max(m, 0))
    denom = tl.sum(w * l_s, 0)
    acc = tl.sum(o * w[:, None], 0)
    acc = acc / tl.where(denom > 0.0, denom, 1.0)  # pyright: ignore[reportOperatorIssue]
    tl.store(
        out_ptr + seq.to(tl.int64) * stride_ob + head * stride_oh + dims,
        acc.to(out_ptr.dtype.element_ty),
    )


# Arguments that change from step to step are not specialized on (Triton would otherwise compile a
# variant for each "== 1" / "% 16 == 0" pattern of them, mid-serving, at ~0.5 s each).
@triton.jit(do_not_specialize=["num_seqs", "min_q_len", "max_q_len", "stride_bt"])
def _prefill_kernel(
    q_ptr,
    kv_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    out_ptr,
    k_scale_ptr,
    v_scale_ptr,
    scale,
    soft_cap,
    window,
    num_seqs,
    min_q_len,
    max_q_len,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_ckv,
    stride_cblk,
    stride_ctok,
    stride_chead,
    stride_bt,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HAS_SOFT_CAP: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    BLOCK_SEQS: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    BLOCK_Q: tl.constexpr = BLOCK_M // GROUP_PAD
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    if BLOCK_SEQS > 0:
        # Programs are laid out flat over the batch: sequence i owns program ids from
        # qsl[i] // BLOCK_Q + i up to the next sequence's, at least cdiv(q_len, BLOCK_Q) of them.
        # The grid thus follows the total token count (host-known) rather than
        # num_seqs * max_query_len, which is mostly empty programs for ragged batches.
        idx = tl.arange(0, BLOCK_SEQS)
        firsts = tl.load(query_start_loc_ptr + idx, mask=idx < num_seqs, other=1 << 30)
        owners = firsts.to(tl.int32) // BLOCK_Q + idx
        seq = tl.sum((owners <= pid).to(tl.int32), 0) - 1  # pyright: ignore[reportOperatorIssue]
        q_start = tl.load(query_start_loc_ptr + seq).to(tl.int32)
        first_q = (pid - (q_start // BLOCK_Q + seq)) * BLOCK_Q
    else:
        # One program per sequence: this launch owns chunks of at most BLOCK_Q tokens.
        seq = pid
        q_start = tl.load(query_start_loc_ptr + seq).to(tl.int32)
        first_q = 0
    q_len = tl.load(query_start_loc_ptr + seq + 1).to(tl.int32) - q_start
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    ctx = seq_len - q_len  # position of the chunk's first query token
    # This launch owns chunks of min_q_len..max_q_len tokens (see paged_prefill_attention), and
    # tiles past the chunk's end have nothing to do.
    active = (q_len >= min_q_len) & (q_len <= max_q_len) & (first_q < q_len)

    # Row r of the tile is query token first_q + r // GROUP_PAD of head r % GROUP_PAD of the group.
    rows = tl.arange(0, BLOCK_M)
    t = first_q + rows // GROUP_PAD
    g = rows % GROUP_PAD
    row_ok = (t < tl.where(active, q_len, 0)) & (g < GROUP)
    q_pos = ctx + t
    heads = kv_head * GROUP + g
    dims = tl.arange(0, HEAD_DIM)
    tok_rows = (q_start + t).to(tl.int64)[:, None]
    q_off = tok_rows * stride_qt + heads[:, None] * stride_qh + dims[None, :]
    q = tl.load(q_ptr + q_off, mask=row_ok[:, None], other=0.0).to(DOT_DTYPE)

    # KV tiles, in steps of BLOCK_N from the page holding the first key any row sees:
    #   [start, all_seen)   some rows' windows start inside: masked
    #   [all_seen, diag)    visible to every row: no masking
    #   [diag, hi)          crosses the causal diagonal (or follows the window edge): masked
    # Keys before `lo` (out of every row's window) or from `hi` on (after every row) are skipped.
    q_first = ctx + first_q
    q_last = ctx + tl.minimum(q_len, first_q + BLOCK_Q) - 1
    lo = tl.maximum(q_first - window + 1, 0)
    hi = tl.where(active, q_last + 1, 0)
    start = (lo // PAGE_SIZE) * PAGE_SIZE
    all_seen = start + tl.cdiv(tl.maximum(q_last - window + 1, 0) - start, BLOCK_N) * BLOCK_N
    diag = tl.minimum(start + (q_first + 1 - start) // BLOCK_N * BLOCK_N, hi)

    k_base, v_base = _head_bases(
        kv_ptr, kv_head, stride_ckv, stride_chead, HEAD_DIM, PAGE_SIZE, V_BY_DIM=KV_FP8
    )
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    if KV_FP8:
        scale = scale * tl.load(k_scale_ptr)
    m_i = tl.full([BLOCK_M], _NEG_INIT, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for kv_start in tl.range(start, tl.minimum(all_seen, hi), BLOCK_N):  # pyright: ignore[reportGeneralTypeIssues]
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, k_base, v_base, bt_row, kv_start, lo, hi, q_pos, window, scale,
            soft_cap, stride_cblk, stride_ctok, BLOCK_N, HEAD_DIM, PAGE_SIZE,
            MASK=True, CAUSAL=True, HAS_SOFT_CAP=HAS_SOFT_CAP, DOT_DTYPE=DOT_DTYPE,  # pyright: ignore[reportArgumentType]
            V_BY_DIM=KV_FP8,
        )  # fmt: skip
    for kv_start in tl.range(all_seen, diag, BLOCK_N):  # pyright: ignore[reportGeneralTypeIssues]
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, k_base, v_base, bt_row, kv_start, lo, hi, q_pos, window, scale,
            soft_cap, stride_cblk, stride_ctok, BLOCK_N, HEAD_DIM, PAGE_SIZE,
            MASK=False, CAUSAL=False, HAS_SOFT_CAP=HAS_SOFT_CAP, DOT_DTYPE=DOT_DTYPE,  # pyright: ignore[reportArgumentType]
            V_BY_DIM=KV_FP8,
        )  # fmt: skip
    for kv_start in tl.range(tl.maximum(all_seen, diag), hi, BLOCK_N):  # pyright: ignore[reportGeneralTypeIssues]
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, k_base, v_base, bt_row, kv_start, lo, hi, q_pos, window, scale,
            soft_cap, stride_cblk, stride_ctok, BLOCK_N, HEAD_DIM, PAGE_SIZE,
            MASK=True, CAUSAL=True, HAS_SOFT_CAP=HAS_SOFT_CAP, DOT_DTYPE=DOT_DTYPE,  # pyright: ignore[reportArgumentType]
            V_BY_DIM=KV_FP8,
        )  # fmt: skip
    if KV_FP8:
        acc = acc * tl.load(v_scale_ptr)

    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    o_off = tok_rows * stride_ot + heads[:, None] * stride_oh + dims[None, :]
    tl.store(out_ptr + o_off, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def prefill_tile(itemsize: int, kv_fp8: bool, head_dim: int) -> tuple[int, int, int, int]:
    """The big prefill tile (_PREFILL_TILE) for operands of `itemsize` bytes (the larger of the
    query's and the cache's): 16-bit queries over an FP8 cache have their own."""
    tiles = _PREFILL_TILE[1 if itemsize == 2 and kv_fp8 else min(itemsize, 4)]
    return tiles[min(max(head_dim, 64), 256)]


def choose_num_splits(
    max_model_len: int,
    batch_size: int,
    num_kv_heads: int,
    num_sms: int = 132,
    kv_fp8: bool = False,
) -> int:
    """Decode splits per (sequence, KV head): enough programs for about two per SM, rounded up
    to a power of two (context lengths split evenly in whole tiles), but no split shorter than
    _MIN_TOKENS_PER_SPLIT tokens at max_model_len, since each split writes a partial that is
    merged after. An FP8 split reads half the bytes for the same keys, so that fixed cost weighs
    double: one program per SM. A pure function of static sizes, so CUDA graphs can capture the
    result. The split sweeps that set these rules are in bench/RESULTS.md."""
    programs = (1 if kv_fp8 else 2) * num_sms
    want = triton.next_power_of_2(triton.cdiv(programs, max(batch_size * num_kv_heads, 1)))
    cap = triton.cdiv(max_model_len, _MIN_TOKENS_PER_SPLIT)
    return max(1, min(want, cap))


def choose_prefix_splits(
    max_model_len: int, batch_size: int, num_heads: int, num_kv_heads: int, num_sms: int = 132
) -> int:
    """Slices of a shared prefix for the cascade kernel: its row tiles times KV heads times
    slices should give about two programs per SM, and no slice be shorter than
    _MIN_TOKENS_PER_SPLIT tokens at max_model_len. Static sizes only (CUDA-graph safe)."""
    row_tiles = triton.cdiv(batch_size * (num_heads // num_kv_heads), _PREFIX_BLOCK_M)
    want = triton.next_power_of_2(triton.cdiv(2 * num_sms, max(row_tiles * num_kv_heads, 1)))
    cap = triton.cdiv(max_model_len, _MIN_TOKENS_PER_SPLIT)
    return max(1, min(want, cap))


def _kv_tile_tokens(head_dim: int, itemsize: int) -> int:
    # Keys per K/V tile of the memory-bound loops: one tile at most 16 KB (64 keys of bf16 x 128),
    # which with three pipeline stages of K and V still fits beside other programs on an SM.
    return min(64, max(16, 16384 // (head_dim * itemsize)))


# The decode split kernel's (num_warps, num_stages) for an FP8 cache, the fastest of the sweeps in
# bench/RESULTS.md: fewer warps per program leave room for more programs per SM and deeper
# pipelines of the half-size tiles.
_FP8_DECODE_LAUNCH = (2, 6)


def _dot_dtype(query: torch.Tensor, kv_cache: torch.Tensor) -> tl.dtype:
    # The CPU interpreter multiplies bf16 matrices wrongly, and CPU tensors only ever run there.
    if query.device.type == "cpu" or query.dtype == torch.float32:
        return tl.float32
    if is_fp8(kv_cache):
        # e4m3 -> fp16 is exact and one instruction per pair, where e4m3 -> bf16 takes a detour
        # that made decode compute-bound (bench/RESULTS.md). fp16 carries more mantissa than
        # bf16, and queries stay far inside its range.
        return tl.float16
    return {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}[query.dtype]


def _check_inputs(query: torch.Tensor, kv_cache: torch.Tensor) -> tuple[int, int, int]:
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = kv_cache.shape[3]
    assert head_dim & (head_dim - 1) == 0 and 16 <= head_dim <= 256, (
        f"head_dim must be a power of two in [16, 256] (tl.arange and tl.dot), got {head_dim}"
    )
    assert kv_cache.shape[4] == head_dim, (kv_cache.shape, query.shape)
    assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
    assert query.dtype in (torch.float16, torch.bfloat16, torch.float32), query.dtype
    assert query.stride(-1) == 1 and kv_cache.stride(-1) == 1, "head_dim must be contiguous"
    return num_heads, num_kv_heads, head_dim


def _out(query: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return torch.empty(query.shape, dtype=query.dtype, device=query.device)
    assert out.shape == query.shape and out.stride(-1) == 1, (out.shape, query.shape)
    return out


def paged_decode_attention(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]: position seq_len - 1 of each sequence
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] on the device; 0 marks a padding row (output zeros)
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    out: torch.Tensor | None = None,
    *,
    num_splits: int,
    prefix_len: torch.Tensor | None = None,  # [1] int: tokens every sequence shares (cascade)
    prefix_splits: int = 1,
    k_scale: torch.Tensor | None = None,  # fp32 scalars on the device: an FP8 cache only
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query token per sequence. Grid ``(num_seqs, num_kv_heads, num_splits)``: a program
    takes one KV head's GQA group (padded to >= 16 rows, for the tensor cores) over one slice of
    its sequence's range; the slices are cut on the device from each sequence's own length, so
    short and long sequences in one batch both spread over all splits. With several splits the
    partials (running max, sum, unnormalised output, fp32) go to scratch and a reduce kernel
    merges them.

    Cascade (``prefix_len``): a first kernel attends all the batch's queries to the shared
    prefix as the rows of one tile, so each prefix tile is read once per step, and the splits
    cover only each sequence's own suffix. ``prefix_len`` is read on the device, so a captured
    graph serves any prefix, none (0) included. The caller guarantees that block-table row 0's
    first ``prefix_len // block_size`` blocks head every row's table, that ``prefix_len`` is a
    whole number of blocks no longer than any real row's length, and that no sliding window
    applies.

    An FP8 cache is widened to fp16 for the dots (``_dot_dtype``); K's scale is folded into the
    score scale and V's into the output, one multiply per program."""
    if prefix_len is not None and sliding_window is not None:
        raise ValueError("cascade decoding (prefix_len) does not support a sliding window")
    if query.stride(-1) != 1:
        query = query.contiguous()
    num_seqs = query.shape[0]
    num_heads, num_kv_heads, head_dim = _check_inputs(query, kv_cache)
    scales = kv_scales(kv_cache, k_scale, v_scale) or (seq_lens, seq_lens)  # read with KV_FP8
    out = _out(query, out)
    if num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    # A 16-row tile is the smallest tl.dot takes; the padding rows are free in a kernel that is
    # bound by reading K/V.
    block_g = max(16, triton.next_power_of_2(group))
    block_n = _kv_tile_tokens(head_dim, max(query.element_size(), kv_cache.element_size()))
    num_warps, num_stages = _FP8_DECODE_LAUNCH if is_fp8(kv_cache) else (4, 3)
    if prefix_len is None:
        prefix_splits = 0
    num_parts = num_splits + prefix_splits
    if num_parts > 1:
        part_o = torch.empty(
            (num_seqs, num_heads, num_parts, head_dim), dtype=torch.float32, device=query.device
        )
        part_m = torch.empty(
            (num_seqs, num_heads, num_parts), dtype=torch.float32, device=query.device
        )
        part_l = torch.empty_like(part_m)
    else:
        part_o = part_m = part_l = out  # unused: the split kernel writes `out` directly
    if prefix_len is not None:
        block_m = _PREFIX_BLOCK_M if head_dim <= 128 else _PREFIX_BLOCK_M // 2
        grid = (triton.cdiv(num_seqs * group, block_m), num_kv_heads, prefix_splits)
        _decode_prefix_kernel[grid](
            query,
            kv_cache,
            block_tables,
            seq_lens,
            prefix_len,
            part_o,
            part_m,
            part_l,
            *scales,
            num_seqs,
            scale,
            logits_soft_cap or 0.0,
            query.stride(0),
            query.stride(1),
            kv_cache.stride(0),
            kv_cache.stride(1),
            kv_cache.stride(2),
            kv_cache.stride(3),
            GROUP=group,
            HEAD_DIM=head_dim,
            PAGE_SIZE=kv_cache.shape[2],
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            NUM_SPLITS=num_splits,
            PREFIX_SPLITS=prefix_splits,
            HAS_SOFT_CAP=logits_soft_cap is not None,
            DOT_DTYPE=_dot_dtype(query, kv_cache),
            KV_FP8=is_fp8(kv_cache),
            num_warps=4,  # pyright: ignore[reportCallIssue]
            num_stages=2,  # pyright: ignore[reportCallIssue]
            **pdl_args(query.device),
        )
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        query,
        kv_cache,
        block_tables,
        seq_lens,
        out,
        part_o,
        part_m,
        part_l,
        seq_lens if prefix_len is None else prefix_len,  # read only with HAS_PREFIX
        *scales,
        scale,
        logits_soft_cap or 0.0,
        sliding_window or _NO_WINDOW,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        block_tables.stride(0),
        GROUP=group,
        BLOCK_G=block_g,
        HEAD_DIM=head_dim,
        PAGE_SIZE=kv_cache.shape[2],
        BLOCK_N=block_n,
        NUM_SPLITS=num_splits,
        NUM_PARTS=num_parts,
        HAS_PREFIX=prefix_len is not None,
        HAS_SOFT_CAP=logits_soft_cap is not None,
        DOT_DTYPE=_dot_dtype(query, kv_cache),
        KV_FP8=is_fp8(kv_cache),
        num_warps=num_warps,  # pyright: ignore[reportCallIssue]
        num_stages=num_stages,  # pyright: ignore[reportCallIssue]
        **pdl_args(query.device),
    )
    if num_parts > 1:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            part_o,
            part_m,
            part_l,
            out,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            NUM_PARTS=num_parts,
            BLOCK_S=triton.next_power_of_2(num_parts),
            num_warps=4,  # pyright: ignore[reportCallIssue]
            **pdl_args(query.device),
        )
    return out


def prefill_seq_bucket(num_seqs: int) -> int:
    """The kernel's per-batch sequence-table width: few distinct values, so few compilations."""
    return max(128, triton.next_power_of_2(num_seqs))


def paged_prefill_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]: each sequence's newest tokens
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] context length including this step's tokens
    query_start_loc: torch.Tensor,  # [num_seqs + 1]
    max_query_len: int,
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    out: torch.Tensor | None = None,
    *,
    k_scale: torch.Tensor | None = None,  # fp32 scalars on the device: an FP8 cache only
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each chunk is the newest ``q_len`` tokens of its sequence and attends causally to its
    whole paged context. A program's rows are ``BLOCK_M`` (token, query head) pairs of one KV
    head; programs are laid out flat over the batch's tokens and each finds its sequence from
    ``query_start_loc``, so a ragged batch launches no empty tiles. K/V tiles hidden by causality
    or the window are skipped, and tiles every row sees run without masks."""
    if query.stride(-1) != 1:
        query = query.contiguous()
    num_heads, num_kv_heads, head_dim = _check_inputs(query, kv_cache)
    scales = kv_scales(kv_cache, k_scale, v_scale) or (seq_lens, seq_lens)  # read with KV_FP8
    out = _out(query, out)
    num_seqs = seq_lens.shape[0]
    if num_seqs == 0 or max_query_len == 0:
        return out
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    # Rows of a tile are (token, head) pairs. A decode row in a mixed batch would waste most of a
    # big tile, so chunks that fit a 16-row tile get their own launch, one program per sequence
    # and KV head; the big-tile launch skips them. Each launch exits at once for the sequences
    # it does not own.
    itemsize = max(query.element_size(), kv_cache.element_size())
    small_m = max(16, group_pad)
    small_q = small_m // group_pad
    small_tile = (small_m, _kv_tile_tokens(head_dim, itemsize), 4, 2)
    # (grid, BLOCK_SEQS, tile, min_q, max_q) of each launch.
    launches: list[tuple[tuple[int, int], int, tuple[int, int, int, int], int, int]] = [
        ((num_seqs, num_kv_heads), 0, small_tile, 0, small_q)
    ]
    if max_query_len > small_q:
        block_m, block_n, num_warps, num_stages = prefill_tile(itemsize, is_fp8(kv_cache), head_dim)
        block_m = max(block_m, group_pad)
        grid = (query.shape[0] // (block_m // group_pad) + num_seqs, num_kv_heads)
        tile = (block_m, block_n, num_warps, num_stages)
        launches.append((grid, prefill_seq_bucket(num_seqs), tile, small_q + 1, max_query_len))
    for grid, block_seqs, (block_m, block_n, num_warps, num_stages), min_q, max_q in launches:
        _prefill_kernel[grid](
            query,
            kv_cache,
            block_tables,
            seq_lens,
            query_start_loc,
            out,
            *scales,
            scale,
            logits_soft_cap or 0.0,
            sliding_window or _NO_WINDOW,
            num_seqs,
            min_q,
            max_q,
            query.stride(0),
            query.stride(1),
            out.stride(0),
            out.stride(1),
            kv_cache.stride(0),
            kv_cache.stride(1),
            kv_cache.stride(2),
            kv_cache.stride(3),
            block_tables.stride(0),
            GROUP=group,
            GROUP_PAD=group_pad,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            HEAD_DIM=head_dim,
            PAGE_SIZE=kv_cache.shape[2],
            HAS_SOFT_CAP=logits_soft_cap is not None,
            DOT_DTYPE=_dot_dtype(query, kv_cache),
            BLOCK_SEQS=block_seqs,
            KV_FP8=is_fp8(kv_cache),
            num_warps=num_warps,  # pyright: ignore[reportCallIssue]
            num_stages=num_stages,  # pyright: ignore[reportCallIssue]
        )
    return out
