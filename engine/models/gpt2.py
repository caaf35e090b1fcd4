"""GPT-2 (all sizes): learned positions, pre-LayerNorm blocks with biases, tanh-GELU MLP, tied
LM head. HF stores GPT-2's projections as Conv1D ([in, out]); `checkpoint_tensors` transposes
them and splits c_attn into q/k/v so the fused QKV layer can still shard heads over ranks."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, ClassVar

import torch
from torch import nn

from kvfleet.engine.distributed import tp_size
from kvfleet.engine.layers.activation import get_activation
from kvfleet.engine.layers.attention import Attention
from kvfleet.engine.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from kvfleet.engine.layers.layernorm import LayerNorm
from kvfleet.engine.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear

_PREFIX = "transformer."
# Conv1D weights, stored [in, out] where nn.Linear wants [out, in].
_CONV1D_WEIGHTS = (
    ".attn.c_attn.weight",
    ".attn.c_proj.weight",
    ".mlp.c_fc.weight",
    ".mlp.c_proj.weight",
)
# Causal-mask buffers that older transformers versions saved with the weights.
_MASK_BUFFERS = (".attn.bias", ".attn.masked_bias")


def check_gpt2_config(config: Any) -> None:
    """Refuse the GPT-2 variants this implementation does not compute."""
    if getattr(config, "add_cross_attention", False):
        raise ValueError("GPT-2 with add_cross_attention (encoder-decoder) is not supported")
    if config.hidden_size % config.num_attention_heads:
        raise ValueError(
            f"n_embd {config.hidden_size} is not divisible by n_head {config.num_attention_heads}"
        )
    if config.num_attention_heads % tp_size():
        raise ValueError("attention heads must divide evenly over tensor-parallel ranks")
    get_activation(config.activation_function)


def attention_scale(config: Any, layer_idx: int) -> float:
    head_dim = config.hidden_size // config.num_attention_heads
    scale = head_dim**-0.5 if getattr(config, "scale_attn_weights", True) else 1.0
    if getattr(config, "scale_attn_by_inverse_layer_idx", False):
        scale /= float(layer_idx + 1)
    return scale


class GPT2Attention(nn.Module):
    def __init__(self, config: Any, layer_idx: int) -> None:
        super().__init__()
        hidden = config.hidden_size
        num_heads = config.num_attention_heads
        self.head_dim = hidden // num_heads
        self.qkv_proj = QKVParallelLinear(hidden, self.head_dim, num_heads, num_heads, bias=True)
        self.c_proj = RowParallelLinear(hidden, hidden, bias=True)
        self.num_heads = self.qkv_proj.num_heads
        self.size = self.num_heads * self.head_dim
        # reorder_and_upcast_attn only moves HF's score computation to fp32, which the attention
        # backends always use, so it needs nothing here.
        self.attn = Attention(
            self.num_heads, self.num_heads, self.head_dim, scale=attention_scale(config, layer_idx)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split(self.size, dim=-1)
        shape = (-1, self.num_heads, self.head_dim)
        o = self.attn(q.reshape(shape), k.reshape(shape), v.reshape(shape))
        return self.c_proj(o.reshape(-1, self.size))


class GPT2MLP(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        inner = getattr(config, "n_inner", None) or 4 * config.hidden_size
        self.c_fc = ColumnParallelLinear(config.hidden_size, inner, bias=True)
        self.c_proj = RowParallelLinear(inner, config.hidden_size, bias=True)
        self.act = get_activation(config.activation_function)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class GPT2Block(nn.Module):
    def __init__(self, config: Any, layer_idx: int) -> None:
        super().__init__()
        eps = config.layer_norm_epsilon
        self.ln_1 = LayerNorm(config.hidden_size, eps)
        self.attn = GPT2Attention(config, layer_idx)
        self.ln_2 = LayerNorm(config.hidden_size, eps)
        self.mlp = GPT2MLP(config)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, x = x, self.ln_1(x)
        else:
            x, residual = self.ln_1(x, residual)
        x = self.attn(x)
        x, residual = self.ln_2(x, residual)
        assert residual is not None  # a norm given the residual returns the new one
        return self.mlp(x), residual


class GPT2Model(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.wte = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        # Replicated on every rank: positions are few and the lookup is cheap.
        self.wpe = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.wpe.weight.requires_grad_(False)
        self.h = nn.ModuleList(GPT2Block(config, i) for i in range(config.num_hidden_layers))
        self.ln_f = LayerNorm(config.hidden_size, config.layer_norm_epsilon)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.wte(input_ids) + self.wpe(positions)
        residual = None
        for block in self.h:
            x, residual = block(x, residual)
        x, _ = self.ln_f(x, residual)
        return x


class GPT2LMHeadModel(nn.Module):
    # c_attn is split into these names by checkpoint_tensors.
    packed_modules: ClassVar[dict[str, tuple[str, str]]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
    }

    def __init__(self, config: Any, arch: str = "GPT2LMHeadModel") -> None:
        super().__init__()
        check_gpt2_config(config)
        self.config = config
        self.transformer = GPT2Model(config)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.transformer.wte.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.transformer(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)

    def attention_layers(self) -> list[Attention]:
        return [m for m in self.transformer.modules() if isinstance(m, Attention)]

    def checkpoint_tensors(
        self, tensors: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """HF GPT-2 names and layouts -> this module's: `transformer.` prefix added where the
        checkpoint lacks it (the original OpenAI exports), Conv1D weights transposed, c_attn
        split into q/k/v, saved attention-mask buffers dropped."""
        for name, tensor in tensors:
            if name.endswith(_MASK_BUFFERS):
                continue
            if not name.startswith((_PREFIX, "lm_head.")):
                name = _PREFIX + name
            if name.endswith(_CONV1D_WEIGHTS):
                tensor = tensor.t()
            if ".attn.c_attn." not in name:
                yield name, tensor
                continue
            q, k, v = tensor.chunk(3, dim=0)
            for piece, part in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
                yield name.replace(".c_attn.", f".{piece}."), part
