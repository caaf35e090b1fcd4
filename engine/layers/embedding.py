"""Token embedding and LM head split across tensor-parallel ranks by vocabulary rows."""

from __future__ import annotations

import torch
from torch import nn

from kvfleet.engine.distributed import all_reduce, tp_rank, tp_size
from kvfleet.engine.layers.linear import set_load_attrs


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        size = tp_size()
        self.vocab_size = vocab_size
        self.per_rank = -(-vocab_size // size)
        self.start = tp_rank() * self.per_rank
        self.weight = nn.Parameter(torch.empty(self.per_rank, hidden_size), requires_grad=False)
        set_load_attrs(
            self.weight,
            weight_loader=self.weight_loader,
            checkpoint_shapes={None: (vocab_size, hidden_size)},
        )

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: str | None = None):
        part = loaded[self.start : self.start + self.per_rank]
        if part.shape[1] != param.shape[1] or part.shape[0] > param.shape[0]:
            raise ValueError(f"embedding: checkpoint shape {tuple(loaded.shape)} does not fit")
        param.data.zero_()
        param.data[: part.shape[0]].copy_(part)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if tp_size() == 1:
            return nn.functional.embedding(input_ids, self.weight)
        local = input_ids - self.start
        mine = (local >= 0) & (local < self.per_rank)
        out = nn.functional.embedding(local.clamp(0, self.per_rank - 1), self.weight)
        out = out * mine.unsqueeze(-1).to(out.dtype)
        return all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = nn.functional.linear(hidden, self.weight)
        if tp_size() > 1:
            parts = [torch.empty_like(logits) for _ in range(tp_size())]
            torch.distributed.all_gather(parts, logits)
            logits = torch.cat(parts, dim=-1)
        return logits[..., : self.vocab_size]
