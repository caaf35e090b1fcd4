"""What the decoder-only models share: a body, an LM head (tied to the embedding or not), the
logits, and the checkpoint's q/k/v and gate/up projections fused into single parameters."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any, ClassVar

import torch
from torch import nn

from kvfleet.engine.layers.attention import Attention
from kvfleet.engine.layers.embedding import ParallelLMHead, VocabParallelEmbedding

# Checkpoint tensor name piece -> (our fused parameter, shard within it).
FUSED_QKV_GATE_UP: dict[str, tuple[str, str]] = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "0"),
    "up_proj": ("gate_up_proj", "1"),
}

# The FP8 KV-cache scales of vLLM-format checkpoints: `model.layers.N.self_attn.k_scale`, in older
# ones under `k_proj.` / `v_proj.` (or `attn.`); a group gives the layer and "k" or "v".
_KV_SCALE = re.compile(r"\.layers\.(\d+)\.self_attn\.(?:[kv]_proj\.|attn\.)?([kv])_scale$")


class DecoderModel(nn.Module):
    """A decoder body: its token embedding, then its layers, each with one Attention."""

    embed_tokens: VocabParallelEmbedding


class CausalLM(nn.Module):
    packed_modules: ClassVar[dict[str, tuple[str, str]]] = FUSED_QKV_GATE_UP

    def __init__(
        self,
        config: Any,
        model: DecoderModel,
        tie_by_default: bool,
        final_logit_soft_cap: float | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.model = model
        self.final_logit_soft_cap = final_logit_soft_cap
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", tie_by_default))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if self.tie_word_embeddings:
            self.lm_head.weight = model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head.compute_logits(hidden)
        cap = self.final_logit_soft_cap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def attention_layers(self) -> list[Attention]:
        return [m for m in self.model.modules() if isinstance(m, Attention)]

    def checkpoint_tensors(
        self, tensors: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        return place_kv_scales(tensors, self.attention_layers())


def place_kv_scales(
    tensors: Iterable[tuple[str, torch.Tensor]], layers: list[Attention]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Hands the checkpoint's KV-cache scales to the attention layers (they are buffers with a
    default, not parameters every checkpoint must fill) and passes the rest on."""
    for name, tensor in tensors:
        match = _KV_SCALE.search(name)
        if match is None:
            yield name, tensor
        else:
            layers[int(match[1])].set_kv_scale(match[2], tensor)
