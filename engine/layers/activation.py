"""Gated MLP activations: the input holds gate and up halves side by side."""

from __future__ import annotations

import torch
from torch import nn

from kvfleet.kernels import reference, triton_available

_ACTIVATIONS = {
    "silu": nn.functional.silu,
    "gelu": nn.functional.gelu,
    "gelu_pytorch_tanh": lambda x: nn.functional.gelu(x, approximate="tanh"),
}


class GatedActivation(nn.Module):
    def __init__(self, hidden_act: str) -> None:
        super().__init__()
        if hidden_act not in _ACTIVATIONS:
            raise ValueError(
                f"unsupported hidden_act {hidden_act!r}; known: {sorted(_ACTIVATIONS)}"
            )
        self.hidden_act = hidden_act
        self.act = _ACTIVATIONS[hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.hidden_act == "silu":
            if x.is_cuda and triton_available():
                from kvfleet.kernels.activation import silu_and_mul

                return silu_and_mul(x)
            return reference.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return self.act(gate) * up
