"""kvfleet inference engine: paged KV cache, continuous batching, prefix caching."""

from kvfleet.engine.config import EngineArgs
from kvfleet.engine.llm import LLM
from kvfleet.engine.outputs import CompletionOutput, RequestOutput
from kvfleet.engine.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "EngineArgs", "RequestOutput", "SamplingParams"]
