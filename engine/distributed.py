"""Tensor-parallel rank and size. With torch.distributed uninitialised the engine is one rank."""

from __future__ import annotations

import torch
import torch.distributed as dist


def tp_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def tp_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    if tp_size() > 1:
        dist.all_reduce(x)
    return x
