"""Fused elementwise Triton kernels (rotary with and without Qwen3's q/k norms, gated activations)
against their PyTorch twins, on the CPU through Triton's interpreter (compute in fp32: the
interpreter's bf16 arithmetic is wrong)."""

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


@pytest.mark.parametrize(
    ("num_q", "num_k", "head_dim", "zero_centred"), [(8, 2, 64, False), (6, 1, 32, True)]
)
def test_qk_norm_rotary_in_place_matches_norms_then_rotary(num_q, num_k, head_dim, zero_centred):
    """Each head of q and k normalised by its own weight, then rotated, in one launch: the twin's
    norm-then-rotary at GQA head counts, Llama's and Gemma's weight conventions, and a CUDA-graph
    padding token (zeros at position 0) that must stay finite."""
    rope = RotaryEmbedding(head_dim, 512, {"rope_theta": 10000.0})
    g = torch.Generator().manual_seed(2)
    tokens = 7
    qkv = torch.randn(tokens, (num_q + 2 * num_k) * head_dim, generator=g) * 3
    qkv[-1] = 0.0  # the padding row
    q = qkv[:, : num_q * head_dim].view(tokens, num_q, head_dim)
    k = qkv[:, num_q * head_dim : (num_q + num_k) * head_dim].view(tokens, num_k, head_dim)
    positions = torch.tensor([0, 1, 17, 100, 300, 511, 0])
    norms = reference.QKNorm(
        1 + 0.3 * torch.randn(head_dim, generator=g),
        1 + 0.3 * torch.randn(head_dim, generator=g),
        1e-6,
        zero_centred,
    )
    q_normed = reference.rms_norm(q, norms.q_weight, 1e-6, zero_centred=zero_centred)
    k_normed = reference.rms_norm(k, norms.k_weight, 1e-6, zero_centred=zero_centred)
    assert isinstance(q_normed, torch.Tensor) and isinstance(k_normed, torch.Tensor)
    want_q, want_k = reference.apply_rotary(q_normed, k_normed, positions, rope.cos, rope.sin)
    twin_q, twin_k = reference.apply_rotary(q, k, positions, rope.cos, rope.sin, norms)
    assert torch.equal(twin_q, want_q) and torch.equal(twin_k, want_k)
    # The norms bite: the rotation alone is far from it (inputs are ~3x the normalised scale).
    unnormed_q, _ = reference.apply_rotary(q, k, positions, rope.cos, rope.sin)
    assert (unnormed_q - want_q).abs().max() > 1.0
    v_before = qkv[:, (num_q + num_k) * head_dim :].clone()
    got_q, got_k = apply_rotary(q, k, positions, rope.cos, rope.sin, norms)
    assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()  # in place
    torch.testing.assert_close(got_q, want_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_k, want_k, atol=1e-5, rtol=1e-5)
    assert torch.equal(got_q[-1], torch.zeros_like(got_q[-1]))
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
