"""Batched LoRA for the engine's layers: each token's adapter over a batch that mixes adapters and
the base model (slots[t] is token t's GPU slot, -1 for the base model). On CUDA with Triton the
kernels of kvfleet.kernels.lora, elsewhere their PyTorch twins; both keep every shape fixed by
the token count and read nothing on the host, so a CUDA graph captures either.

On CUDA the shrink (x @ A, a few latency-bound microseconds) runs on a side stream while the
layer's base GEMM (bandwidth-bound, tens of microseconds at decode sizes) runs on the current
one; the expand, which adds into the GEMM's output, follows both. A CUDA graph captures the two
streams as a fork and a join."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

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


@functools.cache
def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The device's stream for LoRA shrinks, one for every layer and step. High priority: when
    both are queued, the GPU schedules the shrink's few programs before the rest of the GEMM's
    (eager launches; a CUDA graph keeps node priorities only where instantiated to)."""
    return torch.cuda.Stream(device, priority=-1)


def with_lora_slices(
    base: Callable[[], torch.Tensor],
    x: torch.Tensor,  # [T, K]
    a_slices: Sequence[torch.Tensor],
    b_slices: Sequence[torch.Tensor],
    slots: torch.Tensor,
    offsets: Sequence[int],
) -> torch.Tensor:
    """base() (a layer's base output, [..., N] with T rows in all) plus add_lora_slices of x
    into it. With the kernels, base()'s launches and the shrink overlap on two streams:

    - the shrink's buffer is allocated on the current stream before the side stream waits for
      it (so does x, written before), and the current stream waits for the side stream before
      the expand reads the buffer. Every later use of the buffer's or x's memory on the current
      stream, after either is freed, is ordered after that join: no record_stream is needed,
      and the side stream allocates nothing.
    - the shrink's PDL wait (`enter`) stays right on the side stream: it waits for whichever
      kernel precedes it there (the last layer's shrink) before reading, and the fork orders it
      after everything queued on the current stream before it, x's writes included."""
    if not (x.is_cuda and triton_available()):
        out = base()
        add_lora_slices(x, a_slices, b_slices, slots, out.view(-1, out.shape[-1]), offsets)
        return out
    from kvfleet.kernels import lora

    main = torch.cuda.current_stream(x.device)
    side = side_stream(x.device)
    shrunk = lora.shrink_buffer(x, a_slices, slots)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        lora.shrink(x, a_slices, slots, shrunk)
    out = base()
    main.wait_stream(side)
    lora.expand(shrunk, b_slices, slots, out.view(-1, out.shape[-1]), offsets)
    return out
