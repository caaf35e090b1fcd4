"""The Triton kernels against their PyTorch twins, on the CPU through Triton's interpreter.

Sizes are tiny (the interpreter runs every program in numpy); the same checks at real sizes on a
GPU live in bench/kernel_test_gpu.py. Cache slots no token wrote hold NaN, so any read that masking
should have dropped shows up as NaN in the output.
"""

from __future__ import annotations

import os

# Must precede the first import of triton: kernels pick interpreter or compiler when decorated.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

pytest.importorskip("triton")

from kvfleet.engine.attention_backend import TorchAttentionBackend
from kvfleet.engine.attention_metadata import AttentionMetadata
from kvfleet.engine.layers.layernorm import GemmaRMSNorm, RMSNorm
from kvfleet.engine.triton_attention import TritonAttentionBackend
from kvfleet.kernels import reference
from kvfleet.kernels.cache_write import write_kv_cache
from kvfleet.kernels.paged_attention import (
    choose_num_splits,
    paged_decode_attention,
    paged_prefill_attention,
    prefill_seq_bucket,
)
from kvfleet.kernels.rms_norm import rms_norm

BLOCK_SIZE = 16
# The interpreter rounds fp32 -> bf16 by truncation (the GPU rounds to nearest even), so bf16
# outputs may sit one bf16 ulp off the reference on top of summation-order differences.
TOL = {torch.float32: (2e-5, 1e-4), torch.bfloat16: (3e-2, 3e-2)}


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _paged_context(
    seq_lens: list[int], num_kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A KV cache holding random K/V for positions < seq_len of each sequence in shuffled blocks,
    NaN everywhere else (block 0 included, which pads every block-table row)."""
    gen = torch.Generator().manual_seed(seed)
    blocks = [_cdiv(n, BLOCK_SIZE) for n in seq_lens]
    num_blocks = sum(blocks) + 1
    cache = torch.full((2, num_blocks, BLOCK_SIZE, num_kv_heads, head_dim), float("nan"))
    tables = torch.zeros((len(seq_lens), max(blocks, default=0) + 1), dtype=torch.int32)
    ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    for i, n in enumerate(seq_lens):
        mine, ids = ids[: blocks[i]], ids[blocks[i] :]
        tables[i, : blocks[i]] = torch.tensor(mine, dtype=torch.int32)
        for pos in range(n):
            kv = torch.randn(2, num_kv_heads, head_dim, generator=gen)
            cache[:, mine[pos // BLOCK_SIZE], pos % BLOCK_SIZE] = kv
    return cache.to(dtype), tables


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rtol = TOL[dtype]
    assert torch.isfinite(actual).all()
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)


# -- cache write -----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_cache_matches_reference_and_skips_negative_slots(dtype: torch.dtype) -> None:
    num_kv_heads, head_dim, num_blocks = 3, 64, 4
    gen = torch.Generator().manual_seed(0)
    # Key and value are column slices of one fused tensor, as after a qkv projection split.
    kv = torch.randn(7, 2 * num_kv_heads, head_dim, generator=gen).to(dtype)
    key, value = kv[:, :num_kv_heads], kv[:, num_kv_heads:]
    slots = torch.tensor([5, -1, 16, 63, -1, 0, 33])
    cache = torch.randn(2, num_blocks, BLOCK_SIZE, num_kv_heads, head_dim, generator=gen)
    cache = cache.to(dtype)
    expected = cache.clone()
    untouched = cache.clone()
    reference.write_kv_cache(key, value, expected, slots)
    write_kv_cache(key, value, cache, slots)
    assert torch.equal(cache, expected)
    # Exactly the five kept slots changed, in both.
    per_slot = (cache != untouched).view(2, num_blocks * BLOCK_SIZE, -1)
    changed = per_slot.any(-1).any(0).nonzero().flatten()
    assert changed.tolist() == [0, 5, 16, 33, 63]


# -- decode ----------------------------------------------------------------------------------

DECODE_LENS = [1, 15, 16, 17, 40, 100]


@pytest.mark.parametrize(
    ("dtype", "num_heads", "num_kv_heads", "head_dim", "window", "cap", "splits"),
    [
        # MHA, fp32, every split count: 1 (direct), fewer and more splits than KV tiles.
        (torch.float32, 2, 2, 64, None, None, (1, 2, 5)),
        (torch.float32, 4, 1, 128, 20, None, (1, 3)),
        (torch.float32, 8, 1, 64, None, 30.0, (1, 4)),
        (torch.bfloat16, 8, 1, 128, 33, 20.0, (1, 3)),
    ],
)
def test_paged_decode_attention(
    dtype: torch.dtype,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    window: int | None,
    cap: float | None,
    splits: tuple[int, ...],
) -> None:
    cache, tables = _paged_context(DECODE_LENS, num_kv_heads, head_dim, dtype, seed=1)
    gen = torch.Generator().manual_seed(2)
    query = torch.randn(len(DECODE_LENS), num_heads, head_dim, generator=gen).to(dtype)
    scale = head_dim**-0.5
    qsl = list(range(len(DECODE_LENS) + 1))
    expected = reference.paged_attention(query, cache, tables, DECODE_LENS, qsl, scale, window, cap)
    seq_lens = torch.tensor(DECODE_LENS)
    for num_splits in splits:
        out = paged_decode_attention(
            query, cache, tables, seq_lens, scale, window, cap, num_splits=num_splits
        )
        assert out.dtype == dtype
        _assert_close(out, expected, dtype)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_paged_decode_padding_rows_are_zero(num_splits: int) -> None:
    """CUDA-graph padding: seq_len 0 rows (garbage block tables, NaN cache) give zeros, and the
    real rows around them are unaffected; `out` is written in place."""
    lens = [0, 17, 0]
    cache, tables = _paged_context(lens, 1, 64, torch.float32, seed=3)
    tables[0] = tables[2] = 10_000  # out of range: must never be read
    query = torch.randn(3, 4, 64, generator=torch.Generator().manual_seed(4))
    out = torch.full_like(query, float("nan"))
    paged_decode_attention(
        query, cache, tables, torch.tensor(lens), 0.125, out=out, num_splits=num_splits
    )
    expected = reference.paged_attention(query[1:2], cache, tables[1:2], [17], [0, 1], 0.125)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert torch.equal(out[2], torch.zeros_like(out[2]))
    _assert_close(out[1:2], expected, torch.float32)


@pytest.mark.parametrize(
    ("dtype", "num_heads", "num_kv_heads", "head_dim", "cap", "lens", "shared", "splits"),
    [
        # MHA; the prefix's last KV tile is partial (48 of 64 keys); a padding row.
        (torch.float32, 2, 2, 64, None, [50, 120, 49, 0], 48, ((1, 1), (3, 2))),
        # GQA of 4 over 20 sequences: 80 rows, two row tiles; soft-capped scores.
        (torch.float32, 8, 2, 64, 30.0, [33 + 7 * i for i in range(20)], 32, ((1, 4), (2, 1))),
        # A row whose whole context is the prefix (length == prefix: an empty suffix).
        (torch.bfloat16, 4, 1, 128, None, [64, 64, 90], 64, ((1, 2),)),
        # No shared prefix this step: the cascade graph replays with prefix_len 0.
        (torch.float32, 4, 2, 64, None, [20, 70, 3], 0, ((2, 2),)),
    ],
)
def test_cascade_decode_matches_reference(
    dtype: torch.dtype,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    cap: float | None,
    lens: list[int],
    shared: int,
    splits: tuple[tuple[int, int], ...],
) -> None:
    cache, tables = _paged_context(lens, num_kv_heads, head_dim, dtype, seed=5)
    real = [i for i, n in enumerate(lens) if n]
    # Every real row starts with row 0's first blocks, as prefix-cache hits make them.
    tables[real, : shared // BLOCK_SIZE] = tables[0, : shared // BLOCK_SIZE]
    tables[[i for i, n in enumerate(lens) if not n]] = 10_000  # padding: never read
    query = torch.randn(len(lens), num_heads, head_dim, generator=torch.Generator().manual_seed(6))
    query = query.to(dtype)
    scale = head_dim**-0.5
    expected = reference.paged_attention(
        query[real], cache, tables[real], [lens[i] for i in real], list(range(len(real) + 1)),
        scale, None, cap,
    )  # fmt: skip
    for num_splits, prefix_splits in splits:
        out = torch.full_like(query, float("nan"))
        paged_decode_attention(
            query, cache, tables, torch.tensor(lens), scale, None, cap, out,
            num_splits=num_splits, prefix_len=torch.tensor([shared]), prefix_splits=prefix_splits,
        )  # fmt: skip
        _assert_close(out[real], expected, dtype)
        assert not out[[i for i, n in enumerate(lens) if not n]].any()


def test_cascade_decode_refuses_a_sliding_window() -> None:
    cache, tables = _paged_context([32], 1, 64, torch.float32, seed=0)
    with pytest.raises(ValueError, match="sliding window"):
        paged_decode_attention(
            torch.zeros(1, 1, 64), cache, tables, torch.tensor([32]), 1.0, 16,
            num_splits=1, prefix_len=torch.tensor([16]),
        )  # fmt: skip


def test_choose_num_splits() -> None:
    # Small batches split long contexts across the machine; big batches need no splitting.
    assert choose_num_splits(32768, 1, 8) == 64
    assert choose_num_splits(32768, 8, 8) == 8
    assert choose_num_splits(32768, 64, 8) == 1
    # Never shorter than the minimum split length at max_model_len.
    assert choose_num_splits(2048, 1, 8) == 8
    assert choose_num_splits(100, 1, 8) == 1
    # An FP8 cache aims at one program per SM, not two: half the bytes per key make a split's
    # fixed costs weigh double.
    assert choose_num_splits(32768, 8, 8, kv_fp8=True) == 4
    assert choose_num_splits(32768, 1, 8, kv_fp8=True) == 32
    assert choose_num_splits(32768, 64, 8, kv_fp8=True) == 1
    # The engine's backend asks with its cache's dtype.
    backend = TritonAttentionBackend(max_model_len=32768, num_sms=132)
    cache = torch.zeros(2, 1, 16, 8, 16)
    assert backend.num_splits(8, cache) == 8
    assert backend.num_splits(8, cache.to(reference.FP8_KV_DTYPE)) == 4


# -- prefill ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dtype", "num_heads", "num_kv_heads", "head_dim", "seq_lens", "q_lens", "window", "cap"),
    [
        # Full prefill of a ragged batch, lengths on and off block boundaries.
        (torch.float32, 2, 2, 64, [1, 15, 16, 17, 40, 100], [1, 15, 16, 17, 40, 100], None, None),
        # Prefix-cache hits and chunked-prefill continuations next to q_len == 1 rows.
        (torch.float32, 4, 1, 128, [40, 100, 17, 33], [1, 37, 17, 16], None, None),
        # GQA 8 with a window narrower than the chunk and a soft cap.
        (torch.float32, 8, 1, 64, [100, 16, 50], [70, 1, 20], 24, 30.0),
        (torch.bfloat16, 8, 2, 64, [100, 16, 45], [100, 3, 20], 33, None),
        (torch.bfloat16, 4, 1, 128, [64, 31], [20, 31], None, 20.0),
        # A mixed step: one long chunk among decode and short speculative-style rows, so both the
        # small-tile and the big-tile launch own sequences.
        (torch.float32, 4, 2, 64, [9, 120, 33, 2, 70], [1, 90, 1, 2, 3], 50, None),
    ],
)
def test_paged_prefill_attention(
    dtype: torch.dtype,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    seq_lens: list[int],
    q_lens: list[int],
    window: int | None,
    cap: float | None,
) -> None:
    cache, tables = _paged_context(seq_lens, num_kv_heads, head_dim, dtype, seed=5)
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    gen = torch.Generator().manual_seed(6)
    query = torch.randn(qsl[-1], num_heads, head_dim, generator=gen).to(dtype)
    scale = head_dim**-0.5
    expected = reference.paged_attention(query, cache, tables, seq_lens, qsl, scale, window, cap)
    out = paged_prefill_attention(
        query,
        cache,
        tables,
        torch.tensor(seq_lens),
        torch.tensor(qsl),
        max(q_lens),
        scale,
        window,
        cap,
    )
    assert out.dtype == dtype
    _assert_close(out, expected, dtype)


def test_paged_prefill_strided_query_and_out() -> None:
    """The query as a column slice of a fused qkv tensor, and a caller-provided output."""
    seq_lens = [20, 9]  # 20 new tokens, then a 4-token chunk over 5 cached ones
    cache, tables = _paged_context(seq_lens, 1, 64, torch.float32, seed=7)
    qkv = torch.randn(24, 4, 64, generator=torch.Generator().manual_seed(8))
    query = qkv[:, :2]
    out = torch.empty(24, 2, 64)
    paged_prefill_attention(
        query, cache, tables, torch.tensor(seq_lens), torch.tensor([0, 20, 24]), 20, 0.1, out=out
    )
    expected = reference.paged_attention(query, cache, tables, seq_lens, [0, 20, 24], 0.1)
    _assert_close(out, expected, torch.float32)


def test_head_dim_must_be_power_of_two() -> None:
    cache = torch.zeros(2, 2, BLOCK_SIZE, 1, 96)
    with pytest.raises(AssertionError, match="power of two"):
        paged_decode_attention(
            torch.zeros(1, 1, 96),
            cache,
            torch.zeros(1, 1, dtype=torch.int32),
            torch.tensor([1]),
            0.1,
            num_splits=1,
        )


# -- backend ---------------------------------------------------------------------------------


def _metadata(seq_lens: list[int], q_lens: list[int], tables: torch.Tensor) -> AttentionMetadata:
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    return AttentionMetadata(
        slot_mapping=torch.zeros(qsl[-1], dtype=torch.long),
        block_tables=tables,
        seq_lens=torch.tensor(seq_lens),
        query_start_loc=torch.tensor(qsl),
        seq_lens_cpu=seq_lens,
        query_start_loc_cpu=qsl,
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
    )


def test_the_warm_up_meets_every_prefill_kernel_variant_serving_can() -> None:
    """One batch per width of the prefill kernel's sequence table, up to max_num_seqs: every
    batch serving can run uses a width the warm-up compiled."""
    backend = TritonAttentionBackend(max_model_len=1024, num_sms=132)
    for max_num_seqs in (1, 8, 128, 129, 300, 512):
        counts = backend.warm_up_batches(max_num_seqs)
        assert counts[-1] == max_num_seqs
        widths = [prefill_seq_bucket(n) for n in counts]
        assert len(set(widths)) == len(widths)
        assert {prefill_seq_bucket(n) for n in range(1, max_num_seqs + 1)} == set(widths)
    assert TorchAttentionBackend().warm_up_batches(512) == []


def test_backend_writes_then_attends_like_the_torch_backend() -> None:
    """A prefill step then a decode step through both backends, from an empty cache."""
    num_heads, num_kv_heads, head_dim = 4, 2, 64
    triton_be, torch_be = TritonAttentionBackend(max_model_len=1024), TorchAttentionBackend()
    assert triton_be.name == "triton"
    gen = torch.Generator().manual_seed(9)
    tables = torch.tensor([[3, 1, 0], [2, 4, 5]], dtype=torch.int32)
    caches = [torch.zeros(2, 6, BLOCK_SIZE, num_kv_heads, head_dim) for _ in range(2)]
    lens_before = [0, 0]
    for q_lens in ([18, 33], [1, 1]):
        seq_lens = [b + n for b, n in zip(lens_before, q_lens, strict=True)]
        meta = _metadata(seq_lens, q_lens, tables)
        meta.slot_mapping = torch.tensor(
            [
                int(tables[i, pos // BLOCK_SIZE]) * BLOCK_SIZE + pos % BLOCK_SIZE
                for i, n in enumerate(q_lens)
                for pos in range(seq_lens[i] - n, seq_lens[i])
            ]
        )
        num_tokens = sum(q_lens)
        q, k, v = (
            torch.randn(num_tokens, h, head_dim, generator=gen)
            for h in (num_heads, num_kv_heads, num_kv_heads)
        )
        outs = []
        for backend, cache in zip((triton_be, torch_be), caches, strict=True):
            backend.write_kv(k, v, cache, meta)
            outs.append(backend.attend(q, cache, meta, head_dim**-0.5, None, None))
        assert torch.equal(caches[0], caches[1])
        _assert_close(outs[0], outs[1], torch.float32)
        lens_before = seq_lens


# -- rms norm --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("norm_class", [RMSNorm, GemmaRMSNorm])
def test_rms_norm_matches_module(
    dtype: torch.dtype, with_residual: bool, norm_class: type[RMSNorm]
) -> None:
    hidden = 96  # not a power of two: masked columns must not enter the mean
    gen = torch.Generator().manual_seed(10)
    module = norm_class(hidden, eps=1e-5).to(dtype)
    module.weight.data.copy_(torch.randn(hidden, generator=gen))
    x = torch.randn(3, 5, hidden, generator=gen).to(dtype)
    residual = torch.randn(3, 5, hidden, generator=gen).to(dtype) if with_residual else None
    x_before = x.clone()
    got = rms_norm(x, module.weight, module.eps, residual, module.zero_centred)
    want = module(x, residual)
    if not with_residual:
        got, want = (got,), (want,)
    # Interpreter bf16 rounding truncates (see TOL); fp32 and fp16 round as on the GPU.
    tol = {torch.bfloat16: (7e-2, 2e-2)}.get(dtype, (1e-5, 1e-3))
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        torch.testing.assert_close(g.float(), w.float(), atol=tol[0], rtol=tol[1])
    assert torch.equal(x, x_before)


def test_gemma_rms_norm_scales_by_one_plus_weight() -> None:
    # A zero weight is Gemma's identity scale: the output is the plain normalised row.
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(3))
    want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(rms_norm(x, torch.zeros(64), 1e-6, zero_centred=True), want)
    torch.testing.assert_close(GemmaRMSNorm(64)(x), want)
