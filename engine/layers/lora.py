"""LoRA on the linear layers: each targeted layer holds max_loras slots of A and B (ranks below
max_lora_rank zero-padded, the scaling already in B) and adds, for each token, its adapter's
B @ A @ x to the base output. Which slot a token uses is the batch's token -> slot map (-1: the
base model), set once per step as the attention metadata is (`lora_context`); the slot tensors
never change shape, so a CUDA graph captures the whole pass with the map as one of its inputs.

Tensor parallelism splits an adapter as its layer's weight is split: a column-parallel layer
keeps the whole A and its rows of B; a row-parallel one its columns of A and the whole B, its
partial product added to the partial output that the base's all-reduce sums."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from kvfleet.engine.distributed import tp_rank
from kvfleet.engine.layers.batched_lora import add_lora_slices
from kvfleet.engine.lora_adapter import TARGET_MODULES, LoRAAdapter, TargetShape

_slots: torch.Tensor | None = None


@contextmanager
def lora_context(token_slots: torch.Tensor | None) -> Iterator[None]:
    """The step's token -> slot map (int32 [tokens], -1 for the base model) for every LoRA
    layer of the forward pass run inside; None: no token uses an adapter."""
    global _slots
    prev, _slots = _slots, token_slots
    try:
        yield
    finally:
        _slots = prev


@dataclass(frozen=True)
class LoRALayers:
    """What attach_lora gave the model: the projections an adapter may target, by checkpoint
    module name, with their whole shapes; the layers' slots."""

    targets: dict[str, TargetShape]
    layers: list[LinearLoRA]


@dataclass(frozen=True)
class LoRASlice:
    """One projection inside a layer's output (q, k, v of a fused qkv; gate, up): its name in the
    checkpoint, the rows it takes in this rank's output, and which block of its whole B rows
    this rank holds (column-parallel; the whole B for a row-parallel layer)."""

    module: str
    offset: int
    rows: int
    shard_index: int
    shape: TargetShape


class LinearLoRA(nn.Module):
    """The slots of one linear layer: A of every slice stacked [slots, slices * rank, in], B
    per slice [slots, rows, rank]; one shrink and one expand launch for all the slices."""

    def __init__(
        self,
        slices: list[LoRASlice],
        in_features: int,
        row_parallel: bool,
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.slices = slices
        self.row_parallel = row_parallel
        self.max_rank = max_rank
        size = len(slices) * max_rank
        # Plain tensors, not buffers: no checkpoint or state dict holds them.
        self.a = torch.zeros(max_loras, size, in_features, dtype=dtype, device=device)
        # Each slice's A: a view of the stacked buffer, which load() fills.
        self.a_slices = [self.a[:, i * max_rank : (i + 1) * max_rank] for i in range(len(slices))]
        self.b = [
            torch.zeros(max_loras, s.rows, max_rank, dtype=dtype, device=device) for s in slices
        ]
        self.offsets = [s.offset for s in slices]

    def add(self, x: torch.Tensor, out: torch.Tensor) -> None:
        slots = _slots
        if slots is None:
            return
        x2 = x.reshape(-1, x.shape[-1])
        out2 = out.view(-1, out.shape[-1])
        add_lora_slices(x2, self.a_slices, self.b, slots, out2, self.offsets)

    def load(self, slot: int, adapter: LoRAAdapter | None) -> None:
        """Fill one slot with this rank's part of the adapter's A and B for this layer (zeros
        where the adapter leaves a slice out); None empties it."""
        r = self.max_rank
        self.a[slot].zero_()
        for i, (s, b) in enumerate(zip(self.slices, self.b, strict=True)):
            b[slot].zero_()
            pair = None if adapter is None else adapter.weights.get(s.module)
            if pair is None:
                continue
            a_full, b_full = pair
            rank = a_full.shape[0]
            if self.row_parallel:
                k = self.a.shape[2]
                a_part = a_full.narrow(1, tp_rank() * k, k)
                b_part = b_full
            else:
                a_part = a_full
                b_part = b_full.narrow(0, s.shard_index * s.rows, s.rows)
            self.a[slot, i * r : i * r + rank].copy_(a_part)
            b[slot, :, :rank].copy_(b_part)


def attach_lora(
    model: nn.Module, max_loras: int, max_rank: int, dtype: torch.dtype, device: torch.device
) -> LoRALayers:
    """Give every linear layer of the attention and MLP projections (q, k, v, o, gate, up,
    down, fused or not) its LoRA slots. An fp8 layer that gets slots takes its input
    unquantized (its producer's fused quantization is turned off): LoRA reads it too."""
    from kvfleet.engine.layers.activation import GatedActivation
    from kvfleet.engine.layers.layernorm import RMSNorm
    from kvfleet.engine.layers.linear import ColumnParallelLinear, RowParallelLinear, _Linear

    packed: dict[str, tuple[str, str]] = getattr(model, "packed_modules", {})
    targets: dict[str, TargetShape] = {}
    layers: list[LinearLoRA] = []
    with_lora: set[int] = set()
    for name, layer in model.named_modules():
        if not isinstance(layer, _Linear):
            continue
        prefix, _, leaf = name.rpartition(".")
        pieces = [(p, shard) for p, (fused, shard) in packed.items() if fused == leaf]
        if not pieces and leaf in TARGET_MODULES:
            pieces = [(leaf, None)]
        pieces = [(p, shard) for p, shard in pieces if p in TARGET_MODULES]
        if not pieces:
            continue
        shapes = vars(layer.weight)["checkpoint_shapes"]  # set by the layer (set_load_attrs)
        row_parallel = isinstance(layer, RowParallelLinear)
        slices = []
        for piece, shard in pieces:
            out_full, in_full = shapes[shard]
            module = f"{prefix}.{piece}"
            shape = TargetShape(out_full, in_full)
            targets[module] = shape
            if isinstance(layer, ColumnParallelLinear):
                offset, rows, index, _ = layer._shard_rows(shard)
            else:
                offset, rows, index = 0, out_full, 0
            slices.append(LoRASlice(module, offset, rows, index, shape))
        lora = LinearLoRA(
            slices, layer.weight.shape[1], row_parallel, max_loras, max_rank, dtype, device
        )
        layer.lora = lora
        layers.append(lora)
        with_lora.add(id(layer))
    for module in model.modules():
        if isinstance(module, RMSNorm | GatedActivation):
            fp8 = module.fp8_output
            if fp8 is not None and id(fp8.consumer) in with_lora:
                module.fp8_output = None
    return LoRALayers(targets, layers)


def load_slot(layers: LoRALayers, slot: int, adapter: LoRAAdapter | None) -> None:
    """The adapter's weights into one slot of every LoRA layer (None: the slot emptied)."""
    for layer in layers.layers:
        layer.load(slot, adapter)
