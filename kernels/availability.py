"""Whether the Triton kernels can run here. (The package: attention, cache and fused elementwise
kernels, each Triton kernel with a pure-PyTorch twin in ``reference`` that is both the CPU path
and the test oracle.)"""

from __future__ import annotations

import functools

import torch


@functools.cache
def triton_available() -> bool:
    """Triton kernels run on CUDA tensors when triton is installed (a GPU dependency only)."""
    if not torch.cuda.is_available():
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
