"""Normalisation layers, with the residual add fused in (x + residual is both normed and carried
on): RMSNorm (Llama family), GemmaRMSNorm (scale by 1 + weight) and LayerNorm (GPT-2)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kvfleet.engine.layers.fp8 import Fp8Activations, Fp8Input, quantize_input
from kvfleet.kernels import reference
from kvfleet.kernels.availability import triton_available


class RMSNorm(nn.Module):
    # Gemma stores the weight zero-centred and applies it as (1 + weight).
    zero_centred = False

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        init = torch.zeros if self.zero_centred else torch.ones
        self.weight = nn.Parameter(init(hidden_size), requires_grad=False)
        # Set when only an fp8 linear reads the output: the norm quantizes it (Fp8Activations).
        self.fp8_output: Fp8Input | None = None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> Any:
        fp8 = self.fp8_output
        if x.is_cuda and triton_available():
            from kvfleet.kernels.rms_norm import rms_norm

            if fp8 is None:
                return rms_norm(x, self.weight, self.eps, residual, self.zero_centred)
            out = rms_norm(
                x, self.weight, self.eps, residual, self.zero_centred, True, fp8.static_scale
            )
            (data, scale), new_residual = out if residual is not None else (out, None)
            quantized = Fp8Activations(data, scale, x.dtype)
            return quantized if residual is None else (quantized, new_residual)
        out = reference.rms_norm(x, self.weight, self.eps, residual, self.zero_centred)
        if fp8 is None:
            return out
        if residual is None:
            assert isinstance(out, torch.Tensor)  # without a residual, the norm alone
            return quantize_input(out, fp8.static_scale)
        return quantize_input(out[0], fp8.static_scale), out[1]


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: the weight is stored zero-centred and applied as (1 + weight), and the
    multiply happens in fp32 before rounding (Llama rounds first), as HF's Gemma2RMSNorm does."""

    zero_centred = True


class LayerNorm(nn.Module):
    """LayerNorm with weight and bias (GPT-2)."""

    def __init__(self, hidden_size: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(hidden_size), requires_grad=False)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:
            x = x + residual
            residual = x
        out = nn.functional.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.eps)
        return out if residual is None else (out, residual)
