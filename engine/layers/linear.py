"""Linear layers that know how they are split across tensor-parallel ranks and how to load their
shard of a checkpoint tensor (including q/k/v and gate/up fused into one matrix). Built inside
`fp8_linear_layers(config)`, a layer holds fp8 weights with per-output-channel scales
(kvfleet.engine.layers.fp8) and loads either fp8 tensors and their scales or higher-precision
tensors that it quantizes, shard by shard, as they arrive."""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from kvfleet.engine.distributed import all_reduce, tp_rank, tp_size
from kvfleet.engine.layers.fp8 import (
    FP8,
    check_fp8_shape,
    current_fp8,
    fp8_linear,
    quantize_rows,
)


class LinearAdapters(Protocol):
    """What a layer calls on its LoRA slots (kvfleet.engine.layers.lora.LinearLoRA)."""

    def add(self, x: torch.Tensor, out: torch.Tensor) -> None: ...


def _check_shape(param: torch.Tensor, loaded: torch.Tensor, what: str) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"{what}: checkpoint shape {tuple(loaded.shape)} != {tuple(param.shape)}")


# Per shard name (None: the tensor is not fused), the whole checkpoint tensor's shape.
CheckpointShapes = dict[str | None, tuple[int, ...]]


def set_load_attrs(param: nn.Parameter, **attrs: object) -> None:
    """Tags that tell the model loader how to fill `param` (it reads them with getattr):
    torch's Parameter declares no such attributes."""
    for name, value in attrs.items():
        setattr(param, name, value)


def _param(shape: tuple[int, ...], dtype: torch.dtype | None, loader) -> nn.Parameter:
    param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    set_load_attrs(param, weight_loader=loader)
    return param


class _Linear(nn.Module):
    """``checkpoint_shapes`` on each parameter: the whole (unsharded) checkpoint tensor that
    ``weight_loader`` takes for each shard, so dummy weights can be generated whole and split
    exactly as a checkpoint would be, and every tensor-parallel size sees the same model.

    With fp8 weights, ``weight_scale`` (fp32, one per output row) is either loaded from the
    checkpoint or filled when a higher-precision weight is quantized (``quantizes_into`` on the
    weight names it); ``input_scale`` (fp32 scalar) exists when the checkpoint has static
    activation scales."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        full_shapes: CheckpointShapes,
    ) -> None:
        super().__init__()
        fp8 = current_fp8()
        self.fp8 = fp8 is not None
        self.weight = _param((out_features, in_features), FP8 if fp8 else None, self.weight_loader)
        set_load_attrs(self.weight, checkpoint_shapes=full_shapes)
        if bias:
            self.bias = _param((out_features,), None, self.weight_loader)
            set_load_attrs(self.bias, checkpoint_shapes={k: v[:1] for k, v in full_shapes.items()})
        else:
            self.register_parameter("bias", None)
        self.input_scale: nn.Parameter | None = None
        # The adapters' slots, when the engine serves LoRA (layers.lora.attach_lora).
        self.lora: LinearAdapters | None = None
        if fp8 is None:
            return
        check_fp8_shape(out_features, in_features, type(self).__name__)
        # Generated and read in the model dtype; stored as fp8.
        set_load_attrs(
            self.weight, checkpoint_dtype=torch.get_default_dtype(), quantizes_into="weight_scale"
        )
        self.weight_scale = _param((out_features,), torch.float32, self.weight_loader)
        set_load_attrs(self.weight_scale, quantized_at_load=True)
        if fp8.static_activations:
            # Fused shards share one input: the largest of their scales covers them all.
            self.input_scale = _param((), torch.float32, self.weight_loader)
            self.input_scale.data.zero_()

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: str | None = None):
        raise NotImplementedError

    def _load_scale(self, param: nn.Parameter, loaded: torch.Tensor) -> bool:
        """Loads an input_scale (True), or says the tensor is for another parameter (False)."""
        if param is not self.input_scale:
            return False
        if loaded.numel() != 1:
            raise ValueError(
                f"{type(self).__name__}: input_scale of shape {tuple(loaded.shape)}; static "
                "fp8 activation scales are per tensor"
            )
        param.data.copy_(torch.maximum(param.data, loaded.reshape(()).to(param.device)))
        return True

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.fp8:
            return fp8_linear(x, self.weight, self.weight_scale, self.input_scale, bias)
        return nn.functional.linear(x, self.weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._matmul(x, self.bias)
        if self.lora is not None:
            self.lora.add(x, y)
        return y


class ColumnParallelLinear(_Linear):
    """Output features split across ranks; each rank's output is its own slice. Subclasses that
    stack several matrices say where each shard's rows go (`_shard_rows`); one loader serves
    them all."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        full_shapes: CheckpointShapes | None = None,
    ) -> None:
        size = tp_size()
        if out_features % size:
            raise ValueError(f"{out_features} output features do not split over {size} ranks")
        full = full_shapes or {None: (out_features, in_features)}
        super().__init__(in_features, out_features // size, bias, full)

    def _shard_rows(self, shard: str | None) -> tuple[int, int, int, str]:
        """(first row of the shard in the parameter, its rows on this rank, which slice of
        that many rows of the checkpoint tensor this rank takes, a name for errors)."""
        n = self.weight.shape[0]
        return 0, n, tp_rank(), type(self).__name__

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: str | None = None):
        if self._load_scale(param, loaded):
            return
        offset, n, index, what = self._shard_rows(shard)
        if param is getattr(self, "weight_scale", None):
            # Per tensor (a scalar) becomes the same scale on every row of the shard; per
            # channel comes as [out] or [out, 1].
            loaded = loaded.reshape(-1)
            part = loaded.expand(n) if loaded.numel() == 1 else loaded.narrow(0, index * n, n)
        else:
            part = loaded.narrow(0, index * n, n)
        dest = param.data.narrow(0, offset, n)
        if param is self.weight and self.fp8 and part.dtype != FP8:
            part, scale = quantize_rows(part.to(dest.device))
            self.weight_scale.data.narrow(0, offset, n).copy_(scale)
        _check_shape(dest, part, what)
        dest.copy_(part)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel matrices stacked (gate and up); shards are named by index."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False) -> None:
        self.out_sizes = out_sizes
        full: CheckpointShapes = {str(i): (n, in_features) for i, n in enumerate(out_sizes)}
        super().__init__(in_features, sum(out_sizes), bias, full)

    def _shard_rows(self, shard: str | None) -> tuple[int, int, int, str]:
        index = int(shard)  # type: ignore[arg-type]
        size = tp_size()
        offset = sum(self.out_sizes[:index]) // size
        return offset, self.out_sizes[index] // size, tp_rank(), f"{type(self).__name__}[{index}]"


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections as one matmul; heads split across ranks (KV heads replicated when
    there are fewer of them than ranks)."""

    def __init__(
        self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool
    ) -> None:
        size = tp_size()
        if num_heads % size:
            raise ValueError(f"{num_heads} attention heads do not split over {size} ranks")
        self.head_dim = head_dim
        self.num_heads = num_heads // size
        self.num_kv_heads = max(1, num_kv_heads // size)
        self._kv_replicas = max(1, size // num_kv_heads)
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim * size
        q, kv = (num_heads * head_dim, hidden_size), (num_kv_heads * head_dim, hidden_size)
        super().__init__(hidden_size, out, bias, {"q": q, "k": kv, "v": kv})

    @property
    def output_sizes(self) -> tuple[int, int, int]:
        d = self.head_dim
        return self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d

    def _shard_rows(self, shard: str | None) -> tuple[int, int, int, str]:
        q, k, _ = self.output_sizes
        offset, n = {"q": (0, q), "k": (q, k), "v": (q + k, k)}[shard]  # type: ignore[index]
        rank = tp_rank() if shard == "q" else tp_rank() // self._kv_replicas
        return offset, n, rank, f"{type(self).__name__}[{shard}]"


class RowParallelLinear(_Linear):
    """Input features split across ranks; partial outputs summed with an all-reduce."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        size = tp_size()
        if in_features % size:
            raise ValueError(f"{in_features} input features do not split over {size} ranks")
        full: CheckpointShapes = {None: (out_features, in_features)}
        super().__init__(in_features // size, out_features, bias, full)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: str | None = None):
        if self._load_scale(param, loaded):
            return
        if param is getattr(self, "weight_scale", None):
            loaded = loaded.reshape(-1)
            loaded = loaded.expand(param.shape[0]) if loaded.numel() == 1 else loaded
        elif param is self.weight:
            n = param.shape[1]
            part = loaded.narrow(1, tp_rank() * n, n)
            if self.fp8 and loaded.dtype != FP8:
                # A row's scale comes from the whole row, not this rank's columns of it: every
                # rank scales it alike, and the split model holds the weights one rank would.
                amax = loaded.to(param.device).abs().amax(dim=1)
                part, scale = quantize_rows(part.to(param.device), amax)
                self.weight_scale.data.copy_(scale)
            loaded = part
        _check_shape(param, loaded, type(self).__name__)
        param.data.copy_(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The bias is added once, after the sum, not once per rank; so is each rank's share of
        # the adapters' product.
        y = self._matmul(x, None)
        if self.lora is not None:
            self.lora.add(x, y)
        y = all_reduce(y)
        return y if self.bias is None else y + self.bias
