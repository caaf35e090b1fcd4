"""Turning an HTTP body into a validated request."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, TypeVar

from aiohttp import web
from pydantic import BaseModel, ValidationError

from kvfleet.engine.server.errors import APIError, bad_request
from kvfleet.protocol.json_body import (
    OFF_LOOP_BYTES,
    JsonLimits,
    RequestRefused,
    check_content_length,
    decode_json,
)

M = TypeVar("M", bound=BaseModel)

# Bounds past the router's (which only bounds what its parsing costs): every integer of the API
# fits 64 bits, so a longer one is refused before validation; and validation holds the GIL
# throughout (one call into pydantic-core, ~70 ns a token id), which stalls the event loop even
# from a thread, so the count of values is bounded too: 2**18 token ids validate in ~20 ms.
MAX_JSON_ITEMS = 1 << 18
JSON_LIMITS = JsonLimits(max_depth=64, max_int_digits=20, max_values=MAX_JSON_ITEMS)
BODY_TIMEOUT = web.AppKey("body_timeout", float)
BODY_LIMIT = web.AppKey("body_limit", int)
# The size of the request's body: work that grows with it (planning its tool calls) leaves the
# event loop past OFF_LOOP_BYTES, as decoding does.
BODY_BYTES = web.RequestKey("body_bytes", int)


# Decoding, validating and planning a large request (JSON, tool calls, a chat template) is
# Python work that holds the GIL: more threads add nothing to its throughput, and several at
# once starve the event loop of the GIL, which waits its turn behind each (six 16 MiB requests
# parsed together stalled /health for 0.6 s). One thread does all of it, so the loop waits
# behind one at most. (Tokenizing, whose Rust code lets the GIL go, keeps its threads.)
_PARSE_THREAD = ThreadPoolExecutor(1, thread_name_prefix="kvfleet-parse")


async def in_parse_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args) on the parse thread, in the caller's context (its request id, for logs)."""
    context = contextvars.copy_context()
    call = partial(context.run, fn, *args)
    return await asyncio.get_running_loop().run_in_executor(_PARSE_THREAD, call)


def refused(e: RequestRefused, close_connection: bool = False) -> APIError:
    """The server's error response for a request the shared protocol code refused."""
    return APIError(
        e.status, e.message, param=e.param, code=e.code, close_connection=close_connection
    )


async def parse_body(request: web.Request, model: type[M]) -> M:
    """Read (within the body deadline), decode off the event loop, and validate a JSON body."""
    try:
        check_content_length(request.content_length, request.app[BODY_LIMIT])
    except RequestRefused as e:
        # Nothing of the body is read: the connection cannot serve another request.
        raise refused(e, close_connection=True) from None
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
    request[BODY_BYTES] = len(raw)
    # Validating a large body stalls the loop as decoding does: both go to the thread.
    if len(raw) > OFF_LOOP_BYTES:
        return await in_parse_thread(_validate, raw, model)
    return _validate(raw, model)


def _validate(raw: bytes, model: type[M]) -> M:
    try:
        data = decode_json(raw, JSON_LIMITS)
    except RequestRefused as e:
        raise refused(e) from None
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from None


@contextlib.contextmanager
def invalid_as_400() -> Iterator[None]:
    """A ValidationError raised inside (building a request's sampling parameters) is that
    request's 400."""
    try:
        yield
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
