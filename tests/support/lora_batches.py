"""Batches for the batched-LoRA kernels' tests: adapters in GPU slots, padded to one rank, a
token -> slot map mixing them with the base model, and LoRA written out row by row."""

from __future__ import annotations

import torch

# Three slots of rank 16 at most; slot 1 holds a rank-8 adapter, padded with zeros.
SLOTS, RANK = 3, 16
# Tokens of slots 0-2 and of the base model (-1), mixed as a batch mixes requests.
SLOT_MAP = [0, -1, 2, 1, 1, -1, 0, 2, -1, 1, 0]


def adapters(
    n: int, k: int, seed: int, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """A [S, R, K] and B [S, N, R] with slot 1's rank 8: its rows/columns past 8 are zero."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(SLOTS, RANK, k, generator=gen) / k**0.5
    b = torch.randn(SLOTS, n, RANK, generator=gen)
    a[1, 8:] = 0
    b[1, :, 8:] = 0
    return a.to(dtype), b.to(dtype)


def row_by_row(
    x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor, base: torch.Tensor
) -> torch.Tensor:
    """base[t] + x[t] @ A_s.T @ B_s.T for each token of an adapter, base[t] for the others."""
    want = base.clone().float()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            want[t] += (x[t].float() @ a[s].float().T) @ b[s].float().T
    return want
