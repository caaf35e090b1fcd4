"""The router's own bounds on a request body: its size, and the JSON limits it parses with.

The router parses every body (for its routing key) before any engine sees it, so a body that
would cost it unbounded work, or that no engine can accept, is refused here with a 4xx in the
OpenAI error shape; the parsing itself is kvfleet.protocol's, the engine's own. The router bounds
only what parsing costs (nesting, number length), never ranges of values: those are the engine's
to judge, and an engine of another version may accept what this one would not. The size limit is
the router's: the engine's web server enforces its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvfleet.protocol.json_body import JsonLimits, RequestRefused, decode_json


@dataclass(frozen=True)
class BodyLimits:
    max_bytes: int = 16 << 20
    max_depth: int = JsonLimits.max_depth

    @property
    def json(self) -> JsonLimits:
        return JsonLimits(max_depth=self.max_depth)


def parse_json_body(body: bytes, limits: BodyLimits) -> Any:
    """The parsed body (None when empty), or :class:`RequestRefused` saying what is wrong."""
    if not body:
        return None
    if len(body) > limits.max_bytes:
        raise too_large(limits.max_bytes)
    return decode_json(body, limits.json)


def too_large(max_bytes: int) -> RequestRefused:
    return RequestRefused(
        413, f"the request body is larger than {max_bytes} bytes", "request_too_large"
    )


def check_content_length(value: int | None, limits: BodyLimits) -> None:
    """Refuse a declared oversized body before reading any of it."""
    if value is not None and value > limits.max_bytes:
        raise too_large(limits.max_bytes)
