"""An embedding model: a decoder body run for its final hidden states (after its final norm),
which the runner pools; no LM head. Built from the family's causal LM, whose body and weight
placement it keeps, its head dropped.

Embedding checkpoints come in two layouts: a causal LM's (`model.layers.0...`, perhaps with an
`lm_head`) and a bare body's, as Qwen3-Embedding saves them (`layers.0...`, `norm.weight`). Both
load: a bare name is placed under `model.`, and an LM head is skipped."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from kvfleet.engine.layers.attention import Attention
from kvfleet.engine.models.causal_lm import CausalLM, place_kv_scales


class PoolingModel(nn.Module):
    def __init__(self, causal: CausalLM) -> None:
        super().__init__()
        self.model = causal.model
        self.packed_modules = causal.packed_modules
        # The embedding matrix is the body's own; a head tied to it owns nothing more.
        self.tie_word_embeddings = False

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # Admission refuses sampling requests on a pooling engine: nothing asks for logits.
        raise TypeError("an embedding model has no LM head: it computes no logits")

    def attention_layers(self) -> list[Attention]:
        return [m for m in self.model.modules() if isinstance(m, Attention)]

    def checkpoint_tensors(
        self, tensors: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        placed = (
            (name if name.startswith("model.") else f"model.{name}", tensor)
            for name, tensor in tensors
            if not name.startswith("lm_head.")
        )
        return place_kv_scales(placed, self.attention_layers())
