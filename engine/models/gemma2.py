"""Gemma 2: Llama-like attention and GeGLU MLP, but with zero-centred RMSNorms before and after
both attention and MLP, an embedding scaled by sqrt(hidden_size), query_pre_attn_scalar as the
attention scale, soft-capped attention scores and final logits, and alternating sliding-window
and global layers."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kvfleet.engine.layers.activation import GatedActivation
from kvfleet.engine.layers.attention import Attention
from kvfleet.engine.layers.embedding import VocabParallelEmbedding
from kvfleet.engine.layers.layernorm import GemmaRMSNorm
from kvfleet.engine.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from kvfleet.engine.layers.rotary import RotaryEmbedding
from kvfleet.engine.models.causal_lm import CausalLM, DecoderModel
from kvfleet.engine.models.llama import rope_parameters


def gemma2_sliding_window(config: Any, layer_idx: int) -> int | None:
    """transformers >= 4.53 lists `layer_types`; before that even layers slid and odd ones were
    global."""
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    layer_types = getattr(config, "layer_types", None)
    sliding = layer_types[layer_idx] == "sliding_attention" if layer_types else layer_idx % 2 == 0
    return int(window) if sliding else None


def _head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class Gemma2Attention(nn.Module):
    def __init__(self, config: Any, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        hidden = config.hidden_size
        num_heads = config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        head_dim = _head_dim(config)
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(hidden, head_dim, num_heads, num_kv_heads, bias)
        self.o_proj = RowParallelLinear(num_heads * head_dim, hidden, bias)
        self.q_size, self.kv_size, _ = self.qkv_proj.output_sizes
        self.head_dim = head_dim
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.rotary = rotary
        self.attn = Attention(
            self.num_heads,
            self.num_kv_heads,
            head_dim,
            scale=config.query_pre_attn_scalar**-0.5,
            sliding_window=gemma2_sliding_window(config, layer_idx),
            logits_soft_cap=getattr(config, "attn_logit_softcapping", None),
        )

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(positions, q, k)
        o = self.attn(q, k, v)
        return self.o_proj(o.reshape(-1, self.num_heads * self.head_dim))


class Gemma2MLP(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        inter = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [inter, inter])
        self.down_proj = RowParallelLinear(inter, config.hidden_size)
        self.act = GatedActivation(config.hidden_activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class Gemma2DecoderLayer(nn.Module):
    def __init__(self, config: Any, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Gemma2Attention(config, layer_idx, rotary)
        self.mlp = Gemma2MLP(config)
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Takes and returns the residual stream split as (branch output, stream before it):
        the post-norms apply to the branch alone, so the add is fused into the next pre-norm."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.post_attention_layernorm(self.self_attn(positions, x))
        x, residual = self.pre_feedforward_layernorm(x, residual)
        assert residual is not None  # a norm given the residual returns the new one
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class Gemma2Model(DecoderModel):
    def __init__(self, config: Any) -> None:
        super().__init__()
        # HF rounds sqrt(hidden_size) to the activation dtype before the multiply; rounded once
        # here, as a Python float, so the forward pass (and a CUDA graph of it) makes no tensor.
        dtype = torch.get_default_dtype()
        self.normalizer = torch.tensor(config.hidden_size**0.5, dtype=dtype, device="cpu").item()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        rotary = RotaryEmbedding(
            _head_dim(config), config.max_position_embeddings, rope_parameters(config)
        )
        self.layers = nn.ModuleList(
            Gemma2DecoderLayer(config, i, rotary) for i in range(config.num_hidden_layers)
        )
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids) * self.normalizer
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual)
        x, _ = self.norm(x, residual)
        return x


class Gemma2ForCausalLM(CausalLM):
    def __init__(self, config: Any, arch: str = "Gemma2ForCausalLM") -> None:
        super().__init__(
            config,
            Gemma2Model(config),
            tie_by_default=True,
            final_logit_soft_cap=getattr(config, "final_logit_softcapping", None),
        )
