"""Rotary position embedding (neox / rotate-half style) with the rope scalings Llama-family
checkpoints use. cos/sin are tabulated once for every position up to max_position."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from kvfleet.kernels import reference
from kvfleet.kernels.availability import triton_available


def _default_inv_freq(dim: int, base: float) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3_inv_freq(inv_freq: torch.Tensor, p: Mapping[str, Any]) -> torch.Tensor:
    factor = p["factor"]
    low, high = p["low_freq_factor"], p["high_freq_factor"]
    old_len = p["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_inv_freq(head_dim: int, params: Mapping[str, Any]) -> torch.Tensor:
    rope_type = params.get("rope_type", params.get("type", "default"))
    inv_freq = _default_inv_freq(head_dim, float(params.get("rope_theta", 10000.0)))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / params["factor"]
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, params)
    raise ValueError(f"rope_type {rope_type!r} is not supported (default, linear, llama3 are)")


class RotaryEmbedding(nn.Module):
    cos: torch.Tensor  # buffers, registered in __init__
    sin: torch.Tensor

    def __init__(self, head_dim: int, max_position: int, params: Mapping[str, Any]) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, params)
        # fp32 whatever the model dtype: positions in the 100k range need the mantissa.
        inv_freq = inv_freq.to(torch.float32)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        qk_norm: reference.QKNorm | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [tokens, heads, head_dim], k: [tokens, kv_heads, head_dim]; with ``qk_norm``,
        each head of both normalised before the rotation, in the same launch."""
        if q.is_cuda and triton_available():
            from kvfleet.kernels.rotary import apply_rotary

            return apply_rotary(q, k, positions, self.cos, self.sin, qk_norm)
        return reference.apply_rotary(q, k, positions, self.cos, self.sin, qk_norm)
