"""POST /v1/embeddings, as OpenAI's API: `input` (a string, strings, token ids or lists of token
ids) in, one vector per input out, as floats or base64 (little-endian float32, which the openai
SDK asks for by default); `dimensions` truncates (Matryoshka) where the model allows it. Served
by an embedding model (--runner pooling); a generative model answers 400."""

from __future__ import annotations

import base64
from contextlib import aclosing
from typing import Literal

import numpy as np
from aiohttp import web
from pydantic import Field, field_validator

from kvfleet.engine.request import InvalidRequestError
from kvfleet.engine.server.errors import ENGINE_ERRORS, bad_request, engine_error
from kvfleet.engine.server.openai_requests import Prompt, _Strict
from kvfleet.engine.server.openai_responses import ResponseModel, random_id
from kvfleet.engine.server.serving import SERVING, Admitted, ServingContext
from kvfleet.engine.server.validation import parse_body
from kvfleet.telemetry.genai import EMBEDDINGS, GenAISpan
from kvfleet.telemetry.http import SPAN

# Inputs in one request: OpenAI's own cap (each input is a sequence the engine queues, so the
# server's --max-waiting-requests bounds a request further where it is set).
MAX_EMBEDDING_INPUTS = 2048
# A bound on the number itself, past any model's width; the model's own is checked at admission.
MAX_DIMENSIONS = 65536


class EmbeddingRequest(_Strict):
    input: Prompt
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1, le=MAX_DIMENSIONS)
    # Accepted as OpenAI's API does (the router does not key on it here); nothing is kept.
    user: str | None = None

    @field_validator("input")
    @classmethod
    def _check_input(cls, value: str | list[str] | list[int] | list[list[int]]) -> object:
        inputs = _as_list(value)
        if not inputs or any(len(i) == 0 for i in inputs):
            raise ValueError("must not be empty, nor hold an empty string or token list")
        if len(inputs) > MAX_EMBEDDING_INPUTS:
            raise ValueError(f"at most {MAX_EMBEDDING_INPUTS} inputs are allowed in one request")
        return value

    def inputs(self) -> list[str | list[int]]:
        return _as_list(self.input)


def _as_list(value: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    """The inputs one by one: a string or a token-id list alone is one input."""
    if isinstance(value, str):
        return [value]
    if value and isinstance(value[0], int):
        return [value]  # type: ignore[list-item]
    return list(value)  # type: ignore[arg-type]


class Embedding(ResponseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(ResponseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(ResponseModel):
    id: str
    object: Literal["list"] = "list"
    model: str
    data: list[Embedding]
    usage: EmbeddingUsage


def encode(vector: list[float], encoding_format: str) -> list[float] | str:
    """A vector as the request asked for it: floats, or base64 of its float32 bytes,
    little-endian, as OpenAI sends them."""
    if encoding_format == "float":
        return vector
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")


async def create_embedding(request: web.Request) -> web.StreamResponse:
    ctx: ServingContext = request.app[SERVING]
    req = await parse_body(request, EmbeddingRequest)
    raw_inputs = req.inputs()
    ctx.check_can_queue(req.model, len(raw_inputs))
    if ctx.engine.runner != "pooling":
        # Said before any tokenizing, as admission would say it after.
        raise bad_request(
            "this model generates text; embeddings need an embedding model, served with "
            "--runner pooling",
            param="model",
            code="model_not_supported",
        )
    for p in raw_inputs:
        if isinstance(p, str):
            ctx.check_prompt_chars(len(p), "input")
    prompts = [await ctx.tokenize(p) for p in raw_inputs]
    requests = []
    for ids, raw in zip(prompts, raw_inputs, strict=True):
        text = raw if isinstance(raw, str) else None
        try:
            requests.append(ctx.engine.admit_embedding(ids, req.dimensions, text))
        except InvalidRequestError as e:
            raise bad_request(str(e), param=e.param, code=e.code) from None
    request_id = random_id("embd")
    model = req.model or ctx.model_name
    # Traced as chat and completions are: an admitted request's span carries the GenAI names.
    span = request.get(SPAN)
    gen = None if span is None else GenAISpan(span, EMBEDDINGS, model)
    if gen is not None:
        gen.embeddings_request(encoding_format=req.encoding_format)
    outputs = await ctx.run(request_id, Admitted(requests, [None] * len(requests), "input"))
    vectors: list[list[float] | None] = [None] * len(requests)
    try:
        async with aclosing(outputs) as it:
            async for i, out in it:
                if out.embedding is not None:
                    vectors[i] = out.embedding
    except ENGINE_ERRORS as e:
        raise engine_error(e) from None
    data = []
    width = 0
    for i, vector in enumerate(vectors):
        # Every stream ends with its request's output or raises: a missing vector is a bug.
        assert vector is not None, f"input {i} ended without an embedding"
        width = len(vector)
        data.append(Embedding(index=i, embedding=encode(vector, req.encoding_format)))
    num_tokens = sum(len(ids) for ids in prompts)
    if gen is not None:
        gen.embeddings_response(model=model, input_tokens=num_tokens, dimensions=width)
    body = EmbeddingList(
        id=request_id,
        model=model,
        data=data,
        usage=EmbeddingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens),
    )
    return web.json_response(text=body.model_dump_json())
