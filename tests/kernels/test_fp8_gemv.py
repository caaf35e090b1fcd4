"""The small-batch fp8 linear (kernels.fp8_gemv) in the Triton interpreter on the CPU against its
PyTorch twin: every tile shape the autotuner may pick, ragged edges, bias, 1-4 tokens."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from kvfleet.engine.layers.fp8 import quantize_rows
from kvfleet.kernels import fp8_gemv, reference


def _linear(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return quantize_rows(torch.randn(n, k, generator=gen) * torch.rand(n, 1, generator=gen))


@pytest.mark.parametrize("config", [c.all_kwargs() for c in fp8_gemv._CONFIGS])
def test_every_tile_equals_the_twin(config):
    w, scale = _linear(48, 2096, 1)  # K not a multiple of any BLOCK_K: a ragged last tile
    x = torch.randn(3, 2096, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    bias = torch.randn(48).to(torch.bfloat16)
    y = fp8_gemv.fp8_gemv(x, w, scale, bias, config)
    ref = reference.weight_only_fp8_linear(x, w, scale, bias)
    assert y.dtype == torch.bfloat16 and y.shape == (3, 48)
    # Same products; only the order of the fp32 sums and the final rounding differ (the
    # interpreter's bf16 cast truncates: one bf16 step).
    torch.testing.assert_close(y.float(), ref.float(), rtol=2**-7, atol=2e-2)


@pytest.mark.parametrize("m", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tokens_and_dtypes(m, dtype):
    w, scale = _linear(40, 512, m)  # 40 rows: not a multiple of 16-row tiles
    x = torch.randn(m, 512, generator=torch.Generator().manual_seed(5)).to(dtype)
    config = {"BLOCK_N": 16, "BLOCK_K": 256, "num_warps": 4, "num_stages": 2}
    y = fp8_gemv.fp8_gemv(x, w, scale, None, config)
    ref = reference.weight_only_fp8_linear(x, w, scale, None)
    tol = 2**-7 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(y.float(), ref.float(), rtol=tol, atol=tol)


def test_a_strided_batch_row_is_read_in_place():
    w, scale = _linear(32, 256, 9)
    x = torch.randn(2, 512)[:, :256]  # row stride 512, unit column stride
    config = {"BLOCK_N": 8, "BLOCK_K": 128, "num_warps": 4, "num_stages": 2}
    y = fp8_gemv.fp8_gemv(x, w, scale, None, config)
    torch.testing.assert_close(y, reference.weight_only_fp8_linear(x, w, scale, None))


def test_more_tokens_than_a_gemv_are_refused():
    w, scale = _linear(16, 64, 0)
    with pytest.raises(ValueError, match="up to 4 tokens, not 5"):
        fp8_gemv.fp8_gemv(torch.randn(5, 64), w, scale, None)
