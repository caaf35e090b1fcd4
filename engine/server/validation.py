"""Turning an HTTP body into a validated request, and the checks that need the engine's limits."""

from __future__ import annotations

import asyncio
import json
import re
from itertools import accumulate
from typing import Any, TypeVar

from aiohttp import web
from pydantic import BaseModel, ValidationError

from kvfleet.engine.server.errors import APIError, bad_request

M = TypeVar("M", bound=BaseModel)

# JSON bounds: deeper nesting than any real request needs would make json.loads recurse until
# RecursionError; longer integers than 64 bits need cost quadratic time to convert (and Python
# refuses > 4300 digits outright).
MAX_JSON_DEPTH = 64
MAX_INT_DIGITS = 20
# Validation holds the GIL throughout (one call into pydantic-core, ~70 ns a token id), which
# stalls the event loop even from a thread, so the count of values is bounded too: 2**18 token
# ids validate in ~20 ms.
MAX_JSON_ITEMS = 1 << 18
BODY_TIMEOUT = web.AppKey("body_timeout", float)

_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_NOT_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")
_DEPTH_STEP = {ord("["): 1, ord("{"): 1, ord("]"): -1, ord("}"): -1}


def json_shape(raw: bytes) -> tuple[int, int]:
    """(deepest nesting, number of separators) of a JSON text, found without recursion and
    without parsing: strings are cut out (their brackets and commas do not count), then the
    running count of the brackets left. An unterminated string leaves its brackets in, which
    can only overstate the shape of a text json.loads refuses anyway. Counted with the strings
    in first: that overstates both, and is all a body with few brackets and commas needs (the
    string cutting is the one step that takes tens of milliseconds on a large body)."""
    brackets = raw.translate(None, _NOT_BRACKET)
    items = raw.count(b",")
    if len(brackets) <= 2 * MAX_JSON_DEPTH and items <= MAX_JSON_ITEMS:
        return len(brackets), items
    structure = _STRING.sub(b"", raw)
    items = structure.count(b",")
    brackets = structure.translate(None, _NOT_BRACKET)
    if len(brackets) <= 2 * MAX_JSON_DEPTH:
        return len(brackets), items
    return max(accumulate(map(_DEPTH_STEP.__getitem__, brackets)), default=0), items


def _parse_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise ValueError(f"the integer {text[:24]}... is too long (at most 64-bit integers)")
    return int(text)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def decode_json(raw: bytes) -> Any:
    """Parse a request body strictly: UTF-8 only, no lone surrogates (escaped or not), bounded
    nesting and integers, no NaN/Infinity. Raises APIError 400 saying what is wrong."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad_request(
            f"the request body is not valid UTF-8: {e.reason} at byte {e.start}"
        ) from None
    depth, items = json_shape(raw)
    if depth > MAX_JSON_DEPTH:
        raise bad_request(f"the request body nests deeper than {MAX_JSON_DEPTH} levels")
    if items > MAX_JSON_ITEMS:
        raise bad_request(f"the request body holds more than {MAX_JSON_ITEMS} values")
    try:
        data = json.loads(text, parse_int=_parse_int, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:
        raise bad_request(f"the request body is not valid JSON: {e}") from None
    if _SURROGATE_ESCAPE.search(raw) is None:
        return data
    try:
        # A "\ud800" escape decodes to a lone surrogate, which no tokenizer can encode (paired
        # ones decode to one character and pass).
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise bad_request(
            "the request body contains invalid Unicode (a lone surrogate escape)"
        ) from None
    return data


async def parse_body(request: web.Request, model: type[M]) -> M:
    """Read (within the body deadline), decode off the event loop, and validate a JSON body."""
    try:
        async with asyncio.timeout(request.app[BODY_TIMEOUT]):
            raw = await request.read()
    except TimeoutError:
        raise APIError(
            408,
            "the request body was not received in time",
            code="body_timeout",
            close_connection=True,  # the rest of the body may still come: do not read it
        ) from None
    # Decoding and validating a body of many megabytes takes long enough to stall every other
    # connection: large ones go to a thread.
    if len(raw) > 64 * 1024:
        return await asyncio.to_thread(_validate, raw, model)
    return _validate(raw, model)


def _validate(raw: bytes, model: type[M]) -> M:
    data = decode_json(raw)
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
