"""Batched LoRA for the engine's layers: each token's adapter over a batch that mixes adapters and
the base model (slots[t] is token t's GPU slot, -1 for the base model). On CUDA with Triton the
kernels of kvfleet.kernels.lora, elsewhere their PyTorch twins; both keep every shape fixed by
the token count and read nothing on the host, so a CUDA graph captures either."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvfleet.kernels import reference
from kvfleet.kernels.availability import triton_available


def lora_shrink(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """[T, R] in x's dtype: x[t] @ a[slots[t]].T, zero for the base model's tokens."""
    if x.is_cuda and triton_available():
        from kvfleet.kernels import lora

        return lora.lora_shrink(x, a, slots)
    return reference.lora_shrink(x, a, slots)


def lora_expand(
    y: torch.Tensor, b: torch.Tensor, slots: torch.Tensor, out: torch.Tensor, offset: int = 0
) -> None:
    """out[t, offset:offset + N] += y[t] @ b[slots[t]].T in place for the adapters' tokens."""
    if y.is_cuda and triton_available():
        from kvfleet.kernels import lora

        lora.lora_expand(y, b, slots, out, offset)
    else:
        reference.lora_expand(y, b, slots, out, offset)


def lora_shrink_slices(
    x: torch.Tensor, a_slices: Sequence[torch.Tensor], slots: torch.Tensor
) -> torch.Tensor:
    """[n_slices, T, R]: lora_shrink by each slice's A (q, k, v; gate, up) in one launch. The
    slices may be views of one stacked buffer (a[:, i * R:(i + 1) * R])."""
    if x.is_cuda and triton_available():
        from kvfleet.kernels import lora

        return lora.lora_shrink_slices(x, a_slices, slots)
    return reference.lora_shrink_slices(x, a_slices, slots)


def lora_expand_slices(
    y: torch.Tensor,
    b_slices: Sequence[torch.Tensor],
    slots: torch.Tensor,
    out: torch.Tensor,
    offsets: Sequence[int],
) -> None:
    """lora_expand of each slice's y [n_slices, T, R] by its B at its offset, in one launch."""
    if y.is_cuda and triton_available():
        from kvfleet.kernels import lora

        lora.lora_expand_slices(y, b_slices, slots, out, offsets)
    else:
        reference.lora_expand_slices(y, b_slices, slots, out, offsets)
