"""Programmatic dependent launch (PDL, Hopper and later) for the decode path's small kernels.

A kernel launched with PDL may start while the one before it still runs, once every program of
that one has allowed it (`allow_dependents`) or ended; before it reads anything an earlier
kernel wrote, or writes anything, it must `wait_for_prior`. Only data no kernel writes (weights)
may be read before the wait. At batch 1 a decode step is ~400 launches of a few microseconds,
so each launch's set-up overlapping the kernel before matters; the fp8 GEMMs also use the head
start to pull their weights into L2 (`prefetch_l2`)."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@functools.cache
def pdl_supported(device: torch.device) -> bool:
    """griddepcontrol is sm_90+ PTX; elsewhere (and in the CPU interpreter) kernels launch as
    usual and the PDL branches compile out."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


@triton.jit
def allow_dependents(PDL: tl.constexpr):
    """Lets the next kernel, if launched with PDL, start now: it waits for this one's end
    before touching its outputs, so this is safe anywhere in a kernel."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def wait_for_prior(PDL: tl.constexpr):
    """Returns once the kernel before has finished and its writes are visible, and so, by
    induction, every kernel before that."""
    if PDL:
        gdc_wait()


@triton.jit
def enter(PDL: tl.constexpr):
    """The start of a small kernel launched with `pdl_args`: the next kernel may launch at once
    (it will wait for this one), then this one waits for the one before."""
    allow_dependents(PDL)
    wait_for_prior(PDL)


@triton.jit
def prefetch_l2(ptrs):
    """One L2 prefetch per element's address (a cache line each, 128 bytes): no registers
    held and nothing waited for. Compiled only on the GPU (the interpreter runs no asm)."""
    tl.inline_asm_elementwise(
        "mov.u32 $0, 0;\n\tprefetch.global.L2 [$1];",
        "=r,l",
        [ptrs],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


def pdl_args(device: torch.device) -> dict[str, bool]:
    """A kernel's PDL constexpr and launch keyword (launch_pdl only where PDL is on, so the
    interpreter never sees it)."""
    return {"PDL": True, "launch_pdl": True} if pdl_supported(device) else {"PDL": False}


# One cache line.
LINE = 128


def prefetch_columns(k: int, rows: int, programs: int, budget: int) -> int:
    """Columns of its rows (each `k` one-byte elements) a program prefetches: a power of two of
    whole lines, at most k, with all programs' together at most `budget` bytes; 0 for none."""
    per_row = min(k, budget // max(programs * rows, 1))
    if per_row < LINE:
        return 0
    return LINE * triton.next_power_of_2(per_row // LINE + 1) // 2
