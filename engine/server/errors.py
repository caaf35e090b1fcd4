"""Errors in OpenAI's JSON shape: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

from aiohttp import web


def error_response(
    status: int,
    message: str,
    err_type: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> web.Response:
    body = {"error": {"message": message, "type": err_type, "param": param, "code": code}}
    return web.json_response(body, status=status, headers=headers)


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        err_type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type
        self.param = param
        self.code = code
        self.headers = headers

    def response(self) -> web.Response:
        return error_response(
            self.status, self.message, self.err_type, self.param, self.code, self.headers
        )

    def sse_payload(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.err_type,
                "param": self.param,
                "code": self.code,
            }
        }


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)
