"""A request's answer, streamed or whole, out of the same typed deltas: an endpoint's Answer
makes each engine step's choice deltas; stream_answer sends each step's as an event, and
whole_answer folds each choice's into the whole response."""

from __future__ import annotations

import asyncio
import logging
from abc import ABC, abstractmethod
from contextlib import aclosing
from typing import Any, ClassVar, Generic, Protocol, TypeVar

from aiohttp import web

from kvfleet.engine.outputs import RequestOutput
from kvfleet.engine.server.errors import ENGINE_ERRORS, APIError, engine_error
from kvfleet.engine.server.openai_responses import (
    PromptLogprob,
    PromptLogprobs,
    PromptTokensDetails,
    ResponseModel,
    Usage,
    now,
)
from kvfleet.engine.server.serving import Outputs, ServingContext
from kvfleet.engine.server.streaming import SSEResponse

logger = logging.getLogger(__name__)

# Per token: {token id: logprob} holding the token and the top N; None where nothing predicts it.
Logprobs = list[dict[int, float] | None]


class ChoiceDelta(Protocol):
    index: int


_DeltaT = TypeVar("_DeltaT", bound=ChoiceDelta)
_DeltaT_contra = TypeVar("_DeltaT_contra", contravariant=True)


class ChoiceFold(Protocol[_DeltaT_contra]):
    """A whole choice as its deltas come, in order."""

    def add(self, delta: _DeltaT_contra, /) -> None: ...


_FoldT = TypeVar("_FoldT", bound=ChoiceFold[Any])


class UsageTally:
    """The tokens of a response so far: its prompts', their completions' (unless the request
    only scores its prompts) and, of the prompts', those read from the prefix cache."""

    def __init__(self, prompts: list[list[int]], counts_completion: bool = True) -> None:
        self.prompt_tokens = sum(len(p) for p in prompts)
        self.counts_completion = counts_completion
        self.completion_tokens = 0
        self._cached: dict[int, int] = {}  # per prompt, as its latest output says

    def add(self, prompt_index: int, output: RequestOutput) -> None:
        self._cached[prompt_index] = output.num_cached_tokens
        if self.counts_completion:
            self.completion_tokens += sum(len(choice.token_ids) for choice in output.outputs)

    def usage(self) -> Usage:
        return Usage(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            total_tokens=self.prompt_tokens + self.completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(self._cached.values())),
        )


class Answer(ABC, Generic[_DeltaT, _FoldT]):
    """What an endpoint makes of its request's outputs: each engine step's choice deltas, an
    event of them when the answer streams, the whole response out of each choice's deltas
    folded when it does not."""

    def __init__(
        self,
        request_id: str,
        model: str,
        prompts: list[list[int]],
        *,
        stream: bool,
        include_usage: bool = False,
        continuous_usage: bool = False,
        counts_completion: bool = True,
    ) -> None:
        self.request_id = request_id
        self.created = now()
        self.model = model
        self.stream = stream
        self.include_usage = include_usage
        self.continuous_usage = continuous_usage
        self.tally = UsageTally(prompts, counts_completion)

    def step(self, prompt_index: int, output: RequestOutput) -> list[_DeltaT]:
        """The deltas of one engine step's output for one prompt: none for a step with nothing
        to show (text held back, no logprobs and no finish)."""
        self.tally.add(prompt_index, output)
        return self.choices(prompt_index, output)

    # Whether a stream ends with `data: [DONE]`, as OpenAI's chat and completions streams do.
    ends_with_done: ClassVar[bool] = True

    def opening(self) -> list[ResponseModel]:
        """The events a stream starts with, before any step's."""
        return []

    def events(self, choices: list[_DeltaT]) -> list[ResponseModel]:
        """The events of one step's deltas (one at least): one event of them all."""
        return [self.event(choices, self.event_usage())]

    def closing(self) -> list[ResponseModel]:
        """The events after the last step's: the usage, when the request asked for it."""
        return [self.event([], self.tally.usage())] if self.include_usage else []

    def failure(self, error: APIError) -> ResponseModel | None:
        """The event a stream that cannot be finished ends with; None: the error's JSON."""
        return None

    def event_usage(self) -> Usage | None:
        """The usage each event carries: so far, with stream_options.continuous_usage_stats."""
        return self.tally.usage() if self.continuous_usage else None

    @abstractmethod
    def choices(self, prompt_index: int, output: RequestOutput) -> list[_DeltaT]: ...

    @abstractmethod
    def event(self, choices: list[_DeltaT], usage: Usage | None) -> ResponseModel:
        """One event of the stream."""

    @abstractmethod
    def new_fold(self) -> _FoldT: ...

    @abstractmethod
    async def whole(self, folds: list[_FoldT]) -> ResponseModel:
        """The whole response, from every choice's fold in the order of their indices."""


async def respond(
    request: web.Request, answer: Answer[Any, Any], outputs: Outputs
) -> web.StreamResponse:
    """The answer streamed, when the request asked for a stream, else whole."""
    if answer.stream:
        return await stream_answer(request, answer, outputs)
    whole = await whole_answer(answer, outputs)
    return web.json_response(text=whole.model_dump_json())


async def stream_answer(
    request: web.Request, answer: Answer[Any, Any], outputs: Outputs
) -> web.StreamResponse:
    """The answer's opening events, its events of each engine step that has deltas, then its
    closing ones (the usage when asked), then [DONE] where the answer's streams end with it. A
    request that cannot be finished (the engine failed it, the server aborted it, the engine
    died, or the server failed on it) ends with the answer's failure event instead: the stream
    has begun, and it still ends."""
    sse = SSEResponse(request)
    await sse.start()
    for event in answer.opening():
        await sse.send(event)
    try:
        async with aclosing(outputs) as it:
            async for prompt_index, output in it:
                choices = answer.step(prompt_index, output)
                if choices:
                    for event in answer.events(choices):
                        await sse.send(event)
    except ENGINE_ERRORS as e:
        return await _failed(sse, answer, engine_error(e))
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:
        logger.exception("unhandled error streaming %s", request.path)
        return await _failed(sse, answer, APIError(500, "internal server error", "server_error"))
    for event in answer.closing():
        await sse.send(event)
    return await sse.finish(answer.ends_with_done)


async def _failed(
    sse: SSEResponse, answer: Answer[Any, Any], error: APIError
) -> web.StreamResponse:
    event = answer.failure(error)
    if event is None:
        await sse.send_error(error)
    else:
        await sse.send(event)
    return await sse.finish(answer.ends_with_done)


async def whole_answer(answer: Answer[Any, _FoldT], outputs: Outputs) -> ResponseModel:
    """Every step's deltas folded per choice, then the whole response; a request the engine
    could not finish is its HTTP error."""
    folds: dict[int, _FoldT] = {}
    try:
        async with aclosing(outputs) as it:
            async for prompt_index, output in it:
                for delta in answer.step(prompt_index, output):
                    fold = folds.get(delta.index)
                    if fold is None:
                        fold = folds[delta.index] = answer.new_fold()
                    fold.add(delta)
    except ENGINE_ERRORS as e:
        raise engine_error(e) from None
    return await answer.whole([folds[index] for index in sorted(folds)])


def vllm_prompt_logprobs(ctx: ServingContext, logprobs: Logprobs) -> PromptLogprobs:
    """vLLM's `prompt_logprobs` field, of either endpoint."""
    return [
        None
        if entry is None
        else {
            str(token): PromptLogprob(logprob=logprob, decoded_token=ctx.token_text(token))
            for token, logprob in entry.items()
        }
        for entry in logprobs
    ]
