"""The Triton twins of the fp8 linear's elementwise work (CUDA's path), in the Triton
interpreter on the CPU against the PyTorch functions (the CPU's path and the oracle)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from kvfleet.kernels import fp8_quant, reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# 17000: wider than fp8_quant.ONE_PASS_MAX, so read in passes; the others in one.
@pytest.mark.parametrize("k", [48, 5000, 17000])
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


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("static", [False, True])
def test_rms_norm_quantizes_its_output_as_the_quantize_kernel_would(residual, static):
    """The fused norm's fp8 values and scales equal the unfused pair's (the norm, then the
    quantization kernel) bit for bit: the row is rounded to the input dtype before its amax."""
    from kvfleet.kernels.rms_norm import rms_norm

    gen = torch.Generator().manual_seed(7)
    x = (torch.randn(5, 1000, generator=gen) * 4).to(torch.bfloat16)
    r = torch.randn(5, 1000, generator=gen).to(torch.bfloat16) if residual else None
    w = torch.rand(1000, generator=gen).to(torch.bfloat16)
    scale = torch.tensor(0.5 / 448) if static else None  # clamps
    fused = rms_norm(x, w, 1e-6, r, False, True, scale)
    plain = rms_norm(x, w, 1e-6, r)
    (q, s), new_r = fused if residual else (fused, None)
    q_ref, s_ref = fp8_quant.quantize_tokens(plain[0] if residual else plain, scale)
    assert q.dtype == reference.FP8 and q.shape == x.shape and s.shape == (5, 1)
    assert torch.equal(s, s_ref)
    assert torch.equal(q.float(), q_ref.float())
    if residual:
        assert torch.equal(new_r, plain[1])


@pytest.mark.parametrize("activation", ["silu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("d", [5000, 17000])  # in registers; in passes (ONE_PASS_MAX)
def test_act_and_mul_quantizes_its_output_as_the_quantize_kernel_would(activation, static, d):
    from kvfleet.kernels.activation import act_and_mul

    gen = torch.Generator().manual_seed(8)
    x = (torch.randn(3, 2 * d, generator=gen) * 3).to(torch.bfloat16)
    x[1] = 0
    scale = torch.tensor(2.0 / 448) if static else None
    q, s = act_and_mul(x, activation, True, scale)
    q_ref, s_ref = fp8_quant.quantize_tokens(act_and_mul(x, activation), scale)
    assert q.dtype == reference.FP8 and q.shape == (3, d)
    assert torch.equal(s, s_ref)
    assert torch.equal(q.float(), q_ref.float())
