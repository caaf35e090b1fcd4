"""Checks every Triton kernel against its PyTorch twin at real sizes on a CUDA GPU, then times
decode attention against the card's copy bandwidth (and prefill attention in TFLOP/s), with a
bf16 KV cache and an FP8 (e4m3) one::

    python bench/kernel_test_gpu.py                 # checks, then the bandwidth table
    python bench/kernel_test_gpu.py --skip-bench    # checks only
    python bench/kernel_test_gpu.py --iters 200 --splits 1,4,8,16
    python bench/kernel_test_gpu.py --fp8-decode-sweep --fp8-prefill-sweep --rounds 3

Checks draw fresh random data, poison outputs with NaN before each kernel runs, and fail on any
NaN or on an error over the stated tolerance (|out - ref| <= atol + rtol * |ref| elementwise);
the exit code is 1 if any check failed. Decode bandwidth counts the K/V bytes the step must read
(each sequence's context once per KV head, in the cache's own element size: 1 byte for FP8)
over the median kernel time, next to a measured device-to-device copy (bytes read plus bytes
written). FP8 checks compare the kernels with the reference reading the same FP8 cache (the
cache write bit for bit), so their tolerances are the query dtype's. Needs kvfleet installed
(``pip install -e .``) with triton.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvfleet.kernels import reference
from kvfleet.kernels.activation import act_and_mul
from kvfleet.kernels.cache_write import write_kv_cache
from kvfleet.kernels.grammar_mask import apply_token_bitmask
from kvfleet.kernels.paged_attention import (
    choose_num_splits,
    choose_prefix_splits,
    paged_decode_attention,
    paged_prefill_attention,
)
from kvfleet.kernels.rms_norm import rms_norm

logger = logging.getLogger("kvfleet.bench.kernel_test_gpu")

BLOCK_SIZE = 16
FP8 = reference.FP8_KV_DTYPE
# K and V scales of the FP8 checks: random N(0, 1) K/V then span e4m3's range without saturating
# (|x| / scale up to ~110 and ~270), and the two scales differ, so swapping them would show.
FP8_SCALES = (0.04, 0.017)
# (atol, rtol) against the fp32 reference, elementwise. bf16 attention multiplies probabilities
# rounded to bf16 (8 significant bits) into V, and rounding the output alone is off by up to
# 1.6e-2 where |out| is in [2, 4) (short contexts, whose output is nearly one V row); fp32 uses
# exact ("ieee") tensor-core products.
ATTN_TOL = {
    torch.bfloat16: (2e-2, 2e-2),
    torch.float16: (3e-3, 3e-3),
    torch.float32: (1e-4, 1e-4),
}
# RMSNorm rounds like the torch module; only the fp32 sum of squares (order) and rsqrt (hardware
# approximation) differ, which now and then moves a rounded value by one unit in the last place
# (two after the weight multiply). 16-bit outputs pass at <= 2 ulp with <= 1% of elements differing;
# fp32 outputs by (atol, rtol).
NORM_MAX_ULPS, NORM_MAX_DIFFERING = 2.0, 0.01
NORM_FP32_TOL = (1e-5, 1e-5)


@dataclass
class Paged:
    cache: torch.Tensor
    tables: torch.Tensor
    k_scale: torch.Tensor | None = None  # an FP8 cache's
    v_scale: torch.Tensor | None = None

    @property
    def scales(self) -> dict[str, torch.Tensor | None]:
        return {"k_scale": self.k_scale, "v_scale": self.v_scale}


def paged_context(
    seq_lens: list[int],
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    dev: torch.device,
    fp8: bool = False,
) -> Paged:
    """Random K/V in randomly permuted blocks (a fragmented cache); slots past each sequence's
    length and the spare block 0 that pads block tables hold NaN, so unmasked reads show. With
    fp8 the cache holds them quantized with FP8_SCALES, V by dimension, and NaN as 0, as the
    cache write stores them (an FP8 cache holds no NaN: see kernels/reference.py)."""
    blocks = [-(-n // BLOCK_SIZE) for n in seq_lens]
    num_blocks = sum(blocks) + 1
    cache = torch.randn(2, num_blocks, BLOCK_SIZE, num_kv_heads, head_dim, device=dev).to(dtype)
    cache[:, 0] = float("nan")
    tables = torch.zeros((len(seq_lens), max(max(blocks), 1)), dtype=torch.int32, device=dev)
    ids = torch.randperm(num_blocks - 1, device=dev).to(torch.int32) + 1
    start = 0
    for i, (n, nb) in enumerate(zip(seq_lens, blocks, strict=True)):
        tables[i, :nb] = ids[start : start + nb]
        start += nb
        if n % BLOCK_SIZE:
            cache[:, int(tables[i, nb - 1]), n % BLOCK_SIZE :] = float("nan")
    if not fp8:
        return Paged(cache, tables)
    k_scale, v_scale = (torch.tensor(s, device=dev) for s in FP8_SCALES)
    quantized = torch.empty_like(cache, dtype=FP8)
    quantized[0] = reference.quantize_fp8(cache[0], k_scale)
    reference.cache_values(quantized).copy_(reference.quantize_fp8(cache[1], v_scale))
    return Paged(quantized, tables, k_scale, v_scale)


def report(name: str, out: torch.Tensor, ref: torch.Tensor, atol: float, rtol: float) -> bool:
    out, ref = out.float(), ref.float()
    err = (out - ref).abs()
    finite = bool(torch.isfinite(out).all())
    ok = finite and bool((err <= atol + rtol * ref.abs()).all())
    max_err = err.max().item() if err.numel() else 0.0
    logger.info(
        "%s %-58s max abs err %.3e (atol %.1e, rtol %.1e)%s",
        "PASS" if ok else "FAIL",
        name,
        max_err,
        atol,
        rtol,
        "" if finite else " NON-FINITE OUTPUT",
    )
    return ok


def check_cache_write(dev: torch.device, dtype: torch.dtype, fp8: bool = False) -> bool:
    """With fp8, K/V magnitudes span e4m3's subnormals to past its saturation point, and the
    cache must match the reference's bytes exactly."""
    num_tokens, num_kv_heads, head_dim, num_blocks = 4096, 8, 128, 600
    kv = torch.randn(num_tokens, 2 * num_kv_heads, head_dim, device=dev)
    if fp8:
        kv *= 10 ** torch.empty_like(kv).uniform_(-5, 2)
    kv = kv.to(dtype)
    key, value = kv[:, :num_kv_heads], kv[:, num_kv_heads:]  # strided, as after a qkv split
    slots = torch.randperm(num_blocks * BLOCK_SIZE, device=dev)[:num_tokens]
    slots[::7] = -1  # padding tokens of a CUDA-graph batch
    cache = torch.randn(2, num_blocks, BLOCK_SIZE, num_kv_heads, head_dim, device=dev)
    cache = cache.to(FP8 if fp8 else dtype)
    expected = cache.clone()
    keep = slots >= 0
    scales = [torch.tensor(s, device=dev) for s in FP8_SCALES] if fp8 else [None, None]
    reference.write_kv_cache(key[keep], value[keep], expected, slots[keep], *scales)
    write_kv_cache(key, value, cache, slots, *scales)
    torch.cuda.synchronize()
    if fp8:
        cache, expected = cache.view(torch.uint8), expected.view(torch.uint8)
    name = f"write_kv_cache T={num_tokens} {dtype}{' -> fp8 cache' if fp8 else ''}"
    return report(name, cache, expected, 0.0, 0.0)


def check_decode(
    dev: torch.device,
    dtype: torch.dtype,
    batch: int,
    max_len: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    window: int | None,
    cap: float | None,
    splits: list[int],
    shared: int = 0,
    prefix_splits: int = 1,
    fp8: bool = False,
) -> bool:
    """With `shared`, every real row starts with row 0's first `shared` tokens (whole blocks)
    and the kernel runs its cascade pass over them. fp8: an FP8 cache."""
    lens = torch.randint(shared + 1, max_len + 1, (batch,)).tolist()
    # Longest, shortest, a CUDA-graph padding row.
    lens[0], lens[1], lens[-1] = max_len, max(shared, 1), 0
    ctx = paged_context(lens, num_kv_heads, head_dim, dtype, dev, fp8)
    ctx.tables[:-1, : shared // BLOCK_SIZE] = ctx.tables[0, : shared // BLOCK_SIZE]
    prefix_len = torch.tensor([shared], device=dev) if shared else None
    query = torch.randn(batch, num_heads, head_dim, device=dev, dtype=dtype)
    scale = head_dim**-0.5
    real = batch - 1
    ref = reference.paged_attention(
        query[:real],
        ctx.cache,
        ctx.tables[:real],
        lens[:real],
        list(range(real + 1)),
        scale,
        window,
        cap,
        **ctx.scales,
    )
    seq_lens = torch.tensor(lens, device=dev)
    atol, rtol = ATTN_TOL[dtype]
    ok = True
    for num_splits in splits:
        out = torch.full_like(query, float("nan"))
        paged_decode_attention(
            query, ctx.cache, ctx.tables, seq_lens, scale, window, cap, out,
            num_splits=num_splits, prefix_len=prefix_len, prefix_splits=prefix_splits,
            **ctx.scales,
        )  # fmt: skip
        torch.cuda.synchronize()
        name = (
            f"decode B={batch} ctx<={max_len} H={num_heads}/{num_kv_heads} D={head_dim} "
            f"win={window} cap={cap} S={num_splits} {str(dtype)[6:]}"
            + (" fp8-KV" if fp8 else "")
            + (f" shared={shared} PS={prefix_splits}" if shared else "")
        )
        ok &= report(name, out[:real], ref, atol, rtol)
        ok &= report(name + " pad row", out[real:], torch.zeros_like(out[real:]), 0.0, 0.0)
    return ok


def check_decode_graph(dev: torch.device) -> bool:
    """Capture decode once, then replay it on new lengths, block tables and queries written in
    place (padding rows included), as a CUDA-graph decode step does."""
    batch, num_heads, num_kv_heads, head_dim, dtype = 32, 32, 8, 128, torch.bfloat16
    lens = torch.randint(1, 4097, (batch,)).tolist()
    ctx = paged_context(lens, num_kv_heads, head_dim, dtype, dev)
    query = torch.randn(batch, num_heads, head_dim, device=dev, dtype=dtype)
    seq_lens = torch.tensor(lens, device=dev)
    tables = ctx.tables.clone()
    out = torch.empty_like(query)
    splits = choose_num_splits(4096, batch, num_kv_heads)
    scale = head_dim**-0.5

    def step() -> None:
        paged_decode_attention(
            query, ctx.cache, tables, seq_lens, scale, out=out, num_splits=splits
        )

    step()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    ok = True
    for replay in range(3):
        perm = torch.randperm(batch)
        new_lens = [int(torch.randint(0, lens[j] + 1, ())) for j in perm.tolist()]
        new_lens[-2:] = [0, 0]
        tables.copy_(ctx.tables[perm.to(dev)])
        seq_lens.copy_(torch.tensor(new_lens))
        query.normal_()
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        real = [i for i, n in enumerate(new_lens) if n > 0]
        pad = [i for i, n in enumerate(new_lens) if n == 0]
        ref = reference.paged_attention(
            query[real], ctx.cache, tables[real], [new_lens[i] for i in real],
            list(range(len(real) + 1)), scale,
        )  # fmt: skip
        name = f"decode CUDA-graph replay {replay} B={batch} S={splits}"
        ok &= report(name, out[real], ref, *ATTN_TOL[dtype])
        ok &= report(name + " pad rows", out[pad], torch.zeros_like(out[pad]), 0.0, 0.0)
    return ok


def check_prefill(
    dev: torch.device,
    dtype: torch.dtype,
    seqs: list[tuple[int, int]],  # (seq_len, q_len)
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    window: int | None,
    cap: float | None,
    fp8: bool = False,
) -> bool:
    lens = [s for s, _ in seqs]
    qsl = [0]
    for _, q in seqs:
        qsl.append(qsl[-1] + q)
    ctx = paged_context(lens, num_kv_heads, head_dim, dtype, dev, fp8)
    query = torch.randn(qsl[-1], num_heads, head_dim, device=dev, dtype=dtype)
    scale = head_dim**-0.5
    ref = reference.paged_attention(
        query, ctx.cache, ctx.tables, lens, qsl, scale, window, cap, **ctx.scales
    )
    out = torch.full_like(query, float("nan"))
    paged_prefill_attention(
        query,
        ctx.cache,
        ctx.tables,
        torch.tensor(lens, device=dev),
        torch.tensor(qsl, device=dev),
        max(q for _, q in seqs),
        scale,
        window,
        cap,
        out,
        **ctx.scales,
    )
    torch.cuda.synchronize()
    name = (
        f"prefill {len(seqs)} seqs T={qsl[-1]} H={num_heads}/{num_kv_heads} D={head_dim} "
        f"win={window} cap={cap} {str(dtype)[6:]}{' fp8-KV' if fp8 else ''}"
    )
    return report(name, out, ref, *ATTN_TOL[dtype])


def report_ulps(name: str, out: torch.Tensor, ref: torch.Tensor) -> bool:
    if ref.dtype == torch.float32:
        return report(name, out, ref, *NORM_FP32_TOL)
    info = torch.finfo(ref.dtype)
    mag = ref.float().abs().clamp_min(info.tiny)
    ulp = info.eps * torch.exp2(torch.floor(torch.log2(mag)))
    ulps = ((out.float() - ref.float()).abs() / ulp).max().item()
    differing = (out != ref).float().mean().item()
    ok = bool(torch.isfinite(out).all()) and ulps <= NORM_MAX_ULPS
    ok &= differing <= NORM_MAX_DIFFERING
    logger.info(
        "%s %-58s max err %.1f ulp (<= %.0f), %.4f%% of elements differ (<= %.0f%%)",
        "PASS" if ok else "FAIL",
        name,
        ulps,
        NORM_MAX_ULPS,
        100 * differing,
        100 * NORM_MAX_DIFFERING,
    )
    return ok


def check_rms_norm(
    dev: torch.device, dtype: torch.dtype, hidden: int, zero_centred: bool = False
) -> bool:
    # The oracle is the PyTorch twin: the module itself would run this very kernel on the GPU.
    weight = torch.randn(hidden, device=dev, dtype=dtype)
    x = torch.randn(4096, hidden, device=dev, dtype=dtype)
    residual = torch.randn_like(x)
    tag = f"{tuple(x.shape)} {str(dtype)[6:]}{' zero-centred' if zero_centred else ''}"
    want = reference.rms_norm(x, weight, 1e-6, None, zero_centred)
    ok = report_ulps(f"rms_norm {tag}", rms_norm(x, weight, 1e-6, None, zero_centred), want)
    out, new_res = rms_norm(x, weight, 1e-6, residual, zero_centred)
    want_out, want_res = reference.rms_norm(x, weight, 1e-6, residual, zero_centred)
    ok &= report_ulps(f"rms_norm+residual {tag}", out, want_out)
    ok &= report(f"rms_norm+residual new residual {tag}", new_res, want_res, 0.0, 0.0)
    return ok


def check_act_and_mul(dev: torch.device, activation: str) -> bool:
    # The kernel rounds once; the twin rounds act(gate) and the product: within a bf16 ulp or two.
    x = torch.randn(512, 2 * 9216, device=dev, dtype=torch.bfloat16) * 4
    got = act_and_mul(x, activation)
    want = reference.act_and_mul(x.float(), activation)
    return report(f"act_and_mul {activation} {tuple(x.shape)} bf16", got, want, 1e-2, 1.6e-2)


def check_fused_fp8_quant(dev: torch.device) -> bool:
    """The RMSNorm and the gated activation quantizing their own outputs for an fp8 linear,
    bit for bit against the unfused pair (the kernel, then fp8_quant.quantize_tokens), at
    Llama-3-8B's widths, with a dynamic and a static scale."""
    from kvfleet.kernels import fp8_quant

    ok = True
    x = torch.randn(300, 4096, device=dev).to(torch.bfloat16) * 3
    r = torch.randn_like(x)
    w = torch.rand(4096, device=dev).to(torch.bfloat16)
    h = torch.randn(300, 2 * 14336, device=dev).to(torch.bfloat16) * 3
    for static in (None, torch.tensor(2.0 / 448, device=dev)):
        (q, s), _ = rms_norm(x, w, 1e-5, r, False, True, static)
        q_ref, s_ref = fp8_quant.quantize_tokens(rms_norm(x, w, 1e-5, r)[0], static)
        same = torch.equal(s, s_ref) and torch.equal(q.float(), q_ref.float())
        q2, s2 = act_and_mul(h, "silu", True, static)
        q2_ref, s2_ref = fp8_quant.quantize_tokens(act_and_mul(h, "silu"), static)
        same_act = torch.equal(s2, s2_ref) and torch.equal(q2.float(), q2_ref.float())
        for name, good in (("rms_norm", same), ("act_and_mul silu", same_act)):
            label = f"{name} -> fp8 {'static' if static is not None else 'dynamic'} scale"
            logger.info("%s %-58s %s", "PASS" if good else "FAIL", label,
                        "bit-exact" if good else "differs")  # fmt: skip
            ok &= good
    return ok


def check_grammar_mask(dev: torch.device, dtype: torch.dtype, vocab: int) -> bool:
    """Bit for bit against the twin: every other row of a wider batch (a row stride of its own), a
    bitmask wider than the vocabulary, free rows (all bits set) and a row with everything banned."""
    rows = 32
    batch = torch.randn(2 * rows, vocab + 64, device=dev).to(dtype)
    logits = batch[::2, :vocab]
    bitmask = torch.randint(-(2**31), 2**31, (rows, vocab // 32 + 8), device=dev).int()
    bitmask[::3] = -1
    bitmask[1] = 0
    want = logits.clone()
    reference.apply_token_bitmask(want, bitmask)
    untouched = batch.clone()
    apply_token_bitmask(logits, bitmask)
    untouched[::2, :vocab] = want
    ok = torch.equal(batch, untouched)
    name = f"grammar_mask {tuple(logits.shape)} {str(dtype)[6:]}"
    logger.info("%s %-58s %s", "PASS" if ok else "FAIL", name, "bit-exact" if ok else "differs")
    return ok


def run_checks(dev: torch.device) -> bool:
    bf16 = torch.bfloat16
    mixed = [(2048, 2048), (3000, 512), (1000, 1), (4100, 1), (17, 17), (100, 37), (16, 16)]
    mixed += [(int(n), 1) for n in torch.randint(1, 4096, (24,))]
    splits = sorted({1, 3, choose_num_splits(32768, 64, 8), 64})
    checks: list[Callable[[], bool]] = [
        lambda: check_cache_write(dev, bf16),
        lambda: check_cache_write(dev, torch.float32),
        lambda: check_decode(dev, bf16, 64, 2048, 32, 8, 128, None, None, splits),
        lambda: check_decode(dev, bf16, 8, 16384, 32, 8, 128, None, None, [16]),
        lambda: check_decode_graph(dev),
        lambda: check_decode(dev, bf16, 16, 3000, 32, 8, 128, 1024, 30.0, [1, 8]),
        lambda: check_decode(dev, bf16, 16, 1000, 28, 4, 64, None, None, [1, 4]),
        lambda: check_decode(dev, bf16, 16, 1000, 16, 8, 256, 512, 50.0, [1, 4]),
        lambda: check_decode(dev, bf16, 16, 1000, 16, 16, 128, None, None, [2]),
        lambda: check_decode(dev, torch.float16, 16, 1000, 32, 8, 128, None, None, [1, 4]),
        lambda: check_decode(dev, torch.float32, 16, 1000, 32, 8, 128, None, None, [1, 4]),
        lambda: check_decode(dev, bf16, 96, 2500, 40, 40, 128, None, None, [1, 2], 2000, 4),
        lambda: check_decode(dev, bf16, 64, 1500, 32, 8, 128, None, None, [1], 512, 1),
        lambda: check_decode(dev, bf16, 24, 900, 8, 4, 256, None, 50.0, [2], 320, 2),
        lambda: check_prefill(dev, bf16, mixed, 32, 8, 128, None, None),
        lambda: check_prefill(dev, bf16, mixed, 32, 8, 128, 1024, 30.0),
        lambda: check_prefill(dev, bf16, [(1500, 1500), (700, 300)], 28, 4, 64, None, None),
        lambda: check_prefill(dev, bf16, [(1500, 1500), (700, 300)], 16, 16, 128, None, None),
        lambda: check_prefill(dev, bf16, [(1500, 1500), (700, 300)], 16, 8, 256, 512, 50.0),
        lambda: check_prefill(dev, bf16, [(2, 2), (40, 3), (9, 1)], 32, 8, 128, None, None),
        lambda: check_prefill(dev, torch.float16, mixed[:8], 32, 8, 128, None, None),
        lambda: check_prefill(dev, torch.float32, mixed[:8], 32, 8, 128, None, None),
        lambda: check_prefill(dev, torch.float32, [(900, 900), (700, 1)], 16, 8, 256, 512, None),
        lambda: check_prefill(dev, torch.float32, [(900, 900), (700, 3)], 28, 4, 64, None, None),
        lambda: check_decode(dev, torch.float32, 8, 1000, 16, 8, 256, None, None, [1, 4]),
        lambda: check_rms_norm(dev, bf16, 4096),
        lambda: check_rms_norm(dev, torch.float16, 5120),
        lambda: check_rms_norm(dev, torch.float32, 3584),
        lambda: check_rms_norm(dev, bf16, 2304, zero_centred=True),
        lambda: check_act_and_mul(dev, "silu"),
        lambda: check_act_and_mul(dev, "gelu_pytorch_tanh"),
        lambda: check_fused_fp8_quant(dev),
        lambda: check_grammar_mask(dev, bf16, 128256),
        lambda: check_grammar_mask(dev, torch.float32, 151936),
        lambda: check_grammar_mask(dev, torch.float16, 49152 + 17),
        # FP8 KV cache: the write, decode at the bandwidth table's sizes (Llama-8B heads),
        # windowed and soft-capped decode, the cascade pass, prefill and mixed chunks.
        lambda: check_cache_write(dev, bf16, fp8=True),
        lambda: check_cache_write(dev, torch.float32, fp8=True),
        lambda: check_decode(dev, bf16, 64, 2048, 32, 8, 128, None, None, splits, fp8=True),
        lambda: check_decode(dev, bf16, 8, 16384, 32, 8, 128, None, None, [1, 16], fp8=True),
        lambda: check_decode(dev, bf16, 16, 3000, 32, 8, 128, 1024, 30.0, [1, 8], fp8=True),
        lambda: check_decode(dev, bf16, 16, 1000, 16, 8, 256, 512, 50.0, [4], fp8=True),
        lambda: check_decode(dev, torch.float16, 16, 1000, 32, 8, 128, None, None, [4], fp8=True),
        lambda: check_decode(dev, bf16, 96, 2500, 40, 40, 128, None, None, [2], 2000, 4, True),
        lambda: check_decode(dev, bf16, 64, 1500, 32, 8, 128, None, None, [1], 512, 1, True),
        lambda: check_prefill(dev, bf16, mixed, 32, 8, 128, None, None, fp8=True),
        lambda: check_prefill(dev, bf16, mixed, 32, 8, 128, 1024, 30.0, fp8=True),
        lambda: check_prefill(dev, bf16, [(1500, 1500), (700, 300)], 16, 8, 256, 512, 50.0, True),
        lambda: check_prefill(dev, torch.float32, mixed[:8], 32, 8, 128, None, None, fp8=True),
    ]
    return all([check() for check in checks])


# -- timing --------------------------------------------------------------------------------


def median_ms(fn: Callable[[], object], iters: int, warmup: int, graph: bool = True) -> float:
    """Median device time of one call. With graph, the call is captured in a CUDA graph and its
    replays are timed: a Triton launch costs tens of microseconds on the host, which would
    otherwise land inside the events around a kernel of a few hundred."""
    for _ in range(warmup):
        fn()  # compiles outside the capture
    if graph:
        captured = torch.cuda.CUDAGraph()
        with torch.cuda.graph(captured):
            fn()
        fn = captured.replay
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_bandwidth(dev: torch.device, iters: int, warmup: int) -> float:
    """Device-to-device copy of 2 GiB, counting bytes read plus written; GB/s."""
    src = torch.randn(2**29, device=dev)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), iters, warmup, graph=False)
    return 2 * src.numel() * src.element_size() / ms / 1e6


def decode_timer(
    dev: torch.device,
    batch: int,
    ctx_len: int,
    iters: int,
    warmup: int,
    heads: tuple[int, int] = (32, 8),
    shared_prefix: int = 0,
    cascade: bool = False,
    fp8: bool = False,
) -> tuple[Callable[[int], float], int]:
    """A decode batch built once, and a function timing it at a split count (ms), with the K/V
    bytes the step must read (every sequence's bytes counted, shared or not, at the cache's
    element size); with `cascade`, the shared prefix goes through the kernel's shared-prefix
    pass; with fp8, the cache is FP8."""
    (num_heads, num_kv_heads), head_dim, dtype = heads, 128, torch.bfloat16
    ctx = paged_context([ctx_len] * batch, num_kv_heads, head_dim, dtype, dev, fp8)
    # A prompt prefix every sequence shares: the same physical blocks head every block table.
    ctx.tables[:, : shared_prefix // BLOCK_SIZE] = ctx.tables[0, : shared_prefix // BLOCK_SIZE]
    query = torch.randn(batch, num_heads, head_dim, device=dev, dtype=dtype)
    seq_lens = torch.full((batch,), ctx_len, device=dev)
    out = torch.empty_like(query)
    prefix_len = torch.tensor([shared_prefix], device=dev) if cascade else None
    prefix_splits = choose_prefix_splits(4096, batch, num_heads, num_kv_heads)

    def time_ms(splits: int) -> float:
        return median_ms(
            lambda: paged_decode_attention(
                query,
                ctx.cache,
                ctx.tables,
                seq_lens,
                head_dim**-0.5,
                out=out,
                num_splits=splits,
                prefix_len=prefix_len,
                prefix_splits=prefix_splits,
                **ctx.scales,
            ),
            iters,
            warmup,
        )

    return time_ms, 2 * batch * ctx_len * num_kv_heads * head_dim * ctx.cache.element_size()


def bench_decode(
    dev: torch.device,
    batch: int,
    ctx_len: int,
    splits: int,
    iters: int,
    warmup: int,
    **case: Any,
) -> tuple[float, float]:
    """Time (ms) and logical KV bandwidth (GB/s) of one decode batch; `case`: decode_timer's
    heads, shared_prefix, cascade and fp8."""
    time_ms, kv_bytes = decode_timer(dev, batch, ctx_len, iters, warmup, **case)
    ms = time_ms(splits)
    return ms, kv_bytes / ms / 1e6


def bench_prefill(
    dev: torch.device, seqs: list[tuple[int, int]], iters: int, warmup: int, fp8: bool = False
) -> tuple[float, float]:
    num_heads, num_kv_heads, head_dim, dtype = 32, 8, 128, torch.bfloat16
    lens = [s for s, _ in seqs]
    qsl = torch.tensor([0, *itertools.accumulate(q for _, q in seqs)], device=dev)
    ctx = paged_context(lens, num_kv_heads, head_dim, dtype, dev, fp8)
    query = torch.randn(int(qsl[-1]), num_heads, head_dim, device=dev, dtype=dtype)
    out = torch.empty_like(query)
    seq_lens = torch.tensor(lens, device=dev)
    max_q = max(q for _, q in seqs)
    ms = median_ms(
        lambda: paged_prefill_attention(
            query,
            ctx.cache,
            ctx.tables,
            seq_lens,
            qsl,
            max_q,
            head_dim**-0.5,
            out=out,
            **ctx.scales,
        ),
        iters,
        warmup,
    )
    # Query-key pairs each sequence's causal mask keeps; 2 FLOPs per multiply-add, 2 products.
    pairs = sum(q * (s - q) + q * (q + 1) // 2 for s, q in seqs)
    return ms, 4 * pairs * num_heads * head_dim / ms / 1e9


# Prefill batches of the table, (name, [(context length, query length)]); the fp8 tile sweep
# times the first two.
PREFILL_WORKLOADS = (
    ("4 x 4096 prompts", [(4096, 4096)] * 4),
    ("chunk 2048 after 2048 + 64 decodes @ 2048", [(4096, 2048)] + [(2048, 1)] * 64),
    ("8192 prompt + 63 chunks of 16 @ 1000", [(8192, 8192)] + [(1000, 16)] * 63),
)


def interleaved_rounds(
    configs: list, rounds: int, time_ms: Callable[[Any], float]
) -> dict[Any, list[float]]:
    """Each configuration's times (ms) over `rounds` rounds, every round timing all of them in
    turn: a drift of the card's clocks then spreads over all configurations alike."""
    times: dict[Any, list[float]] = {c: [] for c in configs}
    for _ in range(rounds):
        for config in configs:
            times[config].append(time_ms(config))
    return times


def run_bench(dev: torch.device, iters: int, warmup: int, extra_splits: list[int]) -> None:
    copy_gbs = copy_bandwidth(dev, iters, warmup)
    num_sms = torch.cuda.get_device_properties(dev).multi_processor_count
    out = sys.stdout
    out.write(
        f"\n{torch.cuda.get_device_name(dev)}: device-to-device copy {copy_gbs:.0f} GB/s "
        f"(read + write); 32 q / 8 kv heads, head_dim 128, bf16 queries; median of {iters} "
        "CUDA-graph replays\n\ndecode (KV bytes read / time; an fp8 cache's bytes are 1 each)\n"
    )
    out.write(
        f"{'batch x ctx':>13} {'cache':>5} {'splits':>12} {'us':>9} {'KV GB/s':>9} {'% copy':>7}\n"
    )
    for batch, ctx_len in ((64, 2048), (8, 16384)):
        for fp8 in (False, True):
            chosen = choose_num_splits(32768, batch, 8, num_sms, fp8)
            for splits in sorted({chosen, *extra_splits}):
                ms, gbs = bench_decode(dev, batch, ctx_len, splits, iters, warmup, fp8=fp8)
                tag = f"{splits}{' (chosen)' if splits == chosen else ''}"
                pct = 100 * gbs / copy_gbs
                out.write(
                    f"{f'{batch} x {ctx_len}':>13} {'fp8' if fp8 else 'bf16':>5} {tag:>12} "
                    f"{ms * 1e3:9.1f} {gbs:9.0f} {pct:6.1f}%\n"
                )
    out.write("\ndecode, Llama-2-13B heads (40 q / 40 kv), chosen splits\n")
    for batch, ctx_len, shared, cascade in (
        (96, 640, 0, False),
        (96, 2560, 0, False),
        (96, 2560, 2000, False),
        (96, 2560, 2000, True),
        (96, 640, 0, True),
    ):
        splits = choose_num_splits(4096, batch, 40, num_sms)
        ms, gbs = bench_decode(
            dev,
            batch,
            ctx_len,
            splits,
            iters,
            warmup,
            heads=(40, 40),
            shared_prefix=shared,
            cascade=cascade,
        )
        out.write(
            f"{batch} x {ctx_len}, {shared} shared{', cascade' if cascade else ''}: "
            f"{ms * 1e3:9.1f} us, {gbs:6.0f} logical KV GB/s ({100 * gbs / copy_gbs:.0f}% of "
            "copy)\n"
        )
    out.write(
        f"\nprefill (causal FLOPs / time)\n{'batch':>42} {'cache':>5} {'us':>9} {'TFLOP/s':>9}\n"
    )
    for (name, seqs), fp8 in itertools.product(PREFILL_WORKLOADS, (False, True)):
        ms, tflops = bench_prefill(dev, seqs, iters, warmup, fp8)
        out.write(f"{name:>42} {'fp8' if fp8 else 'bf16':>5} {ms * 1e3:9.1f} {tflops:9.0f}\n")
    out.write("\nKV cache write, 8 kv heads x 128, contiguous slots\n")
    for num_tokens, fp8 in itertools.product((64, 4096), (False, True)):
        ms = bench_cache_write(dev, num_tokens, fp8, iters, warmup)
        out.write(f"{num_tokens:>6} tokens {'fp8' if fp8 else 'bf16':>5} {ms * 1e3:9.1f} us\n")


def bench_cache_write(
    dev: torch.device, num_tokens: int, fp8: bool, iters: int, warmup: int
) -> float:
    cache = torch.zeros(
        2, num_tokens // BLOCK_SIZE + 2, BLOCK_SIZE, 8, 128, device=dev,
        dtype=FP8 if fp8 else torch.bfloat16,
    )  # fmt: skip
    key, value = torch.randn(2, num_tokens, 8, 128, device=dev, dtype=torch.bfloat16)
    slots = torch.arange(num_tokens, device=dev) + BLOCK_SIZE
    scales = [torch.tensor(s, device=dev) for s in FP8_SCALES] if fp8 else [None, None]
    return median_ms(lambda: write_kv_cache(key, value, cache, slots, *scales), iters, warmup)


class _SkippedLaunch:
    """Stands in for a Triton kernel whose launches should not run (a sweep's 'without' row)."""

    def __getitem__(self, grid: object) -> Callable[..., None]:
        return lambda *args, **kwargs: None


def sweep_fp8_decode(dev: torch.device, iters: int, warmup: int, rounds: int) -> None:
    """The fp8-cache decode kernel's tile (keys per K/V tile), launch (warps, stages) and split
    count around the shipped choice, at the bandwidth table's sizes: what the 85%-of-copy goal
    needs. Configurations are timed in `rounds` interleaved rounds (the median and the spread
    are printed), and the shipped configuration once more without its reduction kernel, which
    bounds what folding the reduction into the split kernel can gain."""
    from kvfleet.kernels import paged_attention

    copy_gbs = copy_bandwidth(dev, iters, warmup)
    num_sms = torch.cuda.get_device_properties(dev).multi_processor_count
    shipped = paged_attention._kv_tile_tokens, paged_attention._FP8_DECODE_LAUNCH
    reduce_kernel = paged_attention._decode_reduce_kernel
    launches = ((2, 3), (2, 4), (2, 6), (4, 3), (4, 4))
    out = sys.stdout
    out.write(f"\nfp8-cache decode sweep (copy {copy_gbs:.0f} GB/s), {rounds} rounds\n")
    out.write(
        f"{'batch x ctx':>13} {'keys':>5} {'warps':>5} {'stages':>6} {'splits':>8} "
        f"{'us':>9} {'% copy':>7} {'range %':>12}\n"
    )
    try:
        for batch, ctx_len in ((64, 2048), (8, 16384)):
            time_ms, kv_bytes = decode_timer(dev, batch, ctx_len, iters, warmup, fp8=True)
            chosen = choose_num_splits(32768, batch, 8, num_sms, kv_fp8=True)
            configs = [
                (keys, launch, splits, False)
                for keys, launch, splits in itertools.product(
                    (64, 128), launches, sorted({max(chosen // 2, 1), chosen, 2 * chosen})
                )
            ]
            if chosen > 1:
                configs.append((64, shipped[1], chosen, True))

            def run(config: tuple, time_ms: Callable[[int], float] = time_ms) -> float:
                keys, launch, splits, skip_reduce = config
                paged_attention._kv_tile_tokens = lambda head_dim, itemsize: keys
                paged_attention._FP8_DECODE_LAUNCH = launch
                if skip_reduce:
                    paged_attention._decode_reduce_kernel = _SkippedLaunch()
                try:
                    return time_ms(splits)
                finally:
                    paged_attention._decode_reduce_kernel = reduce_kernel

            times = interleaved_rounds(configs, rounds, run)
            for (keys, (warps, stages), splits, skip_reduce), ms_list in times.items():
                pcts = [100 * kv_bytes / ms / 1e6 / copy_gbs for ms in ms_list]
                tag = f"{splits}{' no-red' if skip_reduce else ''}"
                out.write(
                    f"{f'{batch} x {ctx_len}':>13} {keys:>5} {warps:>5} {stages:>6} {tag:>8} "
                    f"{statistics.median(ms_list) * 1e3:9.1f} {statistics.median(pcts):6.1f}% "
                    f"{f'{min(pcts):.1f}-{max(pcts):.1f}':>12}\n"
                )
    finally:
        paged_attention._kv_tile_tokens, paged_attention._FP8_DECODE_LAUNCH = shipped


# Prefill tiles the fp8 sweep tries (BLOCK_M, BLOCK_N, num_warps, num_stages), head_dim 128.
FP8_PREFILL_TILES = (
    (128, 128, 8, 3),
    (128, 128, 8, 2),
    (128, 64, 8, 3),
    (128, 64, 8, 4),
    (128, 64, 4, 3),
    (64, 128, 4, 3),
    (64, 64, 4, 3),
)


def sweep_fp8_prefill(dev: torch.device, iters: int, warmup: int, rounds: int) -> None:
    """The fp8-cache prefill kernel's big tile at head_dim 128 (bf16 queries), in interleaved
    rounds, beside the bf16 cache with its shipped tile."""
    from kvfleet.kernels import paged_attention

    tiles = paged_attention._PREFILL_TILE[1]
    shipped = tiles[128]
    workloads = dict(PREFILL_WORKLOADS[:2])

    def run(config: tuple) -> float:
        name, tile = config  # tile None: the bf16 cache with its own tile
        tiles[128] = tile or shipped
        return bench_prefill(dev, workloads[name], iters, warmup, fp8=tile is not None)[0]

    try:
        configs = list(itertools.product(workloads, (None, *FP8_PREFILL_TILES)))
        times = interleaved_rounds(configs, rounds, run)
    finally:
        tiles[128] = shipped
    out = sys.stdout
    out.write(f"\nfp8-cache prefill tile sweep, {rounds} rounds (median, range)\n")
    for (name, tile), ms_list in times.items():
        label = "bf16 cache, shipped tile" if tile is None else f"fp8 {tile}"
        out.write(
            f"{name:>42} {label:>28} {statistics.median(ms_list) * 1e3:9.1f} us "
            f"({min(ms_list) * 1e3:.1f}-{max(ms_list) * 1e3:.1f})\n"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Check the Triton kernels against the PyTorch reference on a GPU; time them."
    )
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--iters", type=int, default=100, help="timed runs per case (median)")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument(
        "--splits",
        default="1,4,16",
        help="comma-separated decode split counts timed beside choose_num_splits' choice",
    )
    parser.add_argument("--skip-checks", action="store_true")
    parser.add_argument("--skip-bench", action="store_true")
    parser.add_argument(
        "--fp8-decode-sweep",
        action="store_true",
        help="sweep the fp8-cache decode kernel's tile, launch and splits (no checks, no table)",
    )
    parser.add_argument(
        "--fp8-prefill-sweep",
        action="store_true",
        help="sweep the fp8-cache prefill kernel's big tile (no checks, no table)",
    )
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of a sweep")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not torch.cuda.is_available():
        logger.error(
            "no CUDA device: run the interpreter tests instead "
            "(tests/kernels/test_triton_kernels.py)"
        )
        return 2
    dev = torch.device(args.device)
    torch.cuda.set_device(dev)
    torch.manual_seed(args.seed)
    if args.fp8_decode_sweep or args.fp8_prefill_sweep:
        if args.fp8_decode_sweep:
            sweep_fp8_decode(dev, args.iters, args.warmup, args.rounds)
        if args.fp8_prefill_sweep:
            sweep_fp8_prefill(dev, args.iters, args.warmup, args.rounds)
        return 0
    ok = True
    if not args.skip_checks:
        ok = run_checks(dev)
        logger.info("checks: %s", "all PASS" if ok else "FAILURES above")
    if not args.skip_bench:
        run_bench(dev, args.iters, args.warmup, [int(s) for s in args.splits.split(",") if s])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
