"""Mixture-of-experts MLP: a router picks each token's top-k experts, each expert is a gated MLP,
and the token's output is the routing-weighted sum of its experts' outputs.

The experts' weights are stacked per layer, ``gate_up_proj`` [experts, 2 * intermediate, hidden]
(gate rows then up rows, as a dense MergedColumnParallelLinear holds them) and ``down_proj``
[experts, hidden, intermediate]: the layout a grouped GEMM reads, one expert's matrix after the
other. Checkpoints store one tensor per expert and projection; the loader places each as a shard
named ``"{expert}.gate"``, ``"{expert}.up"`` or ``"{expert}"`` (down).

Tensor parallelism splits every expert's intermediate dimension, as a dense MLP's: each rank holds
its rows of every gate/up and its columns of every down projection, routes every token alike (the
router is replicated) and the partial outputs are summed across ranks. With expert parallelism
(``expert_parallel_layers``) each rank instead holds a contiguous share of the experts whole,
computes only the (token, expert) pairs routed to them and the same sum adds the shares up;
docs/architecture.md says which serves better where.

``route`` is a pure function: the routing every family shares. The experts run in
``kernels.fused_moe`` on CUDA (Triton) and in its twin ``kernels.reference.fused_experts``
elsewhere; on CUDA at decode sizes the routing also sorts the pairs by expert for them, in the
same launch (``FusedMoE.routed``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from kvfleet.engine.distributed import all_reduce, tp_rank, tp_size
from kvfleet.engine.layers.fp8 import FP8, current_fp8, quantize_rows
from kvfleet.engine.layers.linear import CheckpointShapes, set_load_attrs
from kvfleet.kernels import reference
from kvfleet.kernels.availability import triton_available

GATE_UP_SHARDS = ("gate", "up")

# fp8 experts run W8A8 (activations quantized per row, fp8 tensor cores) from this many tokens a
# call, W8A16 below, where the two quantizing launches W8A8 adds (kernels.fused_moe) may cost
# more than the weight-tile conversions they save. A call's token count is static under a CUDA
# graph, so each captured size runs one mode. A first guess, not yet measured on a GPU:
# bench/moe_kernel.py (gpu_run.sh moe-kernel-w8a8) prints the token counts where W8A8 wins.
W8A8_MIN_TOKENS = 32


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


_expert_parallel = False


@contextlib.contextmanager
def expert_parallel_layers(enabled: bool) -> Iterator[None]:
    """Experts built inside are placed whole on the tensor-parallel ranks, a contiguous share of
    each layer's experts per rank (``--enable-expert-parallel``), rather than every expert's
    intermediate dimension split over the ranks; as fp8_linear_layers decides the linears'
    weights."""
    global _expert_parallel
    previous, _expert_parallel = _expert_parallel, enabled
    try:
        yield
    finally:
        _expert_parallel = previous


def local_experts(num_experts: int) -> range:
    """The experts (global ids) this rank holds: all of them, or with expert parallelism its
    contiguous share."""
    if not _expert_parallel:
        return range(num_experts)
    size = tp_size()
    if num_experts % size:
        raise ValueError(
            f"--enable-expert-parallel: {num_experts} experts do not divide over {size} "
            "tensor-parallel ranks"
        )
    share = num_experts // size
    return range(tp_rank() * share, (tp_rank() + 1) * share)


class FusedMoE(nn.Module):
    """The experts of one layer that this rank holds, weights stacked (see the module
    docstring). Loading takes one checkpoint tensor per expert and projection (``weight_loader``
    with its shard name, global expert ids); the loader tags (``checkpoint_shapes``,
    ``checkpoint_shards``) list this rank's, so dummy weights are generated per expert as a
    checkpoint holds them and a missing expert is an error.

    Built inside ``fp8_linear_layers``, the stacked weights are fp8 with fp32 scales per expert
    and output channel, ``gate_up_scale`` [experts, 2 * intermediate] and ``down_scale``
    [experts, hidden]: loaded from the checkpoint (one per tensor or per channel), or filled as
    higher-precision weights are quantized at load (a down projection's rows scaled over their
    whole width, so every intermediate-split rank scales them alike). Their activations are
    quantized per row (W8A8) from W8A8_MIN_TOKENS tokens a call (a checkpoint's static input scales
    for the experts are not used), and stay in the model dtype below."""

    def __init__(
        self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, act: str
    ) -> None:
        super().__init__()
        if act not in reference.GATED_ACTIVATIONS:
            known = sorted(reference.GATED_ACTIVATIONS)
            raise ValueError(f"unsupported expert activation {act!r}; known: {known}")
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} with {num_experts} experts")
        self.local_experts = local_experts(num_experts)
        # Experts placed per rank are whole; otherwise each rank holds a slice of every one.
        self.splits = 1 if len(self.local_experts) < num_experts else tp_size()
        if intermediate_size % self.splits:
            raise ValueError(
                f"the experts' intermediate size {intermediate_size} does not split over "
                f"{self.splits} tensor-parallel ranks"
            )
        self.num_experts = num_experts
        self.top_k = top_k
        # This rank's share of each expert's intermediate dimension.
        self.intermediate_size = intermediate_size // self.splits
        self.activation = act
        inter, hidden, local = intermediate_size, hidden_size, self.intermediate_size
        fp8 = current_fp8()
        dtype = FP8 if fp8 else None
        n = len(self.local_experts)
        self.gate_up_proj = nn.Parameter(
            torch.empty(n, 2 * local, hidden, dtype=dtype), requires_grad=False
        )
        self.down_proj = nn.Parameter(
            torch.empty(n, hidden, local, dtype=dtype), requires_grad=False
        )
        gate_up_shapes: CheckpointShapes = {
            f"{e}.{part}": (inter, hidden) for e in self.local_experts for part in GATE_UP_SHARDS
        }
        down_shapes: CheckpointShapes = {str(e): (hidden, inter) for e in self.local_experts}
        pairs = ((self.gate_up_proj, gate_up_shapes), (self.down_proj, down_shapes))
        for param, shapes in pairs:
            set_load_attrs(
                param,
                weight_loader=self.weight_loader,
                checkpoint_shapes=shapes,
                checkpoint_shards=tuple(shapes),
            )
        self.gate_up_scale: nn.Parameter | None = None
        self.down_scale: nn.Parameter | None = None
        if fp8 is None:
            return
        self.gate_up_scale = nn.Parameter(
            torch.empty(n, 2 * local, dtype=torch.float32), requires_grad=False
        )
        self.down_scale = nn.Parameter(
            torch.empty(n, hidden, dtype=torch.float32), requires_grad=False
        )
        for (weight, shapes), scale, name in zip(
            pairs,
            (self.gate_up_scale, self.down_scale),
            ("gate_up_scale", "down_scale"),
            strict=True,
        ):
            # Generated and read in the model dtype; stored as fp8.
            set_load_attrs(weight, checkpoint_dtype=torch.get_default_dtype(), quantizes_into=name)
            set_load_attrs(
                scale,
                weight_loader=self.weight_loader,
                checkpoint_shards=tuple(shapes),
                quantized_at_load=True,
            )

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: str | None = None):
        """Copies this rank's part of one expert's checkpoint tensor (a weight, or an fp8
        weight's scales) into its slice of the stacked parameter."""
        if shard is None:
            raise ValueError(f"{type(self).__name__}: expert weights load one expert at a time")
        expert_str, _, part = shard.partition(".")
        expert = int(expert_str)
        held = self.local_experts
        if expert not in held:
            where = "this rank holds" if len(held) < self.num_experts else "a layer of"
            raise ValueError(f"expert {expert}: {where} experts {held.start}..{held.stop - 1}")
        index = expert - held.start
        n = self.intermediate_size
        rank = tp_rank() if self.splits > 1 else 0
        gate_up = param is self.gate_up_proj or param is self.gate_up_scale
        # gate/up: this rank's rows of the expert's [intermediate, hidden]; down: its columns of
        # [hidden, intermediate] (a down projection's scales are per row: whole on every rank).
        rows = GATE_UP_SHARDS.index(part) * n if gate_up else 0
        if param is self.gate_up_scale or param is self.down_scale:
            self._load_scale(param.data[index], loaded, shard, rows, n if gate_up else None, rank)
            return
        dest = param.data[index]
        axis = 0 if gate_up else 1
        if gate_up:
            dest = dest.narrow(0, rows, n)
        whole = list(dest.shape)
        whole[axis] *= self.splits
        if list(loaded.shape) != whole:
            raise ValueError(
                f"expert {shard}: checkpoint shape {tuple(loaded.shape)} != {tuple(whole)}"
            )
        part_of = loaded.narrow(axis, rank * n, n)
        if dest.dtype == FP8 and loaded.dtype != FP8:
            # Quantized at load: a row's scale from the whole row, not this rank's columns.
            amax = None if gate_up else loaded.to(dest.device).abs().amax(dim=1)
            part_of, scale = quantize_rows(part_of.to(dest.device), amax)
            scales = self.gate_up_scale if gate_up else self.down_scale
            assert scales is not None  # built with the fp8 weights
            scales.data[index].narrow(0, rows, scale.numel()).copy_(scale)
        elif loaded.dtype == FP8 and dest.dtype != FP8:
            raise ValueError(
                f"expert {shard}: an fp8 checkpoint tensor for experts of {dest.dtype}"
            )
        dest.copy_(part_of)

    def _load_scale(
        self,
        dest: torch.Tensor,
        loaded: torch.Tensor,
        shard: str,
        rows: int,
        n: int | None,
        rank: int,
    ) -> None:
        """A checkpoint's weight_scale of one expert's projection: a scalar per tensor becomes
        every row's scale; per channel ([rows] or [rows, 1]) this rank's rows of it."""
        whole = dest.shape[0] if n is None else n * self.splits
        flat = loaded.reshape(-1).float()
        if flat.numel() not in (1, whole) or (loaded.dim() == 2 and loaded.shape[1] != 1):
            raise ValueError(
                f"expert {shard}: weight_scale of shape {tuple(loaded.shape)}; expected one "
                f"per tensor or per output channel ({whole})"
            )
        if not bool(torch.isfinite(flat).all()) or bool((flat < 0).any()):
            raise ValueError(f"expert {shard}: weight_scale holds negative or non-finite scales")
        if n is None:
            dest.copy_(flat.expand(whole))
            return
        part = flat.expand(n) if flat.numel() == 1 else flat.narrow(0, rank * n, n)
        dest.narrow(0, rows, n).copy_(part)

    def local_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Global expert ids -> indices into this rank's stacked weights, -1 for the experts of
        other ranks (they add nothing here: their rank adds them)."""
        if len(self.local_experts) == self.num_experts:
            return ids
        local = ids - self.local_experts.start
        return torch.where((local >= 0) & (local < len(self.local_experts)), local, -1)

    def fp8_activations(self, num_tokens: int) -> bool:
        return self.gate_up_scale is not None and num_tokens >= W8A8_MIN_TOKENS

    def routed(
        self, x: torch.Tensor, router_logits: torch.Tensor, renormalize: bool
    ) -> torch.Tensor:
        """``route`` then ``forward``. On CUDA at decode sizes the routing and the alignment of
        the pairs by expert are one launch (kernels.expert_routing.route_and_align) instead of
        route's and align's."""
        if x.is_cuda and triton_available():
            from kvfleet.kernels import expert_routing, fused_moe

            num_tokens = x.shape[0]
            if expert_routing.routes_and_aligns_at_once(num_tokens, self.top_k):
                fp8_activations = self.fp8_activations(num_tokens)
                tile = fused_moe.call_tile(num_tokens, fp8_activations)
                routing = expert_routing.route_and_align(
                    router_logits, self.top_k, renormalize, self.local_experts, tile.block_m
                )
                return fused_moe.fused_experts(
                    x,
                    self.gate_up_proj,
                    self.down_proj,
                    routing.weights,
                    routing.ids,
                    self.activation,
                    self.gate_up_scale,
                    self.down_scale,
                    fp8_activations=fp8_activations,
                    tile=tile,
                    aligned=(routing.sorted_pairs, routing.block_expert),
                )
        weights, ids = route(router_logits, self.top_k, renormalize)
        return self(x, weights, ids)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and triton_available():
            # No host synchronisation and shapes fixed per token count: CUDA graphs capture it.
            from kvfleet.kernels.fused_moe import fused_experts
        else:
            fused_experts = reference.fused_experts
        return fused_experts(
            x,
            self.gate_up_proj,
            self.down_proj,
            weights,
            self.local_ids(ids),
            self.activation,
            self.gate_up_scale,
            self.down_scale,
            fp8_activations=self.fp8_activations(x.shape[0]),
        )


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
        # Each rank's experts hold a slice of every expert's intermediate dimension, or some of
        # the experts whole: partial sums either way.
        return all_reduce(self.experts.routed(x, self.gate(x), self.renormalize))
