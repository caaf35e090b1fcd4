"""The Triton twins of the fp8 linear's elementwise work (CUDA's path), in the Triton
interpreter on the CPU against the PyTorch functions (the CPU's path and the oracle)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from kvfleet.engine.layers.fp8 import quantize_rows
from kvfleet.kernels import fp8_quant, reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [48, 5000])  # 5000: more than one block per row
@pytest.mark.parametrize("static", [False, True])
def test_quantize_tokens_equals_the_pytorch_function(dtype, k, static):
    gen = torch.Generator().manual_seed(k)
    x = (torch.randn(5, k, generator=gen) * torch.logspace(-2, 2, 5)[:, None]).to(dtype)
    x[2] = 0
    scale = torch.tensor(3.0 / 448) if static else None  # clamps the larger rows
    q, s = fp8_quant.quantize_tokens(x, scale)
    q_ref, s_ref = reference.quantize_tokens(x, scale)
    assert q.dtype == reference.FP8 and s.shape == (5, 1)
    torch.testing.assert_close(s, s_ref, rtol=0, atol=0)
    # The interpreter's fp8 cast does not round to nearest (2-3% of values land one or more
    # steps toward zero); a GPU's cvt.rn.satfinite does, and test_fp8_weights_gpu.py checks
    # the kernel's values there against the same function exactly.
    mismatched = (q.float() != q_ref.float()).float().mean().item()
    assert mismatched < 0.05, mismatched


@pytest.mark.parametrize("bias", [False, True])
def test_scale_rows_cols_is_the_row_wise_epilogue(bias):
    gen = torch.Generator().manual_seed(3)
    acc = torch.randn(7, 2100, generator=gen) * 1000
    rows, cols = torch.rand(7, 1, generator=gen), torch.rand(2100, generator=gen)
    b = torch.randn(2100, generator=gen).to(torch.bfloat16) if bias else None
    y = fp8_quant.scale_rows_cols(acc, rows, cols, b, torch.bfloat16)
    ref = acc * (rows * cols) + (b.float() if bias else 0)
    assert y.dtype == torch.bfloat16
    # The interpreter's bf16 cast truncates: one bf16 step (2^-7 relative), not half of one.
    torch.testing.assert_close(y.float(), ref, rtol=2**-7, atol=1e-3)


@pytest.mark.parametrize("mode", [fp8_quant.DOT_FP16, fp8_quant.FMA])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("m", "k", "n"), [(1, 96, 48), (5, 600, 40), (16, 1040, 64)])
@pytest.mark.parametrize(("static", "bias"), [(False, False), (True, True)])
def test_small_batch_linear_is_the_w8a8_product(mode, dtype, m, k, n, static, bias):
    """The one-kernel linear against quantize-then-_scaled_mm, the path of larger batches. The
    reference quantizes with the interpreter's kernel too, whose fp8 cast rounds as the
    interpreter does (the GPU test compares against the PyTorch quantization)."""
    gen = torch.Generator().manual_seed(m * k + n)
    wide = torch.randn(m, k + 24, generator=gen).to(dtype)
    x = wide[:, :k]  # a row stride wider than the row
    w_fp8, w_scale = quantize_rows(torch.randn(n, k, generator=gen) * 0.02)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    scale = torch.tensor(2.0 / 448) if static else None  # clamps the largest activations
    y = fp8_quant.small_batch_linear(x, w_fp8, w_scale, scale, b, mode, block_k=256)
    x_fp8, x_scale = fp8_quant.quantize_tokens(x.contiguous(), scale)
    ref = torch._scaled_mm(
        x_fp8, w_fp8.t(), scale_a=x_scale, scale_b=w_scale.view(1, -1), out_dtype=torch.float32
    ) + (b.float() if bias else 0)
    assert y.dtype == dtype and y.shape == (m, n)
    # fp32: the sums' order only; bf16: the interpreter's truncating cast, one step (2^-7).
    rtol = 1e-5 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(y.float(), ref, rtol=rtol, atol=1e-4)


def test_small_batch_linear_refuses_a_larger_batch():
    m = fp8_quant.SMALL_BATCH_TOKENS + 1
    w_fp8, w_scale = quantize_rows(torch.randn(32, 64))
    with pytest.raises(ValueError, match=f"up to {fp8_quant.SMALL_BATCH_TOKENS} tokens, not {m}"):
        fp8_quant.small_batch_linear(torch.randn(m, 64), w_fp8, w_scale, None, None)
