"""Batched LoRA for the engine's layers: each token's adapter over a batch that mixes adapters and
the base model (slots[t] is token t's GPU slot, -1 for the base model). On CUDA with Triton the
kernels of kvfleet.kernels.lora, elsewhere their PyTorch twins; both keep every shape fixed by
the token count and read nothing on the host, so a CUDA graph captures either."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvfleet.kernels import reference
from kvfleet.kernels.availability import triton_available


def add_lora_slices(
    x: torch.Tensor,
    a_slices: Sequence[torch.Tensor],
    b_slices: Sequence[torch.Tensor],
    slots: torch.Tensor,
    out: torch.Tensor,
    offsets: Sequence[int],
) -> None:
    """out[t, offsets[i]:offsets[i] + N_i] += x[t] @ A_i[slots[t]].T @ B_i[slots[t]].T in place
    for the adapters' tokens, for each slice i (q, k, v; gate, up) of one projection. The
    slices' A may be views of one stacked buffer (a[:, i * R:(i + 1) * R])."""
    if x.is_cuda and triton_available():
        from kvfleet.kernels import lora

        lora.add_lora_slices(x, a_slices, b_slices, slots, out, offsets)
    else:
        reference.add_lora_slices(x, a_slices, b_slices, slots, out, offsets)
