"""The attention layer: store this step's K/V in the paged cache, then attend via the backend."""

from __future__ import annotations

import torch
from torch import nn

from kvfleet.engine.attention_backend import AttentionBackend
from kvfleet.engine.attention_metadata import get_attention_metadata


class Attention(nn.Module):
    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap
        # Bound by the ModelRunner once the cache is allocated.
        self.kv_cache: torch.Tensor | None = None
        self.backend: AttentionBackend | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.kv_cache is None or self.backend is None:
            raise RuntimeError("attention ran before the KV cache was bound")
        meta = get_attention_metadata()
        self.backend.write_kv(k, v, self.kv_cache, meta)
        return self.backend.attend(
            q, self.kv_cache, meta, self.scale, self.sliding_window, self.logits_soft_cap
        )
