"""MLP activations. Gated ones take an input holding gate and up halves side by side."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from kvfleet.engine.layers.fp8 import Fp8Activations, Fp8Input, quantize_input
from kvfleet.kernels import reference
from kvfleet.kernels.availability import triton_available


def _gelu_new(x: torch.Tensor) -> torch.Tensor:
    # GPT-2's tanh GELU spelt out as HF's NewGELUActivation does; torch's fused
    # gelu(approximate="tanh") rounds differently in the last bits.
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3.0))))


_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": nn.functional.silu,
    "gelu": nn.functional.gelu,
    "gelu_pytorch_tanh": lambda x: nn.functional.gelu(x, approximate="tanh"),
    "gelu_new": _gelu_new,
    "relu": nn.functional.relu,
}


def get_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in _ACTIVATIONS:
        raise ValueError(f"unsupported activation {name!r}; known: {sorted(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]


class GatedActivation(nn.Module):
    def __init__(self, hidden_act: str) -> None:
        super().__init__()
        self.hidden_act = hidden_act
        self.act = get_activation(hidden_act)
        # Set when only an fp8 linear reads the output: quantized here (Fp8Activations).
        self.fp8_output: Fp8Input | None = None

    def forward(self, x: torch.Tensor) -> Any:
        fp8 = self.fp8_output
        if self.hidden_act in reference.GATED_ACTIVATIONS:
            if x.is_cuda and triton_available():
                from kvfleet.kernels.activation import act_and_mul

                if fp8 is None:
                    return act_and_mul(x, self.hidden_act)
                data, scale = act_and_mul(x, self.hidden_act, True, fp8.static_scale)
                return Fp8Activations(data, scale, x.dtype)
            out = reference.act_and_mul(x, self.hidden_act)
        else:
            gate, up = x.chunk(2, dim=-1)
            out = self.act(gate) * up
        return out if fp8 is None else quantize_input(out, fp8.static_scale)
