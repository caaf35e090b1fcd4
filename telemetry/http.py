"""What the engine's and the router's HTTP servers share for each request: its id (taken from
X-Request-Id or made, in every log line while it is served and in the response), an access log
line, with tracing on a SERVER span around it, and errors in OpenAI's JSON shape, those aiohttp
answers before any handler runs (a request it cannot parse) included."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Collection, Mapping
from http import HTTPStatus
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError, LineTooLong
from aiohttp.typedefs import Middleware
from aiohttp.web_protocol import RequestHandler

from kvfleet.telemetry.logs import REQUEST_ID, REQUEST_ID_HEADER, request_id_from
from kvfleet.telemetry.tracing import Tracing

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# The request's span, for handlers that add attributes to it (absent without tracing).
SPAN = web.RequestKey[Any]("kvfleet_span")
_ID = web.RequestKey("kvfleet_request_id", str)


def observe_requests(
    tracing: Tracing | None, access_log: logging.Logger, quiet_paths: Collection[str]
) -> Middleware:
    """The outermost middleware. quiet_paths (probes, scrapes) get a request id but neither an
    access line nor a span: they come every few seconds and say nothing about traffic."""

    @web.middleware
    async def observe(request: web.Request, handler: Handler) -> web.StreamResponse:
        request[_ID] = request_id_from(request.headers.get(REQUEST_ID_HEADER))
        # Each request runs in a task of its own, so this is seen by its handler alone.
        REQUEST_ID.set(request[_ID])
        if request.path in quiet_paths:
            return await handler(request)
        started = time.monotonic()
        status = "error"
        try:
            if tracing is None:
                response = await handler(request)
            else:
                attributes = {"http.request.method": request.method, "url.path": request.path}
                name = f"{request.method} {request.path}"
                with tracing.server_span(name, request.headers, attributes) as span:
                    request[SPAN] = span
                    response = await handler(request)
                    span.set_attribute("http.response.status_code", response.status)
            status = str(response.status)
            return response
        except asyncio.CancelledError:
            status = "cancelled"  # the client went away
            raise
        except web.HTTPException as e:
            status = str(e.status)
            raise
        finally:
            access_log.info("%s %s %s %.3fs", request.method, request.path, status,
                            time.monotonic() - started)  # fmt: skip

    return observe


async def echo_request_id(request: web.Request, response: web.StreamResponse) -> None:
    """An on_response_prepare signal: the request id goes back in X-Request-Id, streams
    included (their headers leave before the handler returns)."""
    if _ID in request:
        response.headers[REQUEST_ID_HEADER] = request[_ID]


def openai_error(
    status: int,
    message: str,
    err_type: str,
    code: str | None = None,
    param: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> web.Response:
    """An error in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, which
    clients handle the same way whichever process answered."""
    body = {"error": {"message": message, "type": err_type, "param": param, "code": code}}
    return web.json_response(body, status=status, headers=headers)


# A parser's explanation is its first line: the rest quotes the client's bytes back.
_MAX_EXPLANATION = 200


def protocol_error(status: int, exc: BaseException | None) -> tuple[str, str, str]:
    """(message, type, code) of an error aiohttp answers itself: 400 for a request it could not
    parse (bad framing, a request line or header over its limit, too many headers), 504 for a
    handler's TimeoutError, 500 for any other unexpected exception in a handler (no detail: that
    is for the log)."""
    if status == HTTPStatus.GATEWAY_TIMEOUT:
        return "the request timed out", "server_error", "timeout"
    if status >= 500:
        return "internal server error", "server_error", "internal_error"
    if isinstance(exc, LineTooLong):
        return (
            f"the request line or a header field is longer than {exc.args[1]} bytes",
            "invalid_request_error",
            "line_too_long",
        )
    if isinstance(exc, HttpProcessingError) and exc.message:
        explanation = exc.message.splitlines()[0].rstrip(":")[:_MAX_EXPLANATION]
    else:
        explanation = "unparsable"
    return f"malformed HTTP request: {explanation}", "invalid_request_error", "malformed_request"


class _JsonErrorsHandler(RequestHandler):
    """A connection whose own error answers (aiohttp's, before or around the app) are JSON."""

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        text, err_type, code = protocol_error(status, exc)
        if status >= 500:
            self.log_exception("Error handling request from %s", request.remote, exc_info=exc)
        else:
            # The client's mistake, not the server's: one line, no traceback.
            self.logger.info("%s from %s", text, request.remote)
        if request.writer.output_size > 0:
            # A response began already: the connection can only be cut (aiohttp does so).
            raise ConnectionError("a response was already sent; no error response can follow")
        response = openai_error(status, text, err_type, code)
        response.force_close()
        return response


class _JsonErrorsServer(web.Server):
    def __call__(self) -> RequestHandler:
        return _JsonErrorsHandler(self, loop=self._loop, **self._kwargs)


class JsonErrorsRunner(web.AppRunner):
    """An AppRunner whose errors outside the app are in OpenAI's JSON shape, not aiohttp's plain
    text: requests it cannot parse (each answered 400 and the connection closed: framing is lost),
    and a handler's unexpected exception (500). The app's own middleware shapes everything else.
    """

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        # The app's server, its settings (keep-alive, limits, lingering) carried over.
        return _JsonErrorsServer(
            server.request_handler,
            request_factory=server.request_factory,
            handler_cancellation=server.handler_cancellation,
            **server._kwargs,
        )
