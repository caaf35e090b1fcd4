"""kvfleet inference engine: paged KV cache, continuous batching, prefix caching."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvfleet.engine.engine_args import EngineArgs
    from kvfleet.engine.llm import LLM
    from kvfleet.engine.outputs import (
        CompletionOutput,
        EmbeddingOutput,
        EmbeddingRequestOutput,
        RequestOutput,
    )
    from kvfleet.engine.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "EngineArgs",
    "RequestOutput",
    "SamplingParams",
]

# Imported on first use: a process that needs one submodule (the grammar sandbox's worker, a
# command's --help) does not pay for torch.
_HOMES = {
    "EngineArgs": "kvfleet.engine.engine_args",
    "LLM": "kvfleet.engine.llm",
    "CompletionOutput": "kvfleet.engine.outputs",
    "EmbeddingOutput": "kvfleet.engine.outputs",
    "EmbeddingRequestOutput": "kvfleet.engine.outputs",
    "RequestOutput": "kvfleet.engine.outputs",
    "SamplingParams": "kvfleet.engine.sampling_params",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'kvfleet.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
