"""What every OpenAI endpoint shares: the engine, the tokenizer, the served names, whether the
server can queue a request now, and running a request's prompts through the engine's
admission and then the engine."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import Future
from contextlib import aclosing
from dataclasses import dataclass, field
from functools import lru_cache, partial
from typing import Any

from aiohttp import web

from kvfleet.engine.async_engine import AsyncEngine
from kvfleet.engine.grammar import GrammarError
from kvfleet.engine.lora_request import LoRARequest
from kvfleet.engine.outputs import RequestOutput
from kvfleet.engine.request import EngineRequest, InvalidRequestError
from kvfleet.engine.sampling_params import SamplingParams
from kvfleet.engine.server.errors import ENGINE_ERRORS, APIError, bad_request, engine_error
from kvfleet.engine.server.streaming import merge_streams
from kvfleet.engine.server.validation import (
    check_model,
    in_parse_thread,
)
from kvfleet.engine.structured_output import GrammarJob
from kvfleet.telemetry.genai import GenAISpan
from kvfleet.telemetry.http import SPAN

logger = logging.getLogger(__name__)

# Texts up to this many characters are tokenized or decoded on the event loop; longer ones in a
# thread, so that /health keeps answering. A thread is not enough alone: the fast tokenizer holds
# the GIL for part of its work (building the id list: 5 M characters stalled the loop 175 ms),
# so texts that cannot fit the context are refused by their length before (check_prompt_chars).
OFF_LOOP_CHARS = 4096
OFF_LOOP_TOKENS = 1024

# A request's outputs, tagged with the index of the prompt they are for; closing it aborts
# whatever of the request is still running.
Outputs = AsyncGenerator[tuple[int, RequestOutput], None]


def longest_token_chars(tokenizer: Any) -> int:
    """The most characters of text one token can stand for, over the whole vocabulary (added
    tokens included): a text longer than max_model_len times this cannot fit the context."""
    ids = [[i] for i in range(len(tokenizer))]
    decoded = tokenizer.batch_decode(ids, skip_special_tokens=False)
    pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    longest = max(len(t) for t in [*decoded, *(p for p in pieces if p is not None)])
    backend = getattr(tokenizer, "backend_tokenizer", None)
    # A normalizer may fold several characters into one (composition, stripping), so a token
    # can cover more input than it decodes to: leave it room.
    if backend is None or backend.normalizer is not None:
        longest *= 4
    return max(longest, 1)


@dataclass(frozen=True)
class Admitted:
    """A request's prompts as the engine admitted them, each with the compile job of its
    constraint (None without one), and the request field the constraint came from."""

    requests: list[EngineRequest]
    jobs: list[GrammarJob | None]
    constraint_param: str


@dataclass
class ServingContext:
    engine: AsyncEngine
    served_model_names: list[str]
    max_waiting_requests: int | None = None
    draining: bool = field(default=False)
    max_prompt_chars: int | None = field(default=None)
    # LoRA adapter name -> the adapter (the server's AdapterRegistry's table).
    adapters: dict[str, LoRARequest] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.tokenizer is not None and self.max_prompt_chars is None:
            self.max_prompt_chars = self.max_model_len * longest_token_chars(self.tokenizer)

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def check_can_queue(
        self, requested_model: str | None, num_sequences: int
    ) -> LoRARequest | None:
        """Refuse before any work what the server cannot queue now: an unknown model, or what
        check_queue_room refuses. (Whether the engine can ever run the request is its
        admission's to say, once the prompt is tokenized: admit_prompts.) Returns the LoRA
        adapter the model names, None for the base model."""
        lora = self.resolve_model(requested_model)
        self.check_queue_room(num_sequences)
        return lora

    def resolve_model(self, requested_model: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names (None: the base model); 404 for a name that
        is neither."""
        lora = self.adapters.get(requested_model) if requested_model is not None else None
        if lora is None:
            check_model(requested_model, self.served_model_names)
        return lora

    def check_queue_room(self, num_sequences: int) -> None:
        """Refuse a request when the engine is dead or its waiting queue cannot take the
        request's sequences (prompts x n)."""
        if not self.engine.is_alive():
            raise APIError(503, "the engine is not running", "service_unavailable",
                           code="engine_unavailable", headers={"Retry-After": "5"})  # fmt: skip
        limit = self.max_waiting_requests
        if limit is None:
            return
        if num_sequences > limit:
            raise bad_request(
                f"this request asks for {num_sequences} sequences (prompts x n), more than the "
                f"server queues at once ({limit}); split it into smaller requests",
                param="n",
                code="too_many_sequences",
            )
        if self.engine.num_waiting_sequences + num_sequences > limit:
            raise APIError(
                429,
                f"too many sequences waiting (limit {limit}); retry shortly",
                "rate_limit_error",
                code="queue_full",
                headers={"Retry-After": "1"},
            )

    def check_prompt_chars(self, num_chars: int, param: str) -> None:
        """Refuse, before tokenizing, a text too long to fit the context whatever it says."""
        if self.max_prompt_chars is not None and num_chars > self.max_prompt_chars:
            raise bad_request(
                f"This model's maximum context length is {self.max_model_len} tokens; a prompt "
                f"of {num_chars} characters cannot fit in it.",
                param=param,
                code="context_length_exceeded",
            )

    async def off_loop(self, size: int, threshold: int, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args) on the event loop when small, in a thread when large."""
        if size > threshold:
            return await asyncio.to_thread(fn, *args)
        return fn(*args)

    async def parse_off_loop(
        self, size: int, threshold: int, fn: Callable[..., Any], *args: Any
    ) -> Any:
        """fn(*args), Python work that holds the GIL, on the event loop when small, on the
        parse thread (kvfleet.engine.server.validation) when large."""
        if size > threshold:
            return await in_parse_thread(fn, *args)
        return fn(*args)

    async def tokenize(self, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
        if not isinstance(prompt, str):
            return prompt  # validated into a list of its own already
        if self.tokenizer is None:
            raise bad_request("this server runs without a tokenizer: send token ids")
        self.check_prompt_chars(len(prompt), "prompt")
        encode = partial(self.tokenizer, add_special_tokens=add_special_tokens)
        encoding = await self.off_loop(len(prompt), OFF_LOOP_CHARS, encode, prompt)
        return encoding.input_ids

    async def decode(self, token_ids: list[int]) -> str:
        decode = self.tokenizer.decode
        return await self.off_loop(len(token_ids), OFF_LOOP_TOKENS, decode, token_ids)

    def token_text(self, token_id: int) -> str:
        return _decode_one(self.tokenizer, token_id)

    def admit_prompts(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        texts: list[str | None] | None = None,
        *,
        prompt_param: str,
        constraint_param: str = "structured_outputs",
        lora: LoRARequest | None = None,
    ) -> Admitted:
        """Each prompt through the engine's admission (the one check of what a request asks,
        which resolves its max_tokens within the context), its constraint compiling meanwhile
        on the engine's compile threads. A refusal is a 400 naming the request's field:
        `prompt_param` for the prompt, `constraint_param` for the constraint."""
        requests = []
        jobs = []
        constraint = params.structured_outputs
        for i, ids in enumerate(prompts):
            job = None if constraint is None else self.engine.compile_grammar(constraint)
            grammar = None if job is None else job.future
            text = texts[i] if texts else None
            try:
                admitted = self.engine.admit(
                    ids, params, text, grammar, refuse_past_context=True, lora=lora
                )
            except InvalidRequestError as e:
                fields = {"prompt": prompt_param, "structured_outputs": constraint_param}
                param = fields.get(e.param, e.param)
                raise bad_request(str(e), param=param, code=e.code) from None
            requests.append(admitted)
            jobs.append(job)
        return Admitted(requests, jobs, constraint_param)

    async def run(self, request_id: str, admitted: Admitted) -> Outputs:
        """Queue admitted prompts, once the waiting queue has room for them still (other
        requests may have come while this one was tokenized), and stream their outputs merged.
        A constraint not compiled yet compiles while its prompt prefills, and the outputs come
        back only once it has: every refusal, a constraint that cannot be compiled included (a
        400 naming the field it came from), comes before a byte is streamed."""
        self.check_queue_room(sum(r.params.n for r in admitted.requests))
        # Queued while their grammar compiles: each stream waits for it before its first delta.
        waits = [
            job.wait if job is not None and isinstance(r.grammar, Future) else None
            for r, job in zip(admitted.requests, admitted.jobs, strict=True)
        ]
        outputs = merge_streams(
            [
                self.engine.generate(f"{request_id}-{i}", r, ready=wait)
                for i, (r, wait) in enumerate(zip(admitted.requests, waits, strict=True))
            ]
        )
        if not any(waits):
            return outputs
        try:
            first = await anext(outputs)
        except GrammarError as e:
            raise bad_request(str(e), param=admitted.constraint_param) from None
        except ENGINE_ERRORS as e:
            raise engine_error(e) from None
        return _prepended(first, outputs)


async def _prepended(first: tuple[int, RequestOutput], rest: Outputs) -> Outputs:
    async with aclosing(rest):
        yield first
        async for item in rest:
            yield item


def traced(
    request: web.Request,
    operation: str,
    response_id: str,
    model: str,
    requests: list[EngineRequest],
    outputs: Outputs,
) -> Outputs:
    """The outputs as they are without tracing; with it, also recorded on the request's span
    as the GenAI conventions name them (settings, time to first token, usage, finish reasons)."""
    span = request.get(SPAN)
    if span is None:
        return outputs
    gen = GenAISpan(span, operation, model)
    first = requests[0]
    sp = first.params
    gen.request(max_tokens=first.max_tokens, temperature=sp.temperature, top_p=sp.top_p, n=sp.n)
    input_tokens = sum(len(r.prompt_token_ids) for r in requests)
    return _recorded(gen, response_id, model, input_tokens, outputs)


async def _recorded(
    gen: GenAISpan,
    response_id: str,
    model: str,
    input_tokens: int,
    outputs: Outputs,
) -> Outputs:
    cached: dict[int, int] = {}
    finish_reasons: dict[tuple[int, int], str] = {}
    output_tokens = 0
    try:
        async with aclosing(outputs) as it:
            async for i, delta in it:
                cached[i] = delta.num_cached_tokens
                for choice in delta.outputs:
                    if choice.token_ids:
                        gen.first_token()
                        output_tokens += len(choice.token_ids)
                    if choice.finish_reason is not None:
                        finish_reasons[i, choice.index] = choice.finish_reason
                yield i, delta
    finally:
        # Also when the request fails or is aborted: what was generated until then.
        gen.response(
            response_id=response_id,
            model=model,
            input_tokens=input_tokens,
            output_tokens=output_tokens,
            cached_input_tokens=sum(cached.values()),
            finish_reasons=[finish_reasons[k] for k in sorted(finish_reasons)],
        )


@lru_cache(maxsize=65536)
def _decode_one(tokenizer: Any, token_id: int) -> str:
    return tokenizer.decode([token_id])


SERVING = web.AppKey("serving", ServingContext)
