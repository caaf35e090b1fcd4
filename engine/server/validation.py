"""Turning an HTTP body into a validated request, and the checks that need the engine's limits."""

from __future__ import annotations

import json
from typing import TypeVar

from aiohttp import web
from pydantic import BaseModel, ValidationError

from kvfleet.engine.server.errors import APIError, bad_request

M = TypeVar("M", bound=BaseModel)


async def parse_body(request: web.Request, model: type[M]) -> M:
    raw = await request.read()
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad_request(f"the request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from None


def validation_error(e: ValidationError) -> APIError:
    first = e.errors()[0]
    param = ".".join(str(p) for p in first["loc"]) or None
    if first["type"] == "extra_forbidden":
        message = f"Unrecognized request argument supplied: {param}"
    else:
        msg = first["msg"].removeprefix("Value error, ")
        message = f"{param}: {msg}" if param else msg
    return bad_request(message, param=param)


def check_model(requested: str | None, served: list[str]) -> None:
    if requested is not None and requested not in served:
        raise APIError(
            404,
            f"The model `{requested}` does not exist. Served: {', '.join(served)}",
            "not_found_error",
            "model",
            "model_not_found",
        )


def resolve_max_tokens(num_prompt_tokens: int, requested: int | None, max_model_len: int) -> int:
    """The completion budget for a prompt, or a 400 saying why the request cannot fit."""
    if num_prompt_tokens >= max_model_len:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"prompt has {num_prompt_tokens} tokens, leaving no room for a completion.",
            param="messages" if requested is None else "prompt",
            code="context_length_exceeded",
        )
    room = max_model_len - num_prompt_tokens
    if requested is None:
        return room
    if requested > room:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {num_prompt_tokens + requested} tokens ({num_prompt_tokens} in the "
            f"prompt, {requested} for the completion). Reduce the prompt or max_tokens.",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return requested
