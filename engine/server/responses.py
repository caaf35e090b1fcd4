"""POST /v1/responses: OpenAI's Responses API, served by the chat path under a second surface. A
request becomes the chat completion request it stands for (kvfleet.engine.server.
responses_request), which is planned, rendered, admitted and run as any chat request is; its
answer is the chat answer (tool calls parsed out of the text, whole or as it streams) written
as a response object, or as the Responses API's events.

kvfleet stores no responses: each exists only as it is returned, so previous_response_id and
the routes of stored responses (GET, DELETE, cancel, input_items) are refused with what to do
instead."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from kvfleet.engine.server.answers import respond
from kvfleet.engine.server.chat import ChatAnswer, start_chat
from kvfleet.engine.server.errors import APIError, bad_request
from kvfleet.engine.server.openai_requests import ChatCompletionRequest
from kvfleet.engine.server.openai_responses import (
    ChatChunkChoice,
    ChatCompletion,
    ResponseModel,
    Usage,
)
from kvfleet.engine.server.responses_objects import (
    ContentPartEvent,
    FunctionCallArgumentsDelta,
    FunctionCallArgumentsDone,
    FunctionCallOutput,
    IncompleteDetails,
    InputTokensDetails,
    ItemStatus,
    MessageOutput,
    OutputItem,
    OutputItemEvent,
    OutputText,
    OutputTextDelta,
    OutputTextDone,
    OutputTokensDetails,
    Response,
    ResponseError,
    ResponseEvent,
    ResponseLifecycleEvent,
    ResponseStatus,
    ResponseUsage,
    TextFormatEcho,
    item_id,
)
from kvfleet.engine.server.responses_request import (
    FunctionToolChoice,
    ResponsesRequest,
    responses_param,
)
from kvfleet.engine.server.serving import ServingContext
from kvfleet.engine.server.tools import ToolPlan
from kvfleet.engine.server.validation import invalid_as_400, parse_body


def _status(finish_reason: str | None) -> ItemStatus:
    """A finished response's status: cut by max_output_tokens (or the context), incomplete."""
    return "incomplete" if finish_reason == "length" else "completed"


def response_usage(usage: Usage) -> ResponseUsage:
    return ResponseUsage(
        input_tokens=usage.prompt_tokens,
        input_tokens_details=InputTokensDetails(
            cached_tokens=usage.prompt_tokens_details.cached_tokens
        ),
        output_tokens=usage.completion_tokens,
        output_tokens_details=OutputTokensDetails(),
        total_tokens=usage.total_tokens,
    )


class _OpenMessage:
    """A message item being streamed: its text so far."""

    def __init__(self, output_index: int) -> None:
        self.id = item_id("msg")
        self.output_index = output_index
        self.texts: list[str] = []

    def item(self, status: ItemStatus) -> MessageOutput:
        text = OutputText(text="".join(self.texts))
        return MessageOutput(id=self.id, status=status, content=[text])


class _OpenCall:
    """A function_call item being streamed: its arguments so far."""

    def __init__(self, output_index: int, call_id: str, name: str) -> None:
        self.id = item_id("fc")
        self.output_index = output_index
        self.call_id = call_id
        self.name = name
        self.arguments: list[str] = []

    def item(self, status: ItemStatus) -> FunctionCallOutput:
        arguments = "".join(self.arguments)
        return FunctionCallOutput(
            id=self.id, call_id=self.call_id, name=self.name, arguments=arguments, status=status
        )


class ResponsesAnswer(ChatAnswer):
    """The chat answer of a Responses request: whole, its completion as a response object;
    streamed, each chat delta as the events of the output items it opens, extends and closes,
    between the response's lifecycle events."""

    ends_with_done = False

    def __init__(
        self,
        ctx: ServingContext,
        req: ResponsesRequest,
        chat: ChatCompletionRequest,
        plan: ToolPlan,
        response_id: str,
        model: str,
        ids: list[int],
    ) -> None:
        super().__init__(ctx, chat, plan, response_id, model, ids)
        self.responses_request = req
        self.sequence = 0
        self.output: list[OutputItem] = []  # the items closed so far, in output order
        self.open: _OpenMessage | _OpenCall | None = None
        self.finish_reason: str | None = None
        self.pending: list[ResponseModel] = []  # emitted, numbered, not yet sent

    # -- the response object -----------------------------------------------------------------

    def response(
        self,
        status: ResponseStatus,
        output: list[OutputItem],
        usage: ResponseUsage | None = None,
        error: ResponseError | None = None,
    ) -> Response:
        req = self.responses_request
        fmt = req.format
        choice = req.tool_choice
        if isinstance(choice, FunctionToolChoice):
            tool_choice: str | dict[str, Any] = choice.model_dump()
        else:
            tool_choice = choice or "auto"
        return Response(
            id=self.request_id,
            created_at=self.created,
            status=status,
            error=error,
            incomplete_details=(
                IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None
            ),
            instructions=req.instructions,
            max_output_tokens=req.max_output_tokens,
            model=self.model,
            output=output,
            parallel_tool_calls=req.parallel_tool_calls,
            temperature=req.temperature,
            text=TextFormatEcho(
                format={"type": "text"}
                if fmt is None
                else fmt.model_dump(by_alias=True, exclude_none=True)
            ),
            tool_choice=tool_choice,
            tools=[t.model_dump(exclude_none=True) for t in req.tools or []],
            top_p=req.top_p,
            usage=usage,
            user=req.user,
            metadata=req.metadata or {},
        )

    async def whole(self, folds: list[Any]) -> ResponseModel:
        completion: ChatCompletion = await self.completion(folds)
        choice = completion.choices[0]
        status = _status(choice.finish_reason)
        message = choice.message
        output: list[OutputItem] = []
        if message.content is not None and (message.content or not message.tool_calls):
            text = OutputText(text=message.content)
            output.append(MessageOutput(id=item_id("msg"), status="completed", content=[text]))
        for call in message.tool_calls or []:
            output.append(
                FunctionCallOutput(
                    id=item_id("fc"),
                    call_id=call.id,
                    name=call.function.name,
                    arguments=call.function.arguments,
                    status="completed",
                )
            )
        # The last item is the one a limit cut, as the stream closes it.
        output[-1].status = status
        return self.response(status, output, response_usage(completion.usage))

    # -- the events of a stream --------------------------------------------------------------

    def _emit(self, event: ResponseEvent) -> None:
        event.sequence_number = self.sequence
        self.sequence += 1
        self.pending.append(event)

    def _sent(self) -> list[ResponseModel]:
        """The events emitted since the last call."""
        events, self.pending = self.pending, []
        return events

    def _lifecycle(self, kind: str, response: Response) -> None:
        self._emit(ResponseLifecycleEvent(type=f"response.{kind}", response=response))

    def _item_event(self, kind: str, output_index: int, item: OutputItem) -> None:
        event_type = f"response.output_item.{kind}"
        self._emit(OutputItemEvent(type=event_type, output_index=output_index, item=item))

    def _part_event(self, kind: str, message: _OpenMessage, part: OutputText) -> None:
        self._emit(
            ContentPartEvent(
                type=f"response.content_part.{kind}",
                item_id=message.id,
                output_index=message.output_index,
                content_index=0,
                part=part,
            )
        )

    def opening(self) -> list[ResponseModel]:
        started = self.response("in_progress", [])
        self._lifecycle("created", started)
        self._lifecycle("in_progress", started)
        return self._sent()

    def _open_message(self) -> _OpenMessage:
        message = _OpenMessage(len(self.output))
        self.open = message
        self._item_event("added", message.output_index, message.item("in_progress"))
        self._part_event("added", message, OutputText(text=""))
        return message

    def _open_call(self, call_id: str, name: str) -> None:
        call = _OpenCall(len(self.output), call_id, name)
        self.open = call
        self._item_event("added", call.output_index, call.item("in_progress"))

    def _close(self, status: ItemStatus) -> None:
        """Close the item being streamed, if any."""
        item, self.open = self.open, None
        if item is None:
            return
        done = item.item(status)
        self.output.append(done)
        if isinstance(item, _OpenMessage):
            assert isinstance(done, MessageOutput)
            part = done.content[0]
            self._emit(
                OutputTextDone(
                    item_id=item.id, output_index=item.output_index, content_index=0, text=part.text
                )
            )
            self._part_event("done", item, part)
        else:
            self._emit(
                FunctionCallArgumentsDone(
                    item_id=item.id,
                    output_index=item.output_index,
                    name=item.name,
                    arguments="".join(item.arguments),
                )
            )
        self._item_event("done", item.output_index, done)

    def events(self, choices: list[ChatChunkChoice]) -> list[ResponseModel]:
        for choice in choices:  # one: a Responses request asks for one choice
            delta = choice.delta
            if delta.content:
                message = self.open
                if not isinstance(message, _OpenMessage):
                    self._close("completed")
                    message = self._open_message()
                message.texts.append(delta.content)
                self._emit(
                    OutputTextDelta(
                        item_id=message.id,
                        output_index=message.output_index,
                        content_index=0,
                        delta=delta.content,
                    )
                )
            for call in delta.tool_calls or []:
                if call.id is not None:  # a call's first delta, with its id and name
                    self._close("completed")
                    self._open_call(call.id, call.function.name or "")
                current = self.open
                if isinstance(current, _OpenCall) and call.function.arguments:
                    current.arguments.append(call.function.arguments)
                    self._emit(
                        FunctionCallArgumentsDelta(
                            item_id=current.id,
                            output_index=current.output_index,
                            delta=call.function.arguments,
                        )
                    )
            if choice.finish_reason is not None:
                self.finish_reason = choice.finish_reason
        return self._sent()

    def closing(self) -> list[ResponseModel]:
        status = _status(self.finish_reason)
        self._close(status)
        if not self.output:  # nothing was generated: an empty message, as the whole answer has
            self._open_message()
            self._close(status)
        final = self.response(status, self.output, response_usage(self.tally.usage()))
        self._lifecycle("completed" if status == "completed" else "incomplete", final)
        return self._sent()

    def failure(self, error: APIError) -> ResponseModel | None:
        # Items left open stay as they were last sent: the response failed, not its items.
        failed = ResponseError(code=error.code or "server_error", message=error.message)
        usage = response_usage(self.tally.usage())
        self._lifecycle("failed", self.response("failed", self.output, usage, failed))
        return self._sent()[0]


async def create_response(request: web.Request) -> web.StreamResponse:
    req = await parse_body(request, ResponsesRequest)
    if req.previous_response_id is not None:
        raise bad_request(
            f"Previous response with id {req.previous_response_id!r} not found: this server "
            "stores no responses; send the whole conversation as input",
            param="previous_response_id",
            code="previous_response_not_found",
        )
    response_id = item_id("resp")
    try:
        with invalid_as_400():
            chat = req.chat_request()
        ctx, plan, ids, outputs = await start_chat(request, chat, response_id)
    except APIError as e:
        # The chat path names the chat request's fields: the client sent the Responses'.
        e.param = responses_param(e.param)
        raise
    model = req.model or ctx.model_name
    answer = ResponsesAnswer(ctx, req, chat, plan, response_id, model, ids)
    return await respond(request, answer, outputs)


async def stored_response(request: web.Request) -> web.StreamResponse:
    """GET or DELETE /v1/responses/{id}, and its cancel and input_items: nothing is stored."""
    response_id = request.match_info["path"].split("/")[0]
    raise APIError(
        404,
        f"Response with id {response_id!r} not found: this server stores no responses (each "
        "exists only as it is returned)",
        "invalid_request_error",
        param="response_id",
        code="response_not_found",
    )
