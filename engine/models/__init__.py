"""Model registry: HF architecture name -> implementation."""

from __future__ import annotations

from torch import nn

from kvfleet.engine.models.causal_lm import CausalLM
from kvfleet.engine.models.gemma2 import Gemma2ForCausalLM
from kvfleet.engine.models.gpt2 import GPT2LMHeadModel
from kvfleet.engine.models.llama import LlamaForCausalLM
from kvfleet.engine.models.mixture_of_experts import MoeForCausalLM
from kvfleet.engine.models.pooling_model import PoolingModel

_REGISTRY: dict[str, type[nn.Module]] = {
    "GPT2LMHeadModel": GPT2LMHeadModel,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": MoeForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": MoeForCausalLM,
}

SUPPORTED_ARCHITECTURES = tuple(sorted(_REGISTRY))

# What --runner pooling serves: every family's causal LM (its head dropped) and its bare body
# (as embedding checkpoints name it), each built from the causal LM.
_BODIES = {
    "GPT2Model": "GPT2LMHeadModel",
    "Gemma2Model": "Gemma2ForCausalLM",
    "LlamaModel": "LlamaForCausalLM",
    "MistralModel": "MistralForCausalLM",
    "MixtralModel": "MixtralForCausalLM",
    "Qwen2Model": "Qwen2ForCausalLM",
    "Qwen3Model": "Qwen3ForCausalLM",
    "Qwen3MoeModel": "Qwen3MoeForCausalLM",
}
POOLING_ARCHITECTURES = tuple(sorted([*_BODIES, *_REGISTRY]))


def get_model_class(architecture: str) -> type[nn.Module]:
    try:
        return _REGISTRY[architecture]
    except KeyError:
        raise ValueError(
            f"architecture {architecture!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        ) from None


def build_pooling_model(config: object, architecture: str) -> PoolingModel:
    """The embedding model of a checkpoint of one of POOLING_ARCHITECTURES."""
    if architecture not in POOLING_ARCHITECTURES:
        raise ValueError(
            f"architecture {architecture!r} cannot be served as an embedding model; supported: "
            f"{', '.join(POOLING_ARCHITECTURES)}"
        )
    causal_arch = _BODIES.get(architecture, architecture)
    causal = _REGISTRY[causal_arch](config, causal_arch)
    assert isinstance(causal, CausalLM | GPT2LMHeadModel)  # every class of the registry
    return PoolingModel(causal)
