"""RMSNorm, with the residual add fused in (x + residual is both normed and carried on)."""

from __future__ import annotations

import torch
from torch import nn

from kvfleet.kernels import reference, triton_available


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if x.is_cuda and triton_available():
            from kvfleet.kernels.rms_norm import rms_norm

            return rms_norm(x, self.weight, self.eps, residual)
        return reference.rms_norm(x, self.weight, self.eps, residual)
