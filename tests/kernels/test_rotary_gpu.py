"""The rotary kernel with Qwen3's q/k norms fused in, at Qwen3-30B-A3B's head sizes on the GPU:
in bf16 against the three launches it replaces (the rms_norm kernel over q's and k's heads,
then the plain rotary kernel), in fp32 against the twin, and one launch through the engine's
entry. Skipped where no GPU is visible (CI); run on one with
`pytest -q tests/kernels/test_rotary_gpu.py`. The models' greedy equality with HF on the fused
path is tests/engine/test_gpu.py's and test_moe_gpu.py's (qwen3, qwen3_moe)."""

from __future__ import annotations

import pytest
import torch

from kvfleet.engine.layers.rotary import RotaryEmbedding
from kvfleet.kernels import reference
from kvfleet.kernels.reference import QKNorm

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# Qwen3-30B-A3B's attention: 32 query heads and 4 KV heads of 128, rope_theta 1e6, eps 1e-6.
NUM_Q, NUM_KV, HEAD_DIM = 32, 4, 128
MAX_POSITION = 40960
EPS = 1e-6


def _inputs(
    tokens: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, QKNorm, RotaryEmbedding]:
    """q and k as views of one fused qkv output (as the model hands them over), positions
    anywhere in the context, norm weights near 1, the rope table."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    width = (NUM_Q + 2 * NUM_KV) * HEAD_DIM
    qkv = (torch.randn(tokens, width, device="cuda", generator=gen) * 4).to(dtype)
    q = qkv[:, : NUM_Q * HEAD_DIM].view(tokens, NUM_Q, HEAD_DIM)
    k = qkv[:, NUM_Q * HEAD_DIM : (NUM_Q + NUM_KV) * HEAD_DIM].view(tokens, NUM_KV, HEAD_DIM)
    positions = torch.randint(0, MAX_POSITION, (tokens,), device="cuda", generator=gen)
    weights = [
        (1 + 0.1 * torch.randn(HEAD_DIM, device="cuda", generator=gen)).to(dtype) for _ in "qk"
    ]
    rope = RotaryEmbedding(HEAD_DIM, MAX_POSITION, {"rope_theta": 1e6}).cuda()
    return q, k, positions, QKNorm(weights[0], weights[1], EPS), rope


@pytest.mark.parametrize("tokens", [1, 64, 2048])
def test_fused_equals_the_unfused_launches_in_bf16(tokens: int) -> None:
    from kvfleet.kernels.rms_norm import rms_norm
    from kvfleet.kernels.rotary import apply_rotary

    q, k, positions, norms, rope = _inputs(tokens, torch.bfloat16, seed=tokens)
    want_q, want_k = apply_rotary(
        rms_norm(q, norms.q_weight, EPS), rms_norm(k, norms.k_weight, EPS), positions,
        rope.cos, rope.sin,
    )  # fmt: skip
    got_q, got_k = apply_rotary(q, k, positions, rope.cos, rope.sin, norms)
    for got, want in ((got_q, want_q), (got_k, want_k)):
        # The same roundings; only the fp32 sum of squares is added in another order, which
        # moves a bf16 rounding now and then by one unit.
        torch.testing.assert_close(got, want, atol=3e-2, rtol=1e-2)
        assert (got == want).float().mean().item() > 0.99


def test_fused_equals_the_twin_in_fp32() -> None:
    from kvfleet.kernels.rotary import apply_rotary

    q, k, positions, norms, rope = _inputs(256, torch.float32, seed=5)
    want_q, want_k = reference.apply_rotary(q, k, positions, rope.cos, rope.sin, norms)
    got_q, got_k = apply_rotary(q, k, positions, rope.cos, rope.sin, norms)
    torch.testing.assert_close(got_q, want_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_k, want_k, atol=1e-5, rtol=1e-5)


def test_engine_entry_is_one_launch() -> None:
    """The layer's rotary with q/k norms on CUDA tensors: one kernel, the fused one."""
    q, k, positions, norms, rope = _inputs(1, torch.bfloat16, seed=7)
    rope(positions, q, k, norms)  # compiles outside the profile
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        rope(positions, q, k, norms)
        torch.cuda.synchronize()
    events = prof.events()
    assert events is not None  # set once the profile has ended
    launched = [e.name for e in events if e.device_type == torch.profiler.DeviceType.CUDA]
    assert len(launched) == 1 and "_rotary_kernel" in launched[0], launched
