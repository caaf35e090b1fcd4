"""Mixture-of-experts MLP: a router picks each token's top-k experts, each expert is a gated MLP,
and the token's output is the routing-weighted sum of its experts' outputs.

The experts' weights are stacked per layer, ``gate_up_proj`` [experts, 2 * intermediate, hidden]
(gate rows then up rows, as a dense MergedColumnParallelLinear holds them) and ``down_proj``
[experts, hidden, intermediate]: the layout a grouped GEMM reads, one expert's matrix after the
other. Checkpoints store one tensor per expert and projection; the loader places each as a shard
named ``"{expert}.gate"``, ``"{expert}.up"`` or ``"{expert}"`` (down).

Tensor parallelism splits every expert's intermediate dimension, as a dense MLP's: each rank holds
its rows of every gate/up and its columns of every down projection, routes every token alike (the
router is replicated) and the partial outputs are summed across ranks.

``route`` is a pure function: the routing every family shares. The experts run in
``kernels.fused_moe`` on CUDA (Triton) and in its twin ``kernels.reference.fused_experts``
elsewhere."""

from __future__ import annotations

import torch
from torch import nn

from kvfleet.engine.distributed import all_reduce, tp_rank, tp_size
from kvfleet.engine.layers.fp8 import current_fp8
from kvfleet.engine.layers.linear import CheckpointShapes, set_load_attrs
from kvfleet.kernels import reference
from kvfleet.kernels.availability import triton_available

GATE_UP_SHARDS = ("gate", "up")


def route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over the experts (in fp32), the top_k most probable per token, their
    probabilities rescaled to sum to 1 when ``renormalize``. Returns (weights fp32 [tokens,
    top_k], expert ids int64 [tokens, top_k]), most probable first. One kernel on CUDA."""
    if router_logits.is_cuda and triton_available():
        from kvfleet.kernels.expert_routing import route_experts
    else:
        route_experts = reference.route_experts
    return route_experts(router_logits, top_k, renormalize)


class FusedMoE(nn.Module):
    """The experts of one layer, weights stacked (see the module docstring). Loading takes one
    checkpoint tensor per expert and projection (``weight_loader`` with its shard name); the
    loader tags (``checkpoint_shapes``, ``checkpoint_shards``) list them all, so dummy weights
    are generated per expert as a checkpoint holds them and a missing expert is an error."""

    def __init__(
        self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, act: str
    ) -> None:
        super().__init__()
        if current_fp8() is not None:
            raise ValueError("fp8 quantization of mixture-of-experts models is not supported yet")
        size = tp_size()
        if intermediate_size % size:
            raise ValueError(
                f"the experts' intermediate size {intermediate_size} does not split over {size} "
                "tensor-parallel ranks"
            )
        if act not in reference.GATED_ACTIVATIONS:
            known = sorted(reference.GATED_ACTIVATIONS)
            raise ValueError(f"unsupported expert activation {act!r}; known: {known}")
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} with {num_experts} experts")
        self.num_experts = num_experts
        self.top_k = top_k
        # This rank's share of each expert's intermediate dimension.
        self.intermediate_size = intermediate_size // size
        self.activation = act
        inter, hidden, local = intermediate_size, hidden_size, self.intermediate_size
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_experts, 2 * local, hidden), requires_grad=False
        )
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, local), requires_grad=False)
        gate_up_shapes: CheckpointShapes = {
            f"{e}.{part}": (inter, hidden) for e in range(num_experts) for part in GATE_UP_SHARDS
        }
        down_shapes: CheckpointShapes = {str(e): (hidden, inter) for e in range(num_experts)}
        for param, shapes in ((self.gate_up_proj, gate_up_shapes), (self.down_proj, down_shapes)):
            set_load_attrs(
                param,
                weight_loader=self.weight_loader,
                checkpoint_shapes=shapes,
                checkpoint_shards=tuple(shapes),
            )

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: str | None = None):
        """Copies this rank's part of one expert's checkpoint tensor into its slice of the
        stacked parameter."""
        if shard is None:
            raise ValueError(f"{type(self).__name__}: expert weights load one expert at a time")
        expert_str, _, part = shard.partition(".")
        expert = int(expert_str)
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} of a layer with {self.num_experts} experts")
        n = self.intermediate_size
        dest = param.data[expert]
        # gate/up: this rank's rows of the expert's [intermediate, hidden]; down: its columns of
        # [hidden, intermediate].
        axis = 0 if param is self.gate_up_proj else 1
        if axis == 0:
            dest = dest.narrow(0, GATE_UP_SHARDS.index(part) * n, n)
        whole = list(dest.shape)
        whole[axis] *= tp_size()
        if list(loaded.shape) != whole:
            raise ValueError(
                f"expert {shard}: checkpoint shape {tuple(loaded.shape)} != {tuple(whole)}"
            )
        dest.copy_(loaded.narrow(axis, tp_rank() * n, n))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and triton_available():
            # No host synchronisation and shapes fixed per token count: CUDA graphs capture it.
            from kvfleet.kernels.fused_moe import fused_experts
        else:
            fused_experts = reference.fused_experts
        return fused_experts(x, self.gate_up_proj, self.down_proj, weights, ids, self.activation)


class SparseMoeBlock(nn.Module):
    """The MLP of a sparse layer: the router ``gate`` (a plain linear kept in the model dtype,
    never quantized or split: every rank routes every token alike) and the ``experts``."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        intermediate_size: int,
        act: str,
        renormalize: bool,
    ) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.gate.weight.requires_grad_(False)
        self.experts = FusedMoE(num_experts, top_k, hidden_size, intermediate_size, act)
        self.top_k = top_k
        self.renormalize = renormalize

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.top_k, self.renormalize)
        # Each rank's experts hold a slice of the intermediate dimension: partial sums.
        return all_reduce(self.experts(x, weights, ids))
