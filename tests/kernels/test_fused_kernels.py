"""Fused elementwise Triton kernels (rotary, gated activations) against their PyTorch twins, on the
CPU through Triton's interpreter (compute in fp32: the interpreter's bf16 arithmetic is wrong)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

pytest.importorskip("triton")

from kvfleet.engine.layers.rotary import RotaryEmbedding
from kvfleet.kernels import reference
from kvfleet.kernels.activation import act_and_mul
from kvfleet.kernels.rotary import apply_rotary


@pytest.mark.parametrize(("num_q", "num_k", "head_dim"), [(4, 4, 64), (8, 2, 128), (6, 1, 32)])
def test_rotary_in_place_matches_reference(num_q, num_k, head_dim):
    rope = RotaryEmbedding(head_dim, 512, {"rope_theta": 10000.0})
    g = torch.Generator().manual_seed(0)
    tokens = 9
    # q and k as strided views of one fused qkv row, as the model hands them over.
    qkv = torch.randn(tokens, (num_q + 2 * num_k) * head_dim, generator=g)
    q = qkv[:, : num_q * head_dim].view(tokens, num_q, head_dim)
    k = qkv[:, num_q * head_dim : (num_q + num_k) * head_dim].view(tokens, num_k, head_dim)
    positions = torch.tensor([0, 1, 2, 15, 16, 17, 100, 300, 511])
    want_q, want_k = reference.apply_rotary(q.clone(), k.clone(), positions, rope.cos, rope.sin)
    v_before = qkv[:, (num_q + num_k) * head_dim :].clone()
    got_q, got_k = apply_rotary(q, k, positions, rope.cos, rope.sin)
    assert got_q.data_ptr() == q.data_ptr()  # in place
    torch.testing.assert_close(got_q, want_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_k, want_k, atol=1e-5, rtol=1e-5)
    assert torch.equal(qkv[:, (num_q + num_k) * head_dim :], v_before)  # v untouched


@pytest.mark.parametrize("activation", sorted(reference.GATED_ACTIVATIONS))
@pytest.mark.parametrize("shape", [(1, 2 * 7), (5, 2 * 64), (3, 2 * 1500)])
def test_gated_activation_matches_reference(shape, activation):
    # Scaled so both tails (exp overflow, act -> 0 or -> identity) are exercised.
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1)) * 12
    got = act_and_mul(x, activation)
    torch.testing.assert_close(got, reference.act_and_mul(x, activation), atol=1e-5, rtol=1e-5)
    assert torch.isfinite(got).all()


def test_gated_activation_refuses_an_unfused_name():
    with pytest.raises(ValueError, match="no fused kernel for 'relu'"):
        act_and_mul(torch.ones(2, 4), "relu")
