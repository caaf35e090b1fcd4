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

Logprobs = list[dict[int, float] | None]


class _LogprobsBuilder:
    """OpenAI's legacy completions logprobs: tokens, token_logprobs, top_logprobs, text_offset,
    the offsets running on across a choice's chunks."""

    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx
        self.offset = 0

    def build(self, token_ids: list[int], logprobs: Logprobs) -> dict[str, Any]:
        out: dict[str, Any] = {
            "tokens": [],
            "token_logprobs": [],
            "top_logprobs": [],
            "text_offset": [],
        }
        for token, entry in zip(token_ids, logprobs, strict=True):
            text = self.ctx.token_text(token)
            out["tokens"].append(text)
            # An echoed prompt's first token: nothing predicts it, null as in OpenAI's API.
            out["token_logprobs"].append(None if entry is None else entry[token])
            # As vLLM does: the top-N plus the sampled token, so up to N + 1 entries.
            out["top_logprobs"].append(
                None if entry is None else {self.ctx.token_text(t): lp for t, lp in entry.items()}
            )
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        return out


def vllm_prompt_logprobs(ctx: ServingContext, logprobs: Logprobs) -> list[Any]:
    """vLLM's `prompt_logprobs` field: per prompt token None or {token id: {logprob,
    decoded_token}}."""
    return [
        None
        if entry is None
        else {
            str(t): {"logprob": lp, "decoded_token": ctx.token_text(t)} for t, lp in entry.items()
        }
        for entry in logprobs
    ]


def _choice(
    ctx: ServingContext,
    req: CompletionRequest,
    index: int,
    echo: str | None,
    prompt: RequestOutput,
    choice: CompletionOutput,
    builder: _LogprobsBuilder,
) -> dict[str, Any]:
    """One choice, or one chunk of it. `echo`: the prompt's text, which this choice's first
    chunk carries (with its logprobs, from `prompt`, when asked); None in later chunks. With
    max_tokens 0 the token the engine generated is dropped: only the prompt is scored."""
    scoring_only = req.max_tokens == 0
    text = "" if scoring_only else choice.text
    tokens: list[int] = []
    logprobs: Logprobs = []
    if echo is not None:
        text = echo + text
        if req.echo and req.logprobs is not None and prompt.prompt_logprobs is not None:
            tokens, logprobs = list(prompt.prompt_token_ids), list(prompt.prompt_logprobs)
    if not scoring_only and choice.logprobs is not None:
        tokens += choice.token_ids
        logprobs += choice.logprobs
    body: dict[str, Any] = {
        "index": index,
        "text": text,
        "logprobs": builder.build(tokens, logprobs) if req.logprobs is not None else None,
        "finish_reason": "length" if scoring_only else choice.finish_reason,
        "stop_reason": None if scoring_only else choice.stop_reason,
    }
    if req.prompt_logprobs is not None and echo is not None and prompt.prompt_logprobs:
        body["prompt_logprobs"] = vllm_prompt_logprobs(ctx, prompt.prompt_logprobs)
    return body


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
    ctx.check_can_queue(req.model, num_sequences)
    for p in raw_prompts:
        if isinstance(p, str):
            ctx.check_prompt_chars(len(p), "prompt")
    prompts = [await ctx.tokenize(p) for p in raw_prompts]
    texts = [p if isinstance(p, str) else None for p in raw_prompts]
    # max_tokens 0 (echo only) still runs one step: the prompt's last position samples.
    scoring_only = req.max_tokens == 0
    admitted = ctx.admit_prompts(
        prompts,
        1 if scoring_only else req.max_tokens,
        req.sampling_params,
        texts,
        prompt_param="prompt",
        constraint_param=req.constraint[1],
    )
    echoes = [
        (t if t is not None else await ctx.decode(ids)) if req.echo else ""
        for t, ids in zip(texts, prompts, strict=True)
    ]
    request_id = random_id("cmpl")
    created = now()
    n = req.n
    model = req.model or ctx.model_name
    outputs = await ctx.run(request_id, admitted)
    outputs = traced(request, TEXT_COMPLETION, request_id, model, admitted.requests, outputs)

    if not req.stream:
        results = await ctx.collect(outputs, admitted.requests)
        choices = []
        completion_tokens = 0
        for i, result in enumerate(results):
            for choice in result.outputs:
                completion_tokens += 0 if scoring_only else len(choice.token_ids)
                index = i * n + choice.index
                builder = _LogprobsBuilder(ctx)
                choices.append(_choice(ctx, req, index, echoes[i], result, choice, builder))
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
    scored: dict[int, RequestOutput] = {}

    def chunk(choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": request_id,
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": choices,
        }

    def to_choices(i: int, delta: RequestOutput) -> list[dict[str, Any]]:
        nonlocal completion_tokens
        last[i] = delta
        # The prompt's logprobs come once, with its first choice's first token.
        if delta.prompt_logprobs is not None:
            scored[i] = delta
        choices = []
        for choice in delta.outputs:
            index = i * n + choice.index
            completion_tokens += 0 if scoring_only else len(choice.token_ids)
            # A choice's first chunk carries the echoed prompt (and its logprobs, which come
            # with the first token).
            first = index not in offsets
            builder = offsets.setdefault(index, _LogprobsBuilder(ctx))
            if not first and nothing_to_send(choice):
                continue
            echo = echoes[i] if first else None
            choices.append(_choice(ctx, req, index, echo, scored.get(i, delta), choice, builder))
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
