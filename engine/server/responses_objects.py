"""What the Responses API answers (POST /v1/responses): the response object, its output items
(messages of output_text parts, function calls) and the events of a streamed one, each with
its type and sequence number, as the openai SDK parses them."""

from __future__ import annotations

import uuid
from typing import Any, Literal

from pydantic import Field

from kvfleet.engine.server.openai_responses import ResponseModel

ItemStatus = Literal["in_progress", "completed", "incomplete"]
ResponseStatus = Literal["in_progress", "completed", "incomplete", "failed"]


def item_id(prefix: str) -> str:
    """An id as OpenAI writes them: resp_..., msg_..., fc_..."""
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputText(ResponseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class MessageOutput(ResponseModel):
    type: Literal["message"] = "message"
    id: str
    status: ItemStatus
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class FunctionCallOutput(ResponseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str  # JSON text
    status: ItemStatus


OutputItem = MessageOutput | FunctionCallOutput


class InputTokensDetails(ResponseModel):
    cached_tokens: int


class OutputTokensDetails(ResponseModel):
    reasoning_tokens: int = 0


class ResponseUsage(ResponseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(ResponseModel):
    reason: Literal["max_output_tokens"]


class ResponseError(ResponseModel):
    code: str
    message: str


class TextFormatEcho(ResponseModel):
    """The request's text.format as the response echoes it."""

    format: dict[str, Any]


class Response(ResponseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: ResponseStatus
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None
    max_output_tokens: int | None
    model: str
    output: list[OutputItem]
    parallel_tool_calls: bool
    previous_response_id: None = None
    reasoning: dict[str, Any] = Field(default_factory=lambda: {"effort": None, "summary": None})
    # Nothing is stored, whatever the request said.
    store: Literal[False] = False
    temperature: float | None
    text: TextFormatEcho
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    top_p: float | None
    truncation: Literal["disabled"] = "disabled"
    usage: ResponseUsage | None = None
    user: str | None
    metadata: dict[str, str]


# -- the events of a stream -----------------------------------------------------------------


class ResponseEvent(ResponseModel):
    type: str
    # Numbered as the answer makes its events (ResponsesAnswer), from 0.
    sequence_number: int = 0


class ResponseLifecycleEvent(ResponseEvent):
    """response.created, .in_progress, .completed, .incomplete, .failed."""

    response: Response


class OutputItemEvent(ResponseEvent):
    """response.output_item.added, .done."""

    output_index: int
    item: OutputItem


class ContentPartEvent(ResponseEvent):
    """response.content_part.added, .done."""

    item_id: str
    output_index: int
    content_index: int
    part: OutputText


class OutputTextDelta(ResponseEvent):
    type: str = "response.output_text.delta"
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[Any] = Field(default_factory=list)


class OutputTextDone(ResponseEvent):
    type: str = "response.output_text.done"
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[Any] = Field(default_factory=list)


class FunctionCallArgumentsDelta(ResponseEvent):
    type: str = "response.function_call_arguments.delta"
    item_id: str
    output_index: int
    delta: str


class FunctionCallArgumentsDone(ResponseEvent):
    type: str = "response.function_call_arguments.done"
    item_id: str
    output_index: int
    name: str
    arguments: str
