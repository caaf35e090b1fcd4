"""The attention layer: store this step's K/V in the paged cache, then attend via the backend.

With an FP8 KV cache each layer has a K and a V scale (fp32 scalars that live on the device as
buffers, so a captured CUDA graph reads whatever they hold): the checkpoint's, 1.0, or set from
the first batch's K/V (`calculate_kv_scales`). A cache of the model dtype ignores them."""

from __future__ import annotations

import torch
from torch import nn

from kvfleet.engine.attention_backend import AttentionBackend
from kvfleet.engine.attention_metadata import get_attention_metadata
from kvfleet.kernels.reference import FP8_MAX

# Calibrated scales map the first batch's largest |K| or |V| to half of e4m3's range: later
# tokens may run larger, and saturating them costs more than the one bit of resolution given up.
_CALIBRATION_HEADROOM = 2.0
# A layer whose first batch is all zeros still gets a usable (non-zero) scale.
_MIN_SCALE = 1e-6


class Attention(nn.Module):
    k_scale: torch.Tensor  # buffers, registered in __init__
    v_scale: torch.Tensor

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
        self.register_buffer("k_scale", torch.ones((), dtype=torch.float32))
        self.register_buffer("v_scale", torch.ones((), dtype=torch.float32))
        # Set by the ModelRunner: the next forward pass sets the scales from its K/V.
        self.calculate_kv_scales = False
        # Bound by the ModelRunner once the cache is allocated.
        self.kv_cache: torch.Tensor | None = None
        self.backend: AttentionBackend | None = None

    def set_kv_scale(self, which: str, value: torch.Tensor) -> None:
        """A checkpoint's k_scale or v_scale (`which`: "k" or "v"): one positive finite number."""
        if value.numel() != 1 or not (torch.isfinite(value).all() and bool(value.float() > 0)):
            raise ValueError(
                f"a KV-cache {which}_scale must be one positive finite number, got "
                f"{value.flatten()[:4].tolist()} (shape {tuple(value.shape)})"
            )
        getattr(self, f"{which}_scale").copy_(value.reshape(()))

    def _calculate_kv_scales(self, k: torch.Tensor, v: torch.Tensor) -> None:
        for buf, x in ((self.k_scale, k), (self.v_scale, v)):
            amax = x.abs().amax().float()
            buf.copy_((amax * _CALIBRATION_HEADROOM / FP8_MAX).clamp_min(_MIN_SCALE))
        self.calculate_kv_scales = False

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.kv_cache is None or self.backend is None:
            raise RuntimeError("attention ran before the KV cache was bound")
        meta = get_attention_metadata()
        if self.calculate_kv_scales:
            self._calculate_kv_scales(k, v)
        self.backend.write_kv(k, v, self.kv_cache, meta, self.k_scale, self.v_scale)
        return self.backend.attend(
            q,
            self.kv_cache,
            meta,
            self.scale,
            self.sliding_window,
            self.logits_soft_cap,
            self.k_scale,
            self.v_scale,
        )
