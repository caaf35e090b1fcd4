"""LoRA on the linear layers: each targeted layer holds max_loras slots of A and B (ranks below
max_lora_rank zero-padded, the scaling already in B) and adds, for each token, its adapter's
B @ A @ x to the base output. Which slot a token uses is the batch's token -> slot map (-1: the
base model), set once per step as the attention metadata is (`lora_context`); the slot tensors
never change shape, so a CUDA graph captures the whole pass with the map as one of its inputs.

Tensor parallelism splits an adapter as its layer's weight is split: a column-parallel layer
keeps the whole A and its rows of B; a row-parallel one its columns of A and the whole B, its
partial product added to the partial output that the base's all-reduce sums.

Every slot of every layer lies in one device buffer [max_loras, slot_numel]: the layers' A and B
are views of it, and a slot's bytes are one adapter's, contiguous. An adapter read into host
memory becomes its slot image (`LoRALayers.image`), those bytes in one (pinned) host tensor, and
a slot load is one copy of it (`LoRALayers.load`). The buffer never moves: CUDA graphs captured
over the views stay valid however often slots are reloaded."""

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
class LoRASlice:
    """One projection inside a layer's output (q, k, v of a fused qkv; gate, up): its name in the
    checkpoint, the rows it takes in this rank's output, and which block of its whole B rows
    this rank holds (column-parallel; the whole B for a row-parallel layer)."""

    module: str
    offset: int
    rows: int
    shard_index: int
    shape: TargetShape


def slot_shapes(slices: list[LoRASlice], in_features: int, max_rank: int) -> list[tuple[int, int]]:
    """A layer's tensors in one slot: A of every slice stacked, then each slice's B."""
    return [(len(slices) * max_rank, in_features), *[(s.rows, max_rank) for s in slices]]


class LinearLoRA(nn.Module):
    """The slots of one linear layer: A of every slice stacked [slots, slices * rank, in], B
    per slice [slots, rows, rank] (`tensors`, as slot_shapes lists them, views of the model's
    slot buffer); one shrink and one expand launch for all the slices."""

    def __init__(
        self,
        slices: list[LoRASlice],
        row_parallel: bool,
        max_rank: int,
        tensors: list[torch.Tensor],
    ) -> None:
        super().__init__()
        self.slices = slices
        self.row_parallel = row_parallel
        self.max_rank = max_rank
        # Plain tensors, not buffers: no checkpoint or state dict holds them.
        self.a, *self.b = tensors
        # Each slice's A: a view of the stacked one.
        r = max_rank
        self.a_slices = [self.a[:, i * r : (i + 1) * r] for i in range(len(slices))]
        self.offsets = [s.offset for s in slices]

    def add(self, x: torch.Tensor, out: torch.Tensor) -> None:
        slots = _slots
        if slots is None:
            return
        x2 = x.reshape(-1, x.shape[-1])
        out2 = out.view(-1, out.shape[-1])
        add_lora_slices(x2, self.a_slices, self.b, slots, out2, self.offsets)

    def fill(self, slot: list[torch.Tensor], adapter: LoRAAdapter) -> None:
        """Write this rank's part of the adapter's A and B for this layer into one slot's
        zeroed tensors (as slot_shapes lists them), leaving zeros where the adapter leaves a slice
        out and past its rank."""
        r = self.max_rank
        a, *bs = slot
        for i, (s, b) in enumerate(zip(self.slices, bs, strict=True)):
            pair = adapter.weights.get(s.module)
            if pair is None:
                continue
            a_full, b_full = pair
            rank = a_full.shape[0]
            if self.row_parallel:
                k = a.shape[1]
                a_part = a_full.narrow(1, tp_rank() * k, k)
                b_part = b_full
            else:
                a_part = a_full
                b_part = b_full.narrow(0, s.shard_index * s.rows, s.rows)
            a[i * r : i * r + rank].copy_(a_part)
            b[:, :rank].copy_(b_part)


# Each tensor of a slot starts on a multiple of this many elements (128 bytes at 16 bits): the
# kernels' pointers keep the alignment their compiled variants assume.
_ALIGN = 64

# Where each of a layer's tensors (slot_shapes) lies in a slot: (offset, shape).
Places = list[tuple[int, tuple[int, int]]]


def _layout(shapes: list[list[tuple[int, int]]]) -> tuple[list[Places], int]:
    """The layers' tensors one after another in a slot, each aligned; the slot's elements."""
    places: list[Places] = []
    numel = 0
    for layer_shapes in shapes:
        mine: Places = []
        for rows, cols in layer_shapes:
            mine.append((numel, (rows, cols)))
            numel += -(-rows * cols // _ALIGN) * _ALIGN
        places.append(mine)
    return places, numel


def _views(flat: torch.Tensor, places: Places) -> list[torch.Tensor]:
    """A layer's tensors in `flat` [slots, slot_numel]: [slots, *shape] each."""
    n = flat.shape[0]
    return [flat[:, o : o + rows * cols].view(n, rows, cols) for o, (rows, cols) in places]


@dataclass(frozen=True)
class LoRALayers:
    """What attach_lora gave the model: the projections an adapter may target, by checkpoint
    module name, with their whole shapes; the layers; the buffer [max_loras, slot_numel] that
    holds every layer's slots, and where each layer's tensors lie in a slot."""

    targets: dict[str, TargetShape]
    layers: list[LinearLoRA]
    buffer: torch.Tensor
    places: list[Places]

    def image(self, adapter: LoRAAdapter) -> torch.Tensor:
        """The bytes one slot holds for the adapter on this rank, every layer's, in one host
        tensor [slot_numel] of the slots' dtype: pinned when the slots are on a GPU, so that
        `load` copies it without the host waiting."""
        buffer = self.buffer
        image = torch.zeros(buffer.shape[1], dtype=buffer.dtype, pin_memory=buffer.is_cuda)
        for layer, places in zip(self.layers, self.places, strict=True):
            layer.fill([v[0] for v in _views(image.view(1, -1), places)], adapter)
        return image

    def load(self, slot: int, image: torch.Tensor | None) -> None:
        """An adapter's image into one slot of every layer (None: the slot emptied): one copy,
        queued on the device's current stream without the host waiting. The image must
        outlive the copy (SlotLoads keeps it)."""
        if image is None:
            self.buffer[slot].zero_()
        else:
            self.buffer[slot].copy_(image, non_blocking=True)


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
    found: list[tuple[_Linear, list[LoRASlice], bool]] = []
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
        found.append((layer, slices, isinstance(layer, RowParallelLinear)))
    places, numel = _layout(
        [slot_shapes(slices, layer.weight.shape[1], max_rank) for layer, slices, _ in found]
    )
    buffer = torch.zeros(max_loras, numel, dtype=dtype, device=device)
    layers: list[LinearLoRA] = []
    for (layer, slices, row_parallel), mine in zip(found, places, strict=True):
        lora = LinearLoRA(slices, row_parallel, max_rank, _views(buffer, mine))
        layer.lora = lora
        layers.append(lora)
    with_lora = {id(layer) for layer, _, _ in found}
    for module in model.modules():
        if isinstance(module, RMSNorm | GatedActivation):
            fp8 = module.fp8_output
            if fp8 is not None and id(fp8.consumer) in with_lora:
                module.fp8_output = None
    return LoRALayers(targets, layers, buffer, places)
