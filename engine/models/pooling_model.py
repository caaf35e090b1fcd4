"""An embedding model: a decoder body run for its final hidden states (after its final norm),
which the runner pools; no LM head. Built from the family's causal LM, whose body (under the
same name, so parameter names, LoRA targets and expert shards are the causal LM's) and
checkpoint placement it keeps, its head dropped.

Embedding checkpoints come in two layouts: a causal LM's (`model.layers.0...`, perhaps with an
`lm_head`) and a bare body's, as Qwen3-Embedding saves them (`layers.0...`, `norm.weight`; GPT-2's
`h.0...`). Both load: a bare name is placed under the body's name, and an LM head is never
read."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from kvfleet.engine.layers.attention import Attention
from kvfleet.engine.models.causal_lm import CausalLM
from kvfleet.engine.models.gpt2 import GPT2LMHeadModel


def _no_skip(name: str) -> bool:
    return False


def _no_shard(name: str) -> tuple[str, str] | None:
    return None


class PoolingModel(nn.Module):
    def __init__(self, causal: CausalLM | GPT2LMHeadModel) -> None:
        super().__init__()
        # Under the causal LM's name for it, so checkpoint names land unchanged.
        self.body_name = "transformer" if isinstance(causal, GPT2LMHeadModel) else "model"
        self.add_module(self.body_name, getattr(causal, self.body_name))
        # The head's memory goes with the causal LM; only its checkpoint-placement methods,
        # which read the body and the config, are kept.
        del causal.lm_head
        self.packed_modules = causal.packed_modules
        # The embedding matrix is the body's own; a head tied to it owns nothing more.
        self.tie_word_embeddings = False
        self._place = causal.checkpoint_tensors
        self._shard: Callable[[str], tuple[str, str] | None]
        self._shard = getattr(causal, "checkpoint_shard", _no_shard)
        self._skip: Callable[[str], bool] = getattr(causal, "checkpoint_skip", _no_skip)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return getattr(self, self.body_name)(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # Admission refuses sampling requests on a pooling engine: nothing asks for logits.
        raise TypeError("an embedding model has no LM head: it computes no logits")

    def attention_layers(self) -> list[Attention]:
        return [m for m in self.modules() if isinstance(m, Attention)]

    def checkpoint_tensors(
        self, tensors: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterable[tuple[str, torch.Tensor]]:
        prefix = f"{self.body_name}."
        return self._place((n if n.startswith(prefix) else prefix + n, t) for n, t in tensors)

    def checkpoint_shard(self, name: str) -> tuple[str, str] | None:
        return self._shard(name)

    def checkpoint_skip(self, name: str) -> bool:
        return name.startswith("lm_head.") or self._skip(name)
