"""Linear layers that know how they are split across tensor-parallel ranks and how to load their
shard of a checkpoint tensor (including q/k/v and gate/up fused into one matrix)."""

from __future__ import annotations

import torch
from torch import nn

from kvfleet.engine.distributed import all_reduce, tp_rank, tp_size


def _check_shape(param: nn.Parameter, loaded: torch.Tensor, what: str) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"{what}: checkpoint shape {tuple(loaded.shape)} != {tuple(param.shape)}")


class _Linear(nn.Module):
    """``checkpoint_shapes`` on each parameter: the whole (unsharded) checkpoint tensor that
    ``weight_loader`` takes for each shard, so dummy weights can be generated whole and split
    exactly as a checkpoint would be, and every tensor-parallel size sees the same model."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        full_shapes: dict[str | None, tuple[int, int]],
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.weight.checkpoint_shapes = full_shapes
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
            self.bias.checkpoint_shapes = {k: v[:1] for k, v in full_shapes.items()}
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: str | None = None):
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight, self.bias)


class ColumnParallelLinear(_Linear):
    """Output features split across ranks; each rank's output is its own slice."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        full_shapes: dict[str | None, tuple[int, int]] | None = None,
    ) -> None:
        size = tp_size()
        if out_features % size:
            raise ValueError(f"{out_features} output features do not split over {size} ranks")
        full = full_shapes or {None: (out_features, in_features)}
        super().__init__(in_features, out_features // size, bias, full)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: str | None = None):
        n = param.shape[0]
        part = loaded.narrow(0, tp_rank() * n, n)
        _check_shape(param, part, type(self).__name__)
        param.data.copy_(part)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel matrices stacked (gate and up); shards are named by index."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False) -> None:
        self.out_sizes = out_sizes
        full = {str(i): (n, in_features) for i, n in enumerate(out_sizes)}
        super().__init__(in_features, sum(out_sizes), bias, full)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: str | None = None):
        index = int(shard)  # type: ignore[arg-type]
        size = tp_size()
        offset = sum(self.out_sizes[:index]) // size
        n = self.out_sizes[index] // size
        part = loaded.narrow(0, tp_rank() * n, n)
        dest = param.data.narrow(0, offset, n)
        _check_shape(dest, part, f"{type(self).__name__}[{index}]")
        dest.copy_(part)


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

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: str | None = None):
        q, k, _ = self.output_sizes
        offset, n = {"q": (0, q), "k": (q, k), "v": (q + k, k)}[shard]  # type: ignore[index]
        rank = tp_rank() if shard == "q" else tp_rank() // self._kv_replicas
        part = loaded.narrow(0, rank * n, n)
        dest = param.data.narrow(0, offset, n)
        _check_shape(dest, part, f"{type(self).__name__}[{shard}]")
        dest.copy_(part)


class RowParallelLinear(_Linear):
    """Input features split across ranks; partial outputs summed with an all-reduce."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        size = tp_size()
        if in_features % size:
            raise ValueError(f"{in_features} input features do not split over {size} ranks")
        full = {None: (out_features, in_features)}
        super().__init__(in_features // size, out_features, bias, full)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: str | None = None):
        if param.dim() == 2:
            n = param.shape[1]
            loaded = loaded.narrow(1, tp_rank() * n, n)
        _check_shape(param, loaded, type(self).__name__)
        param.data.copy_(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The bias is added once, after the sum, not once per rank.
        y = nn.functional.linear(x, self.weight)
        y = all_reduce(y)
        return y if self.bias is None else y + self.bias
