"""Gated MLP activations: the input holds gate and up halves side by side."""

from __future__ import annotations

import torch
from torch import nn

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
        self.act = _ACTIVATIONS[hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return self.act(gate) * up
