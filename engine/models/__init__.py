"""Model registry: HF architecture name -> implementation."""

from __future__ import annotations

from torch import nn

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

# What --runner pooling serves: the Llama family's causal LMs (their head dropped) and their
# bare bodies (as embedding checkpoints name them), each built from its causal LM.
_BODIES = {
    "LlamaModel": "LlamaForCausalLM",
    "MistralModel": "MistralForCausalLM",
    "Qwen2Model": "Qwen2ForCausalLM",
    "Qwen3Model": "Qwen3ForCausalLM",
}
POOLING_ARCHITECTURES = tuple(sorted([*_BODIES, *_BODIES.values()]))


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
    return PoolingModel(LlamaForCausalLM(config, causal_arch))
