"""The Llama decoder family: Llama 2/3.x, Mistral, Qwen2/2.5 (q/k/v bias), Qwen3 (q/k RMSNorm).
One implementation; the architectures differ only in the switches read from their configs. The
mixture-of-experts families built on it (kvfleet.engine.models.mixture_of_experts) swap the MLP
of some layers for a sparse one."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from kvfleet.engine.layers.activation import GatedActivation
from kvfleet.engine.layers.attention import Attention
from kvfleet.engine.layers.embedding import VocabParallelEmbedding
from kvfleet.engine.layers.fp8 import Fp8Input
from kvfleet.engine.layers.layernorm import RMSNorm
from kvfleet.engine.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from kvfleet.engine.layers.rotary import RotaryEmbedding
from kvfleet.engine.models.causal_lm import CausalLM, DecoderModel
from kvfleet.kernels.reference import QKNorm

# Architectures whose attention RMS-normalises each head of q and k before the rotation.
QK_NORM_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")

# Builds the MLP of a layer from the config and the layer's index.
MlpFactory = Callable[[Any, int], nn.Module]


def rope_parameters(config: Any) -> dict[str, Any]:
    """transformers >= 5 keeps rope settings in `rope_parameters`; older configs in
    `rope_theta` + `rope_scaling`."""
    params = getattr(config, "rope_parameters", None)
    if params:
        return dict(params)
    params = dict(getattr(config, "rope_scaling", None) or {})
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return params


def layer_sliding_window(config: Any, layer_idx: int) -> int | None:
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:  # Mistral: every layer slides when a window is set
        return int(window)
    return int(window) if layer_types[layer_idx] == "sliding_attention" else None


class LlamaAttention(nn.Module):
    def __init__(self, config: Any, layer_idx: int, arch: str, rotary: RotaryEmbedding) -> None:
        super().__init__()
        hidden = config.hidden_size
        num_heads = config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        head_dim = getattr(config, "head_dim", None) or hidden // num_heads
        bias = bool(getattr(config, "attention_bias", False))
        qkv_bias = bias or arch == "Qwen2ForCausalLM"
        self.qkv_proj = QKVParallelLinear(hidden, head_dim, num_heads, num_kv_heads, qkv_bias)
        self.o_proj = RowParallelLinear(num_heads * head_dim, hidden, bias)
        self.q_size, self.kv_size, _ = self.qkv_proj.output_sizes
        self.head_dim = head_dim
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.qk_norm = arch in QK_NORM_ARCHITECTURES
        if self.qk_norm:
            self.q_norm = RMSNorm(head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(head_dim, config.rms_norm_eps)
        self.rotary = rotary
        self.attn = Attention(
            self.num_heads,
            self.num_kv_heads,
            head_dim,
            scale=head_dim**-0.5,
            sliding_window=layer_sliding_window(config, layer_idx),
        )

    def qk_norm_weights(self) -> QKNorm | None:
        """q_norm and k_norm as the rotary applies them, fused into its launch (the modules
        hold the checkpoint's weights; both have the config's eps)."""
        if not self.qk_norm:
            return None
        return QKNorm(
            self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, self.q_norm.zero_centred
        )

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(positions, q, k, self.qk_norm_weights())
        o = self.attn(q, k, v)
        return self.o_proj(o.reshape(-1, self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        bias = bool(getattr(config, "mlp_bias", False))
        inter = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [inter, inter], bias)
        self.down_proj = RowParallelLinear(inter, config.hidden_size, bias)
        self.act = GatedActivation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


def dense_mlp(config: Any, layer_idx: int) -> nn.Module:
    return LlamaMLP(config)


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        config: Any,
        layer_idx: int,
        arch: str,
        rotary: RotaryEmbedding,
        make_mlp: MlpFactory = dense_mlp,
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx, arch, rotary)
        self.mlp = make_mlp(config, layer_idx)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # With fp8 linears, the layers that feed them quantize their own outputs.
        feeds: list[tuple[Any, Any]] = [(self.input_layernorm, self.self_attn.qkv_proj)]
        if isinstance(self.mlp, LlamaMLP):
            feeds += [
                (self.post_attention_layernorm, self.mlp.gate_up_proj),
                (self.mlp.act, self.mlp.down_proj),
            ]
        for producer, consumer in feeds:
            if consumer.fp8:
                producer.fp8_output = Fp8Input(consumer)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x)
        x, residual = self.post_attention_layernorm(x, residual)
        assert residual is not None  # a norm given the residual returns the new one
        return self.mlp(x), residual


class LlamaModel(DecoderModel):
    def __init__(self, config: Any, arch: str, make_mlp: MlpFactory = dense_mlp) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads
        )
        # One cos/sin table shared by every layer.
        rotary = RotaryEmbedding(head_dim, config.max_position_embeddings, rope_parameters(config))
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, arch, rotary, make_mlp)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual)
        x, _ = self.norm(x, residual)
        return x


class LlamaForCausalLM(CausalLM):
    def __init__(self, config: Any, arch: str = "LlamaForCausalLM") -> None:
        super().__init__(config, LlamaModel(config, arch), tie_by_default=False)
