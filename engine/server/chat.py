"""POST /v1/chat/completions, and rendering messages with the model's chat template."""

from __future__ import annotations

import inspect
import logging
from typing import Any

import jinja2
from aiohttp import web

from kvfleet.engine.outputs import CompletionOutput, RequestOutput
from kvfleet.engine.server.errors import bad_request
from kvfleet.engine.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    Usage,
    now,
    random_id,
)
from kvfleet.engine.server.serving import OFF_LOOP_CHARS, SERVING, ServingContext
from kvfleet.engine.server.streaming import SSEResponse, nothing_to_send, relay
from kvfleet.engine.server.validation import parse_body

logger = logging.getLogger(__name__)

# For checkpoints without a template of their own: ChatML, which most chat models were tuned on.
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _template_kwargs_reserved(tokenizer: Any) -> frozenset[str]:
    """apply_chat_template's own arguments: a client may not set them through
    chat_template_kwargs (they would clash with ours or change what it returns)."""
    params = inspect.signature(tokenizer.apply_chat_template).parameters
    return frozenset(n for n, p in params.items() if p.kind is not p.VAR_KEYWORD)


def conversation_of(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template reads them."""
    conversation = []
    for m in messages:
        entry: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.name:
            entry["name"] = m.name
        conversation.append(entry)
    return conversation


def render_chat_text(
    tokenizer: Any,
    conversation: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    template_kwargs: dict[str, Any] | None = None,
) -> str:
    """The conversation through the model's chat template (ChatML without one); a clean 400
    when the template refuses it."""
    if tokenizer is None:
        raise bad_request("this server runs without a tokenizer: chat is unavailable")
    kwargs = template_kwargs or {}
    clash = sorted(set(kwargs) & _template_kwargs_reserved(tokenizer))
    if clash:
        raise bad_request(f"chat_template_kwargs may not set {', '.join(clash)}",
                          param="chat_template_kwargs")  # fmt: skip
    try:
        return tokenizer.apply_chat_template(
            conversation,
            chat_template=tokenizer.chat_template or DEFAULT_CHAT_TEMPLATE,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            **kwargs,
        )
    except jinja2.TemplateError as e:
        # The template's own raise_exception(...) says what the messages break; any other
        # template error (an undefined name, a type clash inside the template) speaks of the
        # template's internals and is only logged.
        if type(e) is jinja2.TemplateError and e.message:
            raise bad_request(f"the chat template rejected the messages: {e.message}",
                              param="messages") from None  # fmt: skip
        logger.info("chat template failed: %r", e)
    except Exception as e:  # a template is code: anything may come out of it
        logger.info("chat template failed: %r", e)
    raise bad_request(
        "the chat template could not render these messages (check roles, their order and the "
        "content types the model expects)",
        param="messages",
    )


def chat_text_ids(tokenizer: Any, text: str) -> list[int]:
    # The template writes the special tokens (BOS included) itself.
    return tokenizer(text, add_special_tokens=False).input_ids


def render_chat(
    tokenizer: Any,
    messages: list[ChatMessage],
    add_generation_prompt: bool = True,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """Token ids of the rendered conversation, as the server computes them (the router's
    token prefix keys and the tests use this; the server's own path moves large inputs off
    its event loop)."""
    text = render_chat_text(
        tokenizer, conversation_of(messages), add_generation_prompt, template_kwargs
    )
    return chat_text_ids(tokenizer, text)


async def render_chat_served(
    ctx: ServingContext,
    messages: list[ChatMessage],
    add_generation_prompt: bool = True,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """render_chat for the server: large conversations are rendered and tokenized off the
    event loop, and a text too long to fit the context is refused before tokenizing."""
    conversation = conversation_of(messages)
    size = sum(len(entry["content"]) for entry in conversation)
    ctx.check_prompt_chars(size, "messages")
    text = await ctx.off_loop(
        size, OFF_LOOP_CHARS, render_chat_text, ctx.tokenizer, conversation,
        add_generation_prompt, template_kwargs,
    )  # fmt: skip
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
    ctx.admit(req.model, req.n)
    ids = await render_chat_served(
        ctx, req.messages, req.add_generation_prompt, req.chat_template_kwargs
    )
    params = ctx.prepare([ids], req.requested_max_tokens, req.sampling_params)
    request_id = random_id("chatcmpl")
    created = now()
    model = req.model or ctx.model_name
    top_n = req.top_logprobs or 0
    ctx.admit(req.model, req.n)
    outputs = ctx.run(request_id, [ids], params)

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
        result = (await ctx.collect(outputs, [ids], params))[0]
        return web.json_response(
            {
                "id": request_id,
                "object": "chat.completion",
                "created": created,
                "model": model,
                "choices": [
                    {
                        "index": c.index,
                        "message": {"role": "assistant", "content": c.text},
                        "logprobs": logprobs(c),
                        "finish_reason": c.finish_reason,
                        "stop_reason": c.stop_reason,
                    }
                    for c in result.outputs
                ],
                "usage": usage(
                    sum(len(c.token_ids) for c in result.outputs), result.num_cached_tokens
                ),
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

    def to_choices(_: int, delta: RequestOutput) -> list[dict[str, Any]]:
        nonlocal completion_tokens, cached
        cached = delta.num_cached_tokens
        choices = []
        for c in delta.outputs:
            completion_tokens += len(c.token_ids)
            if nothing_to_send(c):
                continue
            choices.append(
                {
                    "index": c.index,
                    "delta": {"content": c.text} if c.text else {},
                    "logprobs": logprobs(c),
                    "finish_reason": c.finish_reason,
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
