"""The small-batch fp8 GEMM (CUDA's decode path for fp8 linears) in the Triton interpreter on the
CPU, against the CPU's own path (torch._scaled_mm with row-wise scales): split and unsplit K,
a K that no tile divides, a bias, padded tokens and the counters left ready for the next call."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from kvfleet.engine.layers.fp8 import quantize_rows
from kvfleet.kernels import fp8_gemm, reference


def _operands(m: int, k: int, n: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen) * torch.logspace(-1, 1, m)[:, None]
    x_fp8, x_scale = reference.quantize_tokens(x.to(torch.bfloat16), None)
    w_fp8, w_scale = quantize_rows(torch.randn(n, k, generator=gen) * 0.05)
    return x_fp8, x_scale, w_fp8, w_scale


@pytest.mark.parametrize(
    ("m", "k", "n", "tile"),
    [
        (1, 512, 192, fp8_gemm.GemmTile(64, 128, 1)),
        (3, 512, 192, fp8_gemm.GemmTile(64, 128, 3)),  # 4 K tiles over 3 splits: 2, 2, 0
        (16, 400, 128, fp8_gemm.GemmTile(64, 128, 2)),  # a partial last K tile
        (5, 1024, 96, fp8_gemm.GemmTile(64, 256, 4)),  # a partial column block
    ],
)
@pytest.mark.parametrize("bias", [False, True])
def test_small_batch_gemm_is_the_row_wise_scaled_mm(m, k, n, tile, bias):
    x_fp8, x_scale, w_fp8, w_scale = _operands(m, k, n, m * k + n)
    b = torch.randn(n, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    b = b if bias else None
    counters = fp8_gemm._counters(x_fp8.device)
    for _ in range(2):  # the second call finds the counters as the first left them
        got = fp8_gemm.small_batch_gemm(x_fp8, x_scale, w_fp8, w_scale, b, torch.bfloat16, tile)
        assert not counters.any()
    want = torch._scaled_mm(
        x_fp8, w_fp8.t(), scale_a=x_scale, scale_b=w_scale.view(1, -1), out_dtype=torch.float32
    ) + (b.float() if bias else 0)
    assert got.shape == (m, n) and got.dtype == torch.bfloat16
    # The interpreter's bf16 cast truncates: one bf16 step (2^-7 relative).
    torch.testing.assert_close(got.float(), want, rtol=2**-7, atol=1e-3)


def test_default_tile_splits_k_only_for_few_column_blocks():
    # Llama-3-8B's down projection and gate_up: enough column blocks, so K stays whole, with
    # deeper pipelining where an SM has few programs.
    assert fp8_gemm.default_tile(4096, 14336, 132) == fp8_gemm.GemmTile(64, 256, 1, 4, 6)
    assert fp8_gemm.default_tile(28672, 4096, 132) == fp8_gemm.GemmTile(64, 256, 1, 4, 4)
    # A shard of 1,024 columns (16 blocks): K split to reach 64 programs.
    assert fp8_gemm.default_tile(1024, 2048, 132).split_k == 4
    assert fp8_gemm.default_tile(1024, 512, 132).split_k == 1  # one split per two K tiles


def test_small_batch_gemm_refuses_more_tokens_than_it_pads_to():
    x_fp8, x_scale, w_fp8, w_scale = _operands(17, 256, 64, 0)
    with pytest.raises(ValueError, match="1-16 tokens"):
        fp8_gemm.small_batch_gemm(x_fp8, x_scale, w_fp8, w_scale, None, torch.bfloat16)


def test_the_fp8_linear_sends_the_batches_this_gemm_takes():
    from kvfleet.engine.layers import fp8

    assert fp8._GEMM_TOKENS == fp8_gemm.MAX_TOKENS
