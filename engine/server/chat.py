"""POST /v1/chat/completions, and rendering messages with the model's chat template."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from kvfleet.engine.outputs import CompletionOutput, RequestOutput
from kvfleet.engine.server.completions import vllm_prompt_logprobs
from kvfleet.engine.server.errors import bad_request
from kvfleet.engine.server.protocol import ChatCompletionRequest, Usage, now, random_id
from kvfleet.engine.server.serving import OFF_LOOP_CHARS, SERVING, ServingContext, traced
from kvfleet.engine.server.streaming import SSEResponse, relay
from kvfleet.engine.server.tools import (
    TOOL_SETTINGS,
    StreamedChoices,
    ToolPlan,
    ToolSettings,
    choice_message,
    conversation_with_tools,
    plan_tools,
    template_reads_tools,
)
from kvfleet.engine.server.validation import BODY_BYTES, parse_body, refused
from kvfleet.protocol.chat_template import (
    DEFAULT_CHAT_TEMPLATE,
    ChatMessage,
    chat_text_ids,
    conversation_of,
    render_chat_text,
)
from kvfleet.protocol.json_body import OFF_LOOP_BYTES, RequestRefused
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
    else as text in the parser's format (kvfleet.engine.server.tools)."""
    if ctx.tokenizer is None:
        raise bad_request("this server runs without a tokenizer: chat is unavailable")
    shown = None
    tool_chars = 0
    if tools is None:
        conversation = conversation_of(messages)
    else:
        plan, settings = tools
        native = template_reads_tools(ctx.tokenizer.chat_template or DEFAULT_CHAT_TEMPLATE)
        tool_chars = plan.chars
        conversation = await ctx.parse_off_loop(
            tool_chars, OFF_LOOP_CHARS, conversation_with_tools, messages, plan, native,
            settings.parser,
        )  # fmt: skip
        shown = plan.tools if native else None
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


def _logprobs_content(ctx: ServingContext, choice: CompletionOutput, top_n: int) -> list[dict]:
    content = []
    for token, entry in zip(choice.token_ids, choice.logprobs or [], strict=False):
        text = ctx.token_text(token)
        top = sorted(entry.items(), key=lambda kv: kv[1], reverse=True)[:top_n]
        content.append(
            {
                "token": text,
                "logprob": entry[token],
                "bytes": list(text.encode()),
                "top_logprobs": [
                    {"token": (t := ctx.token_text(tid)), "logprob": lp, "bytes": list(t.encode())}
                    for tid, lp in top
                ],
            }
        )
    return content


async def create_chat_completion(request: web.Request) -> web.StreamResponse:
    ctx: ServingContext = request.app[SERVING]
    req = await parse_body(request, ChatCompletionRequest)
    ctx.check_can_queue(req.model, req.n)
    tool_settings = request.app[TOOL_SETTINGS]
    plan = await ctx.parse_off_loop(
        request[BODY_BYTES], OFF_LOOP_BYTES, plan_tools, req, tool_settings
    )
    ids = await render_chat_served(
        ctx, req.messages, req.add_generation_prompt, req.chat_template_kwargs,
        (plan, tool_settings),
    )  # fmt: skip
    constraint, field = req.constraint
    admitted = ctx.admit_prompts(
        [ids],
        req.requested_max_tokens,
        lambda max_tokens: plan.sampling(req.sampling_params(max_tokens)),
        prompt_param="messages",
        constraint_param=field if constraint is not None else "tool_choice",
    )
    request_id = random_id("chatcmpl")
    created = now()
    model = req.model or ctx.model_name
    top_n = req.top_logprobs or 0
    outputs = await ctx.run(request_id, admitted)
    outputs = traced(request, CHAT, request_id, model, admitted.requests, outputs)

    def logprobs(choice: CompletionOutput) -> dict[str, Any] | None:
        if not req.logprobs:
            return None
        return {"content": _logprobs_content(ctx, choice, top_n)}

    def usage(completion_tokens: int, cached: int) -> dict[str, Any]:
        return Usage(
            prompt_tokens=len(ids),
            completion_tokens=completion_tokens,
            total_tokens=len(ids) + completion_tokens,
            prompt_tokens_details={"cached_tokens": cached},
        ).model_dump(exclude_none=True)

    if not req.stream:
        result = (await ctx.collect(outputs, admitted.requests))[0]
        # Tool calls are parsed out of each whole text, a loop over its characters.
        messages = [
            await ctx.parse_off_loop(len(c.text), OFF_LOOP_CHARS, choice_message, plan, c)
            for c in result.outputs
        ]
        body: dict[str, Any] = {}
        if result.prompt_logprobs is not None:
            body["prompt_logprobs"] = vllm_prompt_logprobs(ctx, result.prompt_logprobs)
        return web.json_response(
            {
                "id": request_id,
                "object": "chat.completion",
                "created": created,
                "model": model,
                "choices": [
                    {
                        "index": c.index,
                        "message": message,
                        "logprobs": logprobs(c),
                        "finish_reason": finish_reason,
                        "stop_reason": c.stop_reason,
                    }
                    for c, (message, finish_reason) in zip(result.outputs, messages, strict=True)
                ],
                "usage": usage(
                    sum(len(c.token_ids) for c in result.outputs), result.num_cached_tokens
                ),
                **body,
            }
        )

    sse = SSEResponse(request)
    await sse.start()
    opts = req.stream_options
    include_usage = bool(opts and opts.include_usage)
    continuous_usage = bool(opts and opts.continuous_usage_stats)
    completion_tokens = 0
    cached = 0

    def chunk(choices: list[dict[str, Any]]) -> dict[str, Any]:
        payload = {
            "id": request_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": choices,
        }
        if continuous_usage:
            payload["usage"] = usage(completion_tokens, cached)
        return payload

    await sse.send(
        chunk(
            [
                {
                    "index": j,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
                for j in range(req.n)
            ]
        )
    )

    streamed = StreamedChoices(plan)

    def to_choices(_: int, delta: RequestOutput) -> list[dict[str, Any]]:
        nonlocal completion_tokens, cached
        cached = delta.num_cached_tokens
        choices = []
        for c in delta.outputs:
            completion_tokens += len(c.token_ids)
            message, finish = streamed.delta(c)
            # Text held back (an unfinished character, or what may start a tool call) with no
            # logprobs or finish to carry makes no chunk.
            if not message and finish is None and c.logprobs is None:
                continue
            choices.append(
                {
                    "index": c.index,
                    "delta": message,
                    "logprobs": logprobs(c),
                    "finish_reason": finish,
                    "stop_reason": c.stop_reason,
                }
            )
        return choices

    if not await relay(sse, outputs, to_choices, chunk):
        return await sse.finish()
    if include_usage:
        payload = chunk([])
        payload["usage"] = usage(completion_tokens, cached)
        await sse.send(payload)
    return await sse.finish()
