"""Mixture-of-experts families on the Llama decoder: Mixtral (Mistral's attention, every layer
sparse, top-k renormalised) and Qwen3-MoE (Qwen3's attention with q/k norms; a layer is sparse
unless listed in ``mlp_only_layers`` or off the ``decoder_sparse_step``; renormalised only with
``norm_topk_prob``). Only the MLP differs from the dense family: see
kvfleet.engine.layers.moe for the experts and their stacked weights."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from kvfleet.engine.layers.moe import SparseMoeBlock, local_experts
from kvfleet.engine.models.causal_lm import CausalLM
from kvfleet.engine.models.llama import LlamaMLP, LlamaModel

# `...layers.N.mlp.experts.E.<projection>.<tensor>` -> the stacked parameter and its shard.
_EXPERT_TENSOR = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(\w+)\.(\w+)$")
# Per-expert projection name -> (stacked weight, its fp8 scales, part of the shard name; "" for
# down).
_EXPERT_PROJECTIONS: dict[str, tuple[str, str, str]] = {
    "gate_proj": ("gate_up_proj", "gate_up_scale", ".gate"),
    "up_proj": ("gate_up_proj", "gate_up_scale", ".up"),
    "down_proj": ("down_proj", "down_scale", ""),
    # Mixtral's names: w1 gate, w3 up, w2 down.
    "w1": ("gate_up_proj", "gate_up_scale", ".gate"),
    "w3": ("gate_up_proj", "gate_up_scale", ".up"),
    "w2": ("down_proj", "down_scale", ""),
}


def num_experts(config: Any) -> int:
    """transformers 5 names it num_local_experts for both families (Qwen3-MoE's num_experts is
    an alias of it); older Qwen3-MoE configs only num_experts."""
    value = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    return int(value or 0)


def is_sparse_layer(config: Any, layer_idx: int) -> bool:
    """Whether layer ``layer_idx`` has experts, as transformers' Qwen3-MoE decides it (a config
    without the options, Mixtral's, makes every layer sparse)."""
    if layer_idx in (getattr(config, "mlp_only_layers", None) or []):
        return False
    step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    return num_experts(config) > 0 and (layer_idx + 1) % step == 0


class MoeForCausalLM(CausalLM):
    """One implementation for both families: which layers are sparse, the experts' width and
    whether the top-k weights are renormalised come from the config and the architecture."""

    def __init__(self, config: Any, arch: str) -> None:
        # Mixtral always renormalises; Qwen3-MoE says so in its config.
        renormalize = arch == "MixtralForCausalLM" or bool(getattr(config, "norm_topk_prob", False))
        expert_size = getattr(config, "moe_intermediate_size", None) or config.intermediate_size

        def make_mlp(config: Any, layer_idx: int) -> nn.Module:
            if not is_sparse_layer(config, layer_idx):
                return LlamaMLP(config)
            return SparseMoeBlock(
                config.hidden_size,
                num_experts(config),
                int(config.num_experts_per_tok),
                int(expert_size),
                config.hidden_act,
                renormalize,
            )

        super().__init__(config, LlamaModel(config, arch, make_mlp), tie_by_default=False)
        self.local_experts = local_experts(num_experts(config))

    def checkpoint_tensors(
        self, tensors: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        # Mixtral's checkpoints call the sparse MLP block_sparse_moe.
        renamed = ((name.replace(".block_sparse_moe.", ".mlp."), t) for name, t in tensors)
        yield from super().checkpoint_tensors(renamed)

    def checkpoint_shard(self, name: str) -> tuple[str, str] | None:
        """An expert's weight or fp8 weight_scale -> its stacked parameter and shard; None for
        any other tensor."""
        match = _EXPERT_TENSOR.match(name)
        if match is None or match[3] not in _EXPERT_PROJECTIONS:
            return None
        weight, scale, part = _EXPERT_PROJECTIONS[match[3]]
        param = {"weight": weight, "weight_scale": scale}.get(match[4])
        return None if param is None else (f"{match[1]}.{param}", f"{match[2]}{part}")

    def checkpoint_skip(self, name: str) -> bool:
        """The tensors of experts another rank holds (expert parallelism), never read. And an
        fp8 checkpoint's static input_scale of an expert: the experts multiply activations of
        the model dtype by their dequantized weights (W8A16), so the scales have no use."""
        match = _EXPERT_TENSOR.match(name.replace(".block_sparse_moe.", ".mlp."))
        if match is None or match[3] not in _EXPERT_PROJECTIONS:
            return False
        return match[4] == "input_scale" or int(match[2]) not in self.local_experts
