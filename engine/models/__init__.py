"""Model registry: HF architecture name -> implementation."""

from __future__ import annotations

from torch import nn

from kvfleet.engine.models.gemma2 import Gemma2ForCausalLM
from kvfleet.engine.models.gpt2 import GPT2LMHeadModel
from kvfleet.engine.models.llama import LlamaForCausalLM
from kvfleet.engine.models.mixture_of_experts import MoeForCausalLM

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


def get_model_class(architecture: str) -> type[nn.Module]:
    try:
        return _REGISTRY[architecture]
    except KeyError:
        raise ValueError(
            f"architecture {architecture!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        ) from None
