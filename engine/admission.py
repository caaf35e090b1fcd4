"""Admission: the one check of a request against the engine's limits, which resolves its
completion budget (max_tokens within the context) once, into the EngineRequest that the engine
queues, the scheduler runs and the Request stops at without checking again.

Pure: the limits are fixed when the engine is built, so any thread may admit (the server's
event loop does) and tests need no model."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvfleet.engine.pooling import PoolerConfig, PoolingParams
from kvfleet.engine.request import EngineRequest, InvalidRequestError
from kvfleet.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvfleet.engine.structured_output import CompiledGrammar

CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
# The code of a request for what the engine's runner does not do: generation from an embedding
# model, embeddings from a generative one.
WRONG_RUNNER = "model_not_supported"


def completion_budget(
    num_prompt_tokens: int,
    requested: int | None,
    max_model_len: int,
    *,
    refuse_past_context: bool = False,
) -> int:
    """The tokens a prompt may generate: `requested` (None: all the room), within the room the
    context leaves after the prompt. refuse_past_context: a request for more than the room is
    refused (the OpenAI API's rule) rather than clipped to it (the offline API's)."""
    room = max_model_len - num_prompt_tokens
    if room <= 0:
        raise InvalidRequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"prompt has {num_prompt_tokens} tokens, leaving no room for a completion.",
            "prompt",
            CONTEXT_LENGTH_EXCEEDED,
        )
    if requested is None:
        return room
    if requested > room and refuse_past_context:
        raise InvalidRequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {num_prompt_tokens + requested} tokens ({num_prompt_tokens} in the "
            f"prompt, {requested} for the completion). Reduce the prompt or max_tokens.",
            "max_tokens",
            CONTEXT_LENGTH_EXCEEDED,
        )
    return min(requested, room)


@dataclass(frozen=True, slots=True)
class Admission:
    """The engine's limits a request must fit, fixed when the engine is built."""

    max_model_len: int
    vocab_size: int
    block_size: int
    # The KV blocks the cache holds: one request's sequence must fit them all alone.
    num_kv_blocks: int
    # Stop strings are matched in the detokenized text.
    has_tokenizer: bool = True
    # Why structured outputs are off (no tokenizer, or one the grammar library cannot read);
    # None when they are on.
    structured_unavailable: str | None = None
    # An embedding model's pooler (--runner pooling), which admits embedding requests only;
    # None for a generative model, which admits no embedding request.
    pooler: PoolerConfig | None = None

    def admit(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        grammar: CompiledGrammar | Future[CompiledGrammar] | None = None,
        *,
        refuse_past_context: bool = False,
    ) -> EngineRequest:
        """The request as the engine will run it, its max_tokens resolved (completion_budget);
        InvalidRequestError (a ValueError) naming the parameter at fault for one that could
        never run. `grammar`: the structured_outputs constraint's, compiled or compiling (the
        caller starts its compile: admission never blocks on one); a compile already failed
        raises its GrammarError here."""
        if self.pooler is not None:
            raise InvalidRequestError(
                "this model is an embedding model (--runner pooling): it generates no text; "
                "ask /v1/embeddings",
                "model",
                WRONG_RUNNER,
            )
        num_prompt_tokens = len(prompt_token_ids)
        if num_prompt_tokens == 0:
            raise InvalidRequestError("the prompt is empty", "prompt")
        max_tokens = completion_budget(
            num_prompt_tokens,
            params.max_tokens,
            self.max_model_len,
            refuse_past_context=refuse_past_context,
        )
        if params.stop and not self.has_tokenizer:
            raise InvalidRequestError(
                "stop strings need a tokenizer (the engine runs without one)", "stop"
            )
        self._check_vocabulary(prompt_token_ids, params)
        longest = num_prompt_tokens + max_tokens
        # The last sampled token is never fed back, so it needs no KV slot.
        needed = -(-(longest - 1) // self.block_size)
        if needed > self.num_kv_blocks:
            raise InvalidRequestError(
                f"the request needs up to {longest} tokens ({needed} KV blocks) but the KV cache "
                f"holds only {self.num_kv_blocks} blocks; lower max_tokens or give the engine "
                "more KV-cache memory",
                "max_tokens",
            )
        room = self.max_model_len - num_prompt_tokens
        if params.min_tokens > room:
            raise InvalidRequestError(
                f"min_tokens ({params.min_tokens}) exceeds the {room} tokens the context length "
                f"(max_model_len {self.max_model_len}) leaves after the prompt",
                "min_tokens",
            )
        if params.structured_outputs is not None:
            if self.structured_unavailable is not None:
                raise InvalidRequestError(
                    f"structured outputs are not available: {self.structured_unavailable}",
                    "structured_outputs",
                )
            if grammar is None:
                raise ValueError("a structured_outputs request is admitted with its grammar")
            if isinstance(grammar, Future) and grammar.done():
                grammar = grammar.result()  # compiled, or its GrammarError
        return EngineRequest(list(prompt_token_ids), params, max_tokens, prompt, grammar=grammar)

    def admit_embedding(
        self, prompt_token_ids: list[int], dimensions: int | None = None, prompt: str | None = None
    ) -> EngineRequest:
        """An embedding request as the engine will run it: its prompt computed (all of the
        context is the prompt's: nothing is generated) and pooled, truncated to `dimensions`
        where the model allows it. InvalidRequestError naming the parameter at fault."""
        pooler = self.pooler
        if pooler is None:
            raise InvalidRequestError(
                "this model generates text; embeddings need an embedding model, served with "
                "--runner pooling",
                "model",
                WRONG_RUNNER,
            )
        num_tokens = len(prompt_token_ids)
        if num_tokens == 0:
            raise InvalidRequestError("the input is empty", "input")
        if num_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"an input has {num_tokens} tokens. Shorten the input.",
                "input",
                CONTEXT_LENGTH_EXCEEDED,
            )
        vocab = self.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(
                f"input token ids {bad[:5]} are outside the vocabulary [0, {vocab})", "input"
            )
        needed = -(-num_tokens // self.block_size)
        if needed > self.num_kv_blocks:
            raise InvalidRequestError(
                f"an input of {num_tokens} tokens needs {needed} KV blocks but the KV cache "
                f"holds only {self.num_kv_blocks}; shorten it or give the engine more "
                "KV-cache memory",
                "input",
            )
        why = pooler.check_dimensions(dimensions)
        if why is not None:
            raise InvalidRequestError(why, "dimensions")
        if dimensions == pooler.hidden_size:
            dimensions = None
        pooling = PoolingParams(pooler.pooling_type, pooler.normalize, dimensions)
        return EngineRequest(list(prompt_token_ids), SamplingParams(), 0, prompt, pooling=pooling)

    def _check_vocabulary(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        vocab = self.vocab_size
        for ids, label, param in (
            (prompt_token_ids, "prompt token ids", "prompt"),
            (params.stop_token_ids, "stop_token_ids", "stop_token_ids"),
            (params.logit_bias or (), "logit_bias token ids", "logit_bias"),
        ):
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise InvalidRequestError(
                    f"{label} {bad[:5]} are outside the vocabulary [0, {vocab})", param
                )
        if params.top_k > vocab:
            raise InvalidRequestError(
                f"top_k ({params.top_k}) must not exceed the vocabulary size ({vocab})", "top_k"
            )
