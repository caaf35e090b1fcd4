"""POST /v1/chat/completions, and rendering messages with the model's chat template."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from aiohttp import web

from kvfleet.engine.outputs import CompletionOutput, RequestOutput
from kvfleet.engine.server.answers import Answer, Logprobs, respond, vllm_prompt_logprobs
from kvfleet.engine.server.errors import bad_request
from kvfleet.engine.server.openai_requests import ChatCompletionRequest
from kvfleet.engine.server.openai_responses import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ChatLogprobs,
    ChatRoleChoice,
    ResponseModel,
    TokenLogprob,
    TopLogprob,
    Usage,
    random_id,
)
from kvfleet.engine.server.serving import OFF_LOOP_CHARS, SERVING, Outputs, ServingContext, traced
from kvfleet.engine.server.tools import (
    TOOL_SETTINGS,
    StreamedChoices,
    ToolPlan,
    ToolSettings,
    choice_message,
    plan_tools,
)
from kvfleet.engine.server.validation import BODY_BYTES, invalid_as_400, parse_body, refused
from kvfleet.protocol.chat_template import (
    DEFAULT_CHAT_TEMPLATE,
    ChatMessage,
    chat_text_ids,
    conversation_of,
    render_chat_text,
)
from kvfleet.protocol.json_body import OFF_LOOP_BYTES, RequestRefused
from kvfleet.protocol.tool_prompt import chat_inputs, template_reads_tools
from kvfleet.telemetry.genai import CHAT


async def render_chat_served(
    ctx: ServingContext,
    messages: list[ChatMessage],
    add_generation_prompt: bool = True,
    template_kwargs: dict[str, Any] | None = None,
    tools: tuple[ToolPlan, ToolSettings] | None = None,
) -> list[int]:
    """kvfleet.protocol's render_chat for the server: large conversations are rendered and
    tokenized off the event loop, and a text too long to fit the context is refused before
    tokenizing. tools: the request's tool plan, rendered by the template when it reads tools,
    else as text in the parser's format (kvfleet.protocol.tool_prompt)."""
    if ctx.tokenizer is None:
        raise bad_request("this server runs without a tokenizer: chat is unavailable")
    shown = None
    tool_chars = 0
    if tools is None:
        conversation = conversation_of(messages)
    else:
        plan, settings = tools
        native = template_reads_tools(ctx.tokenizer.chat_template or DEFAULT_CHAT_TEMPLATE)
        tool_chars = plan.prompt.chars
        conversation, shown = await ctx.parse_off_loop(
            tool_chars, OFF_LOOP_CHARS, chat_inputs, messages, plan.prompt, native,
            settings.parser,
        )  # fmt: skip
    size = sum(len(entry["content"]) for entry in conversation)
    ctx.check_prompt_chars(size, "messages")
    try:
        text = await ctx.parse_off_loop(
            size + tool_chars, OFF_LOOP_CHARS, render_chat_text, ctx.tokenizer, conversation,
            add_generation_prompt, template_kwargs, shown,
        )  # fmt: skip
    except RequestRefused as e:
        raise refused(e) from None
    ctx.check_prompt_chars(len(text), "messages")
    return await ctx.off_loop(len(text), OFF_LOOP_CHARS, chat_text_ids, ctx.tokenizer, text)


def _logprobs_content(
    ctx: ServingContext, choice: CompletionOutput, top_n: int
) -> list[TokenLogprob]:
    content = []
    for token, entry in zip(choice.token_ids, choice.logprobs or [], strict=False):
        text = ctx.token_text(token)
        top = sorted(entry.items(), key=lambda item: item[1], reverse=True)[:top_n]
        top_logprobs = []
        for top_token, logprob in top:
            top_text = ctx.token_text(top_token)
            top_logprobs.append(
                TopLogprob(token=top_text, logprob=logprob, bytes=list(top_text.encode()))
            )
        content.append(
            TokenLogprob(
                token=text,
                logprob=entry[token],
                bytes=list(text.encode()),
                top_logprobs=top_logprobs,
            )
        )
    return content


class _ChoiceFold:
    """A whole choice out of its deltas: its text (whose tool calls are parsed once it is
    whole) and its logprobs joined."""

    def __init__(self) -> None:
        self.index = 0
        self.texts: list[str] = []
        self.logprobs: list[TokenLogprob] = []
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None

    def add(self, choice: ChatChunkChoice) -> None:
        self.index = choice.index
        if choice.delta.content is not None:
            self.texts.append(choice.delta.content)
        if choice.logprobs is not None:
            self.logprobs += choice.logprobs.content
        self.finish_reason = choice.finish_reason
        self.stop_reason = choice.stop_reason


class ChatAnswer(Answer[ChatChunkChoice, _ChoiceFold]):
    """A streamed answer's tool calls are parsed out of each choice's text as it comes; a
    whole one's out of each whole text, where a malformed call leaves all of it content (a
    stream has sent the call's deltas by then)."""

    def __init__(
        self,
        ctx: ServingContext,
        req: ChatCompletionRequest,
        plan: ToolPlan,
        request_id: str,
        model: str,
        ids: list[int],
    ) -> None:
        options = req.stream_options
        super().__init__(
            request_id, model, [ids], stream=req.stream,
            include_usage=bool(options and options.include_usage),
            continuous_usage=bool(options and options.continuous_usage_stats),
        )  # fmt: skip
        self.ctx = ctx
        self.req = req
        self.plan = plan
        self.streamed = StreamedChoices(plan) if req.stream else None
        self.prompt_logprobs: Logprobs | None = None

    def opening(self) -> list[ResponseModel]:
        roles = [
            ChatRoleChoice(index=index, delta=ChatDelta(role="assistant", content=""))
            for index in range(self.req.n)
        ]
        return [self._chunk(roles, self.event_usage())]

    def choices(self, prompt_index: int, output: RequestOutput) -> list[ChatChunkChoice]:
        if output.prompt_logprobs is not None:
            self.prompt_logprobs = output.prompt_logprobs
        choices = []
        for choice in output.outputs:
            if self.streamed is not None:
                delta, finish = self.streamed.delta(choice)
            else:
                delta, finish = ChatDelta(content=choice.text or None), choice.finish_reason
            # Text held back (an unfinished character, or what may start a tool call) with no
            # logprobs or finish to carry makes no delta.
            if delta.empty and finish is None and choice.logprobs is None:
                continue
            choices.append(
                ChatChunkChoice(
                    index=choice.index,
                    delta=delta,
                    logprobs=self._logprobs(choice),
                    finish_reason=finish,
                    stop_reason=choice.stop_reason,
                )
            )
        return choices

    def _logprobs(self, choice: CompletionOutput) -> ChatLogprobs | None:
        if not self.req.logprobs:
            return None
        return ChatLogprobs(content=_logprobs_content(self.ctx, choice, self.req.top_logprobs or 0))

    def event(self, choices: list[ChatChunkChoice], usage: Usage | None) -> ChatCompletionChunk:
        return self._chunk(choices, usage)

    def _chunk(
        self, choices: Sequence[ChatChunkChoice | ChatRoleChoice], usage: Usage | None
    ) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self.request_id, created=self.created, model=self.model, choices=list(choices),
            usage=usage,
        )  # fmt: skip

    def new_fold(self) -> _ChoiceFold:
        return _ChoiceFold()

    async def whole(self, folds: list[_ChoiceFold]) -> ResponseModel:
        return await self.completion(folds)

    async def completion(self, folds: list[_ChoiceFold]) -> ChatCompletion:
        """The whole chat completion, from every choice's fold."""
        choices = []
        for fold in folds:
            text = "".join(fold.texts)
            # Tool calls are parsed out of each whole text, a loop over its characters.
            message, finish = await self.ctx.parse_off_loop(
                len(text), OFF_LOOP_CHARS, choice_message, self.plan, text, fold.finish_reason
            )
            logprobs = ChatLogprobs(content=fold.logprobs) if self.req.logprobs else None
            choices.append(
                ChatChoice(
                    index=fold.index,
                    message=message,
                    logprobs=logprobs,
                    finish_reason=finish,
                    stop_reason=fold.stop_reason,
                )
            )
        scored = self.prompt_logprobs
        return ChatCompletion(
            id=self.request_id, created=self.created, model=self.model, choices=choices,
            usage=self.tally.usage(),
            prompt_logprobs=None if scored is None else vllm_prompt_logprobs(self.ctx, scored),
        )  # fmt: skip


async def create_chat_completion(request: web.Request) -> web.StreamResponse:
    req = await parse_body(request, ChatCompletionRequest)
    request_id = random_id("chatcmpl")
    ctx, plan, ids, outputs = await start_chat(request, req, request_id)
    answer = ChatAnswer(ctx, req, plan, request_id, req.model or ctx.model_name, ids)
    return await respond(request, answer, outputs)


async def start_chat(
    request: web.Request, req: ChatCompletionRequest, request_id: str
) -> tuple[ServingContext, ToolPlan, list[int], Outputs]:
    """A chat request planned (tools), rendered, admitted and queued: its tool plan, its prompt
    and its outputs (the Responses API's requests come this way too)."""
    ctx: ServingContext = request.app[SERVING]
    lora = ctx.check_can_queue(req.model, req.n)
    tool_settings = request.app[TOOL_SETTINGS]
    plan = await ctx.parse_off_loop(
        request[BODY_BYTES], OFF_LOOP_BYTES, plan_tools, req, tool_settings
    )
    ids = await render_chat_served(
        ctx, req.messages, req.add_generation_prompt, req.chat_template_kwargs,
        (plan, tool_settings),
    )  # fmt: skip
    constraint, field = req.constraint
    with invalid_as_400():
        params = plan.sampling(req.sampling_params(req.requested_max_tokens))
    admitted = ctx.admit_prompts(
        [ids],
        params,
        prompt_param="messages",
        constraint_param=field if constraint is not None else "tool_choice",
        lora=lora,
    )
    model = req.model or ctx.model_name
    outputs = await ctx.run(request_id, admitted)
    return ctx, plan, ids, traced(request, CHAT, request_id, model, admitted.requests, outputs)
