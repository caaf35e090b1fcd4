"""The FP8 (e4m3) KV cache: quantization arithmetic, and every Triton kernel that writes or reads
the cache against the PyTorch reference reading the same FP8 bytes, on the CPU through Triton's
interpreter at tiny sizes (bench/kernel_test_gpu.py repeats the checks at real sizes on a GPU).

Slots no token wrote hold e4m3's largest value, so a read that masking should drop shows up. Not
NaN: an FP8 cache holds none (see ``reference``), and the kernels read whole pages of V."""

from __future__ import annotations

import os

# Must precede the first import of triton: kernels pick interpreter or compiler when decorated.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

pytest.importorskip("triton")

from kvfleet.engine.attention_backend import TorchAttentionBackend
from kvfleet.engine.attention_metadata import AttentionMetadata
from kvfleet.engine.triton_attention import TritonAttentionBackend
from kvfleet.kernels import reference
from kvfleet.kernels.cache_write import write_kv_cache
from kvfleet.kernels.paged_attention import paged_decode_attention, paged_prefill_attention

BLOCK_SIZE = 16
FP8 = torch.float8_e4m3fn
# Kernel and reference read the same FP8 values; they differ only in where the fp32 scales are
# applied and in summation order. bf16 queries: the interpreter truncates fp32 -> bf16 outputs.
TOL = {torch.float32: (2e-5, 1e-4), torch.bfloat16: (3e-2, 3e-2)}
K_SCALE, V_SCALE = torch.tensor(0.07), torch.tensor(0.013)


def _slots(tables: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
    return torch.tensor(
        [
            int(tables[i, pos // BLOCK_SIZE]) * BLOCK_SIZE + pos % BLOCK_SIZE
            for i, n in enumerate(seq_lens)
            for pos in range(n)
        ],
        dtype=torch.long,
    )


def _fp8_context(
    seq_lens: list[int], num_kv_heads: int, head_dim: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """An FP8 cache whose first seq_len positions of each sequence (in shuffled blocks) hold
    random K/V written by the reference, 448 elsewhere (block 0 included, which pads tables)."""
    gen = torch.Generator().manual_seed(seed)
    blocks = [-(-n // BLOCK_SIZE) for n in seq_lens]
    num_blocks = sum(blocks) + 1
    ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).to(torch.int32)
    tables = torch.zeros((len(seq_lens), max(blocks) + 1), dtype=torch.int32)
    start = 0
    for i, nb in enumerate(blocks):
        tables[i, :nb] = ids[start : start + nb]
        start += nb
    shape = (2, num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    cache = torch.full(shape, reference.FP8_MAX).to(FP8)
    slots = _slots(tables, seq_lens)
    k, v = torch.randn(2, len(slots), num_kv_heads, head_dim, generator=gen)
    reference.write_kv_cache(k, v, cache, slots, K_SCALE, V_SCALE)
    return cache, tables


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rtol = TOL[dtype]
    assert torch.isfinite(actual).all()
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)


# -- quantization ------------------------------------------------------------------------------


def test_quantize_round_trip_error_and_saturation() -> None:
    scale = torch.tensor(0.05)
    x = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 3
    back = reference.quantize_fp8(x, scale).float() * scale
    # e4m3 keeps 3 mantissa bits: round to nearest errs by at most 2**-4 relative in the normal
    # range (|x| / scale >= 2**-6); below it, by half the subnormal step 2**-9 (absolute).
    normal = (x / scale).abs() >= 2**-6
    assert ((back - x).abs()[normal] <= 2**-4 * x.abs()[normal]).all()
    assert ((back - x).abs()[~normal] <= 2**-10 * scale).all()
    # Values e4m3 holds come back exactly; beyond +-448 * scale they saturate, never inf or NaN.
    exact = torch.tensor([0.0, 1.0, -1.5, 448.0, 2**-9, -0.875]) * scale
    assert torch.equal(reference.quantize_fp8(exact, scale).float() * scale, exact)
    big = reference.quantize_fp8(torch.tensor([1e6, -1e6, 500 * 0.05]), scale).float()
    assert big.tolist() == [448.0, -448.0, 448.0]


def test_a_cache_of_the_model_dtype_ignores_scales_and_fp8_requires_them() -> None:
    assert reference.kv_scales(torch.zeros(1, dtype=torch.bfloat16), K_SCALE, V_SCALE) is None
    with pytest.raises(ValueError, match="k_scale and v_scale"):
        reference.kv_scales(torch.zeros(1, dtype=FP8), K_SCALE, None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_cache_quantizes_like_the_reference(dtype: torch.dtype) -> None:
    num_kv_heads, head_dim, num_blocks = 3, 64, 4
    gen = torch.Generator().manual_seed(1)
    # Strided key/value (slices of one fused tensor) of magnitudes from e4m3's subnormals
    # (< 2**-6 * scale) to past its saturation point (448 * scale).
    kv = torch.randn(7, 2 * num_kv_heads, head_dim, generator=gen)
    kv = (kv * 10 ** torch.empty_like(kv).uniform_(-5, 2, generator=gen)).to(dtype)
    kv[2, 0, :3] = kv[6, -1, 5] = float("nan")  # stored as 0: the cache holds no NaN
    key, value = kv[:, :num_kv_heads], kv[:, num_kv_heads:]
    slots = torch.tensor([5, -1, 16, 63, -1, 0, 33])
    cache = torch.randn(2, num_blocks, BLOCK_SIZE, num_kv_heads, head_dim, generator=gen).to(FP8)
    expected, untouched = cache.clone(), cache.clone()
    reference.write_kv_cache(key, value, expected, slots, K_SCALE, V_SCALE)
    write_kv_cache(key, value, cache, slots, K_SCALE, V_SCALE)
    assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))

    def by_slot(c: torch.Tensor) -> torch.Tensor:  # [2, slots, heads, dims], V by its view
        values = reference.cache_values(c).reshape(-1, num_kv_heads, head_dim)
        return torch.stack([c[0].reshape(-1, num_kv_heads, head_dim), values]).float()

    written = by_slot(expected)[:, slots[slots >= 0]]
    assert torch.equal(written[0, 1, 0, :3], torch.zeros(3))
    assert written[1, 4, -1, 5] == 0
    assert written.isfinite().all() and written.abs().max() == 448.0
    assert ((written != 0) & (written.abs() < 2**-6)).any()
    # Each written token changed its own K and V slots and nothing else.
    per_slot = by_slot(cache) != by_slot(untouched)
    assert per_slot.flatten(2).any(-1).nonzero().tolist() == [
        [half, slot] for half in (0, 1) for slot in (0, 5, 16, 33, 63)
    ]


# -- attention ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dtype", "num_heads", "num_kv_heads", "head_dim", "window", "cap", "splits"),
    [
        (torch.float32, 4, 2, 64, None, None, (1, 3)),
        (torch.float32, 8, 1, 64, 20, 30.0, (1, 4)),
        (torch.bfloat16, 4, 1, 128, None, None, (2,)),
    ],
)
def test_decode_reads_fp8(
    dtype: torch.dtype,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    window: int | None,
    cap: float | None,
    splits: tuple[int, ...],
) -> None:
    lens = [1, 17, 100, 0]  # the last row pads a CUDA-graph batch
    cache, tables = _fp8_context(lens, num_kv_heads, head_dim, seed=2)
    query = torch.randn(4, num_heads, head_dim, generator=torch.Generator().manual_seed(3))
    query = query.to(dtype)
    scale = head_dim**-0.5
    expected = reference.paged_attention(
        query[:3], cache, tables, lens[:3], [0, 1, 2, 3], scale, window, cap, K_SCALE, V_SCALE
    )
    for num_splits in splits:
        out = paged_decode_attention(
            query, cache, tables, torch.tensor(lens), scale, window, cap,
            num_splits=num_splits, k_scale=K_SCALE, v_scale=V_SCALE,
        )  # fmt: skip
        _assert_close(out[:3], expected, dtype)
        assert torch.equal(out[3], torch.zeros_like(out[3]))


def test_cascade_decode_reads_fp8() -> None:
    """Rows sharing their first 32 tokens' blocks: the shared-prefix pass reads them."""
    lens = [40, 33, 90, 0]
    cache, tables = _fp8_context(lens, 2, 64, seed=4)
    tables[1:3, :2] = tables[0, :2]
    query = torch.randn(4, 4, 64, generator=torch.Generator().manual_seed(5))
    expected = reference.paged_attention(
        query[:3], cache, tables, lens[:3], [0, 1, 2, 3], 0.125, None, None, K_SCALE, V_SCALE
    )
    out = paged_decode_attention(
        query, cache, tables, torch.tensor(lens), 0.125, num_splits=2,
        prefix_len=torch.tensor([32]), prefix_splits=2, k_scale=K_SCALE, v_scale=V_SCALE,
    )  # fmt: skip
    _assert_close(out[:3], expected, torch.float32)
    assert torch.equal(out[3], torch.zeros_like(out[3]))


@pytest.mark.parametrize(
    ("dtype", "seq_lens", "q_lens", "window", "cap"),
    [
        # Prefill, an extend after cached tokens, decode rows and short chunks in one step.
        (torch.float32, [70, 9, 120, 2, 33], [70, 1, 90, 2, 3], None, None),
        (torch.float32, [100, 16, 50], [60, 1, 20], 24, 30.0),
        (torch.bfloat16, [64, 31], [20, 31], None, None),
    ],
)
def test_prefill_and_extend_read_fp8(
    dtype: torch.dtype,
    seq_lens: list[int],
    q_lens: list[int],
    window: int | None,
    cap: float | None,
) -> None:
    num_heads, num_kv_heads, head_dim = 4, 2, 64
    cache, tables = _fp8_context(seq_lens, num_kv_heads, head_dim, seed=6)
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    query = torch.randn(qsl[-1], num_heads, head_dim, generator=torch.Generator().manual_seed(7))
    query = query.to(dtype)
    expected = reference.paged_attention(
        query, cache, tables, seq_lens, qsl, 0.125, window, cap, K_SCALE, V_SCALE
    )
    out = paged_prefill_attention(
        query, cache, tables, torch.tensor(seq_lens), torch.tensor(qsl), max(q_lens), 0.125,
        window, cap, k_scale=K_SCALE, v_scale=V_SCALE,
    )  # fmt: skip
    _assert_close(out, expected, dtype)


def test_fp8_attention_stays_close_to_the_unquantized_cache() -> None:
    """What the cache's rounding costs: the same K/V through an fp32 cache and an FP8 one."""
    lens = [200, 64]
    _, tables = _fp8_context(lens, 2, 64, seed=8)
    gen = torch.Generator().manual_seed(9)
    slots = _slots(tables, lens)
    k, v = torch.randn(2, len(slots), 2, 64, generator=gen)
    fp32_cache = torch.zeros(2, int(tables.max()) + 1, BLOCK_SIZE, 2, 64)
    fp8_cache = fp32_cache.to(FP8)
    reference.write_kv_cache(k, v, fp32_cache, slots)
    write_kv_cache(k, v, fp8_cache, slots, K_SCALE, V_SCALE)
    query = torch.randn(2, 4, 64, generator=gen)
    exact = reference.paged_attention(query, fp32_cache, tables, lens, [0, 1, 2], 0.125)
    fp8 = paged_decode_attention(
        query, fp8_cache, tables, torch.tensor(lens), 0.125, num_splits=2,
        k_scale=K_SCALE, v_scale=V_SCALE,
    )  # fmt: skip
    # e4m3 rounds each K/V element by up to 2**-4 relative (~2.7% RMS). Outputs here average
    # random V rows, so that noise does not cancel against a large mean: the outputs' relative
    # L2 error measured 3.7% on average and 4.8% at most over 20 seeds of this case.
    assert (fp8 - exact).norm() / exact.norm() < 0.07


# -- backend -----------------------------------------------------------------------------------


def test_backends_write_and_attend_alike_with_an_fp8_cache() -> None:
    """A prefill step then a decode step through both backends, from an empty FP8 cache."""
    num_heads, num_kv_heads, head_dim = 4, 2, 64
    gen = torch.Generator().manual_seed(10)
    tables = torch.tensor([[3, 1, 0], [2, 4, 5]], dtype=torch.int32)
    caches = [torch.zeros(2, 6, BLOCK_SIZE, num_kv_heads, head_dim, dtype=FP8) for _ in range(2)]
    backends = (TritonAttentionBackend(max_model_len=1024), TorchAttentionBackend())
    lens_before = [0, 0]
    for q_lens in ([18, 33], [1, 1]):
        seq_lens = [b + n for b, n in zip(lens_before, q_lens, strict=True)]
        qsl = [0, q_lens[0], sum(q_lens)]
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(
                [
                    int(tables[i, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE
                    for i in range(2)
                    for p in range(lens_before[i], seq_lens[i])
                ]
            ),
            block_tables=tables,
            seq_lens=torch.tensor(seq_lens),
            query_start_loc=torch.tensor(qsl),
            seq_lens_cpu=seq_lens,
            query_start_loc_cpu=qsl,
            max_query_len=max(q_lens),
            max_seq_len=max(seq_lens),
        )
        q, k, v = (
            torch.randn(qsl[-1], h, head_dim, generator=gen)
            for h in (num_heads, num_kv_heads, num_kv_heads)
        )
        outs = []
        for backend, cache in zip(backends, caches, strict=True):
            backend.write_kv(k, v, cache, meta, k_scale=K_SCALE, v_scale=V_SCALE)
            outs.append(
                backend.attend(q, cache, meta, 0.125, None, None, k_scale=K_SCALE, v_scale=V_SCALE)
            )
        assert torch.equal(caches[0].view(torch.uint8), caches[1].view(torch.uint8))
        _assert_close(outs[0], outs[1], torch.float32)
        lens_before = seq_lens
