"""OpenAI response schemas: what the server answers on /v1/completions and /v1/chat/completions
(whole, and streamed chunk by chunk), /v1/models and /tokenize, with vLLM's extensions
(stop_reason, prompt_logprobs, max_model_len). A field typed `Omitted[...]` is left out of the
JSON when None, as OpenAI's shape has no key there; every other None is a JSON null."""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, ClassVar, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, SerializerFunctionWrapHandler, model_serializer

_T = TypeVar("_T")


class _OmittedWhenNone:
    """The annotation `Omitted` marks its fields with."""


_OMITTED = _OmittedWhenNone()
Omitted = Annotated[_T | None, _OMITTED]


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class ResponseModel(BaseModel):
    # A logprob may be -inf: written -Infinity, as Python's json writes it, where pydantic's
    # default is null.
    model_config = ConfigDict(ser_json_inf_nan="constants")
    _omitted: ClassVar[frozenset[str]] = frozenset()

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        cls._omitted = frozenset(
            name for name, info in cls.model_fields.items() if _OMITTED in info.metadata
        )
        if cls._omitted and not issubclass(cls, WithOmittedFields):
            raise TypeError(f"{cls.__name__} has Omitted fields: derive it from WithOmittedFields")


class WithOmittedFields(ResponseModel):
    """A response model with Omitted fields. Its serializer is a Python step per object, which
    makes a response's thousands of logprobs objects several times slower to write: the
    models without such fields do without it."""

    @model_serializer(mode="wrap")
    def _leave_out_omitted(self, handler: SerializerFunctionWrapHandler) -> Any:
        data = handler(self)
        for name in self._omitted:
            if data.get(name, 0) is None:
                del data[name]
        return data


class PromptTokensDetails(ResponseModel):
    cached_tokens: int


class Usage(ResponseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class PromptLogprob(ResponseModel):
    logprob: float
    decoded_token: str


# vLLM's prompt_logprobs: per prompt token null (the first: nothing predicts it) or
# {token id: its logprob and text}, the prompt's token and the top N.
PromptLogprobs = list[dict[str, PromptLogprob] | None]


# -- /v1/completions -----------------------------------------------------------------------


class CompletionLogprobs(ResponseModel):
    """OpenAI's legacy logprobs: one entry per token in each list; an echoed prompt's first
    token has null in token_logprobs and top_logprobs (nothing predicts it)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(WithOmittedFields):
    """A whole choice, or one chunk of a streamed one."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None
    prompt_logprobs: Omitted[PromptLogprobs] = None


class Completion(WithOmittedFields):
    """The whole response, or one event of a stream (which has usage only in its last event,
    when stream_options.include_usage asks for it)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Omitted[Usage] = None


# -- /v1/chat/completions ------------------------------------------------------------------


class TopLogprob(ResponseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(ResponseModel):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(ResponseModel):
    content: list[TokenLogprob]


class FunctionCall(ResponseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(ResponseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(WithOmittedFields):
    role: Literal["assistant"] = "assistant"
    content: str | None  # null when the message is tool calls alone
    tool_calls: Omitted[list[ToolCall]] = None


class ChatChoice(ResponseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None


class ChatCompletion(WithOmittedFields):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: Omitted[PromptLogprobs] = None


class DeltaFunction(WithOmittedFields):
    name: Omitted[str] = None
    arguments: str


class DeltaToolCall(WithOmittedFields):
    """A piece of a streamed call: its first carries id, type and name (arguments ""), the
    others only more argument text."""

    index: int
    id: Omitted[str] = None
    type: Omitted[Literal["function"]] = None
    function: DeltaFunction


class ChatDelta(WithOmittedFields):
    role: Omitted[Literal["assistant"]] = None
    content: Omitted[str] = None
    tool_calls: Omitted[list[DeltaToolCall]] = None

    @property
    def empty(self) -> bool:
        return self.role is None and self.content is None and self.tool_calls is None


class ChatChunkChoice(ResponseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None


class ChatRoleChoice(ResponseModel):
    """A streamed choice's first chunk: its role, before any token (so no stop_reason)."""

    index: int
    delta: ChatDelta
    logprobs: None = None
    finish_reason: None = None


class ChatCompletionChunk(WithOmittedFields):
    """One event of a stream; usage in each with stream_options.continuous_usage_stats, and in
    an event of its own after the last choice's with include_usage."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice | ChatRoleChoice]
    usage: Omitted[Usage] = None


# -- /v1/models, /tokenize, /detokenize -----------------------------------------------------


class ModelCard(ResponseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    root: str
    # The base model of a LoRA adapter; None for the base model itself.
    parent: str | None = None
    max_model_len: int


class ModelList(ResponseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class Tokens(ResponseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class Detokenized(ResponseModel):
    prompt: str
