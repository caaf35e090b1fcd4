"""What the engine's and the router's HTTP servers share for each request: its id (taken from
X-Request-Id or made, in every log line while it is served and in the response), an access log
line, and, with tracing on, a SERVER span around it."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Collection
from typing import Any

from aiohttp import web

from kvfleet.telemetry.logs import REQUEST_ID, REQUEST_ID_HEADER, request_id_from
from kvfleet.telemetry.tracing import Tracing

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# The request's span, for handlers that add attributes to it (absent without tracing).
SPAN = web.RequestKey[Any]("kvfleet_span")
_ID = web.RequestKey("kvfleet_request_id", str)


def observe_requests(
    tracing: Tracing | None, access_log: logging.Logger, quiet_paths: Collection[str]
) -> Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]:
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
