"""POST /v1/completions."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from kvfleet.engine.outputs import CompletionOutput, RequestOutput
from kvfleet.engine.server.protocol import CompletionRequest, Usage, now, random_id
from kvfleet.engine.server.serving import SERVING, ServingContext, traced
from kvfleet.engine.server.streaming import SSEResponse, nothing_to_send, relay
from kvfleet.engine.server.validation import parse_body
from kvfleet.telemetry.genai import TEXT_COMPLETION


class _LogprobsBuilder:
    """OpenAI's legacy completions logprobs: tokens, token_logprobs, top_logprobs, text_offset."""

    def __init__(self, ctx: ServingContext, start_offset: int = 0) -> None:
        self.ctx = ctx
        self.offset = start_offset

    def build(self, choice: CompletionOutput) -> dict[str, Any] | None:
        if choice.logprobs is None:
            return None
        out: dict[str, Any] = {
            "tokens": [],
            "token_logprobs": [],
            "top_logprobs": [],
            "text_offset": [],
        }
        for token, entry in zip(choice.token_ids, choice.logprobs, strict=True):
            text = self.ctx.token_text(token)
            out["tokens"].append(text)
            out["token_logprobs"].append(entry[token])
            # As vLLM does: the top-N plus the sampled token, so up to N + 1 entries.
            out["top_logprobs"].append({self.ctx.token_text(t): lp for t, lp in entry.items()})
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        return out


def _usage(results: list[RequestOutput], completion_tokens: int) -> Usage:
    prompt_tokens = sum(len(r.prompt_token_ids) for r in results)
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details={"cached_tokens": sum(r.num_cached_tokens for r in results)},
    )


async def create_completion(request: web.Request) -> web.StreamResponse:
    ctx: ServingContext = request.app[SERVING]
    req = await parse_body(request, CompletionRequest)
    raw_prompts = req.prompts()
    num_sequences = len(raw_prompts) * req.n
    ctx.admit(req.model, num_sequences)
    for p in raw_prompts:
        if isinstance(p, str):
            ctx.check_prompt_chars(len(p), "prompt")
    prompts = [await ctx.tokenize(p) for p in raw_prompts]
    texts = [p if isinstance(p, str) else None for p in raw_prompts]
    params = ctx.prepare(prompts, req.max_tokens, req.sampling_params)
    echoes = [
        (t if t is not None else await ctx.decode(ids)) if req.echo else ""
        for t, ids in zip(texts, prompts, strict=True)
    ]
    request_id = random_id("cmpl")
    created = now()
    n = req.n
    model = req.model or ctx.model_name
    ctx.admit(req.model, num_sequences)
    outputs = traced(request, TEXT_COMPLETION, request_id, model, prompts, params,
                     ctx.run(request_id, prompts, params, texts))  # fmt: skip

    def echo_text(i: int) -> str:
        return echoes[i]

    if not req.stream:
        results = await ctx.collect(outputs, prompts, params)
        choices = []
        completion_tokens = 0
        for i, result in enumerate(results):
            for choice in result.outputs:
                completion_tokens += len(choice.token_ids)
                choices.append(
                    {
                        "index": i * n + choice.index,
                        "text": echo_text(i) + choice.text,
                        "logprobs": _LogprobsBuilder(ctx).build(choice),
                        "finish_reason": choice.finish_reason,
                        "stop_reason": choice.stop_reason,
                    }
                )
        return web.json_response(
            {
                "id": request_id,
                "object": "text_completion",
                "created": created,
                "model": model,
                "choices": choices,
                "usage": _usage(results, completion_tokens).model_dump(exclude_none=True),
            }
        )

    sse = SSEResponse(request)
    await sse.start()
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    offsets = {}
    completion_tokens = 0
    last: dict[int, RequestOutput] = {}

    def chunk(choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": request_id,
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": choices,
        }

    if req.echo:
        await sse.send(
            chunk(
                [
                    {
                        "index": i * n + j,
                        "text": echo_text(i),
                        "logprobs": None,
                        "finish_reason": None,
                    }
                    for i in range(len(prompts))
                    for j in range(n)
                ]
            )
        )

    def to_choices(i: int, delta: RequestOutput) -> list[dict[str, Any]]:
        nonlocal completion_tokens
        last[i] = delta
        choices = []
        for choice in delta.outputs:
            index = i * n + choice.index
            completion_tokens += len(choice.token_ids)
            builder = offsets.setdefault(index, _LogprobsBuilder(ctx))
            if nothing_to_send(choice):
                continue
            choices.append(
                {
                    "index": index,
                    "text": choice.text,
                    "logprobs": builder.build(choice),
                    "finish_reason": choice.finish_reason,
                    "stop_reason": choice.stop_reason,
                }
            )
        return choices

    if not await relay(sse, outputs, to_choices, chunk):
        return await sse.finish()
    if include_usage:
        results = [
            RequestOutput(
                "", ids, [], num_cached_tokens=last[i].num_cached_tokens if i in last else 0
            )
            for i, ids in enumerate(prompts)
        ]
        payload = chunk([])
        payload["usage"] = _usage(results, completion_tokens).model_dump(exclude_none=True)
        await sse.send(payload)
    return await sse.finish()
