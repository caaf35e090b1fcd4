"""Errors in OpenAI's JSON shape: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from kvfleet.engine.async_engine import EngineDeadError, RequestAbortedError, RequestFailedError
from kvfleet.telemetry.http import openai_error, openai_error_body

# What a request's output stream may raise once the engine has it.
ENGINE_ERRORS = (EngineDeadError, RequestFailedError, RequestAbortedError)


def error_response(
    status: int,
    message: str,
    err_type: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> web.Response:
    """The engine's errors, with its defaults, in the shape every kvfleet process answers."""
    return openai_error(status, message, err_type, code=code, param=param, headers=headers)


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        err_type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
        close_connection: bool = False,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type
        self.param = param
        self.code = code
        self.headers = headers
        self.close_connection = close_connection

    def response(self) -> web.Response:
        resp = error_response(
            self.status, self.message, self.err_type, self.param, self.code, self.headers
        )
        if self.close_connection:
            resp.force_close()
        return resp

    def body(self) -> dict[str, Any]:
        """The error's JSON: a response's body, or the last event of a stream."""
        return openai_error_body(self.message, self.err_type, self.code, self.param)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def engine_error(e: Exception) -> APIError:
    """The HTTP error for a request the engine could not finish (one of ENGINE_ERRORS)."""
    if isinstance(e, RequestFailedError):
        if e.param is not None:  # the request's own fault, found as it ran
            return APIError(400, str(e), param=e.param)
        return APIError(500, str(e), "server_error", code="request_failed")
    if isinstance(e, RequestAbortedError):
        # Aborted by a shutting-down server; a non-streamed one sent nothing to the client yet,
        # so another engine may serve it.
        return APIError(503, str(e), "service_unavailable", code="draining",
                        headers={"Retry-After": "5"})  # fmt: skip
    return APIError(503, str(e), "service_unavailable", code="engine_dead")
