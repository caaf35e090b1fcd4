"""Tensor-parallel rank and size, and the process group that joins the ranks of one engine.
With torch.distributed uninitialised the engine is one rank."""

from __future__ import annotations

import datetime

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


def broadcast_from_rank0(x: torch.Tensor) -> torch.Tensor:
    """Rank 0's x in every rank's x (in place; every rank passes a tensor of its shape)."""
    if tp_size() > 1:
        dist.broadcast(x, src=0)
    return x


def all_reduce_min(value: int, device: torch.device) -> int:
    if tp_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank r drives GPU r of those visible to the pod."""
    return torch.device("cuda", rank) if device.type == "cuda" else device


def init_tensor_parallel(rank: int, world_size: int, port: int, device: torch.device) -> None:
    """Join this engine's process group: NCCL between GPUs, gloo on the CPU."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        # Loading a large checkpoint can keep one rank minutes behind the others at the first
        # collective; torch's own default for NCCL.
        timeout=datetime.timedelta(minutes=10),
        device_id=device if device.type == "cuda" else None,
    )
