"""`@kernel`: triton.jit for a kernel the host launches, typed as it is launched."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import triton


class Kernel(Protocol):
    """`kernel[grid](*args, **options)`: the kernel's arguments (plain Python values for its
    tl.constexpr parameters) and launch options such as num_warps."""

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., object]: ...


def kernel(fn: Callable[..., None]) -> Kernel:
    """triton.jit, for a kernel launched from the host: triton's stubs type `kernel[grid]` as
    the kernel's own signature, which takes no launch options and only tl.constexpr objects
    for its constexpr parameters. (Device functions that kernels call keep triton.jit.)"""
    return triton.jit(fn)
