"""JsonErrorsRunner (telemetry/http.py): what aiohttp answers itself, outside any app handler or
middleware (a request it cannot parse, a handler's unexpected exception), is in OpenAI's JSON
error shape, with no traceback, under the runner's own settings."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web

from kvfleet.telemetry.http import JsonErrorsRunner
from tests.support.servers import running


async def _broken(_request: web.Request) -> web.Response:
    raise RuntimeError("secret detail")


async def _exchange(addr: str, request: bytes) -> tuple[bytes, dict]:
    host, port = addr.split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(request)
    try:
        raw = await asyncio.wait_for(reader.read(), 5)  # the connection closes after it
    finally:
        writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    return head, json.loads(body)


@pytest.mark.asyncio
async def test_errors_outside_the_app_are_openai_json() -> None:
    app = web.Application()
    app.router.add_get("/broken", _broken)
    # A runner setting (the request-line limit) reaches the connections, as with AppRunner.
    async with running(JsonErrorsRunner(app, max_line_size=100)) as addr:
        head, body = await _exchange(addr, b"GET /broken HTTP/1.1\r\nHost: x\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 500 ") and b"application/json" in head
        assert body == {"error": {"message": "internal server error", "type": "server_error",
                                  "param": None, "code": "internal_error"}}  # fmt: skip
        head, body = await _exchange(addr, b"GET /" + b"a" * 120 + b" HTTP/1.1\r\n\r\n")
        assert b" 400 " in head.split(b"\r\n")[0]
        assert body["error"]["code"] == "line_too_long" and "100 bytes" in body["error"]["message"]
        head, body = await _exchange(addr, b"GET / HTTP/1.1\r\nX-A: a\x00b\r\n\r\n")
        assert body["error"] == {
            "message": "malformed HTTP request: Invalid header value char",
            "type": "invalid_request_error",
            "param": None,
            "code": "malformed_request",
        }
