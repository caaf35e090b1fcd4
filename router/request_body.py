"""The router's own bounded reading of a request: headers, then the JSON body.

The router parses every body (for its routing key) before any engine sees it, so a body that
would cost it unbounded work, or that no engine can accept, is refused here with a 4xx in the
OpenAI error shape instead of reaching the parser's limits (a RecursionError at a few thousand
levels of nesting, Python's 4,300-digit integer limit) as a 500. The engine has the same bounds
in its own code; this module must not import the engine package (the router runs in the
operator image, which has no torch).

Checks, in order: header values are UTF-8; ``Content-Encoding`` is absent or ``identity``
(nothing is decompressed: no gzip bombs, and the bytes forwarded are the bytes checked); the
body fits ``max_bytes``; it is UTF-8; its nesting depth is at most ``max_depth``, measured
without recursion before parsing; each number literal is at most ``max_number_chars`` long and
finite; strings (keys included) hold no lone surrogates (``"\\ud800"`` is valid JSON but no
valid text, and fails later when encoded).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

# Strings removed before the structure is measured: brackets inside them are text.
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
# Openers become "(" and closers ")"; every other byte is deleted.
_BRACKETS = bytes.maketrans(b"[{]}", b"(())")
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


@dataclass(frozen=True)
class BodyLimits:
    max_bytes: int = 16 << 20
    max_depth: int = 64
    # Enough for any 64-bit integer or double written out in full; the engine checks ranges.
    max_number_chars: int = 100


class BadRequest(ValueError):
    """A request the router refuses: an HTTP status and an OpenAI-style error."""

    def __init__(self, status: int, message: str, code: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param


def check_headers(raw_headers: Iterable[tuple[bytes, bytes]]) -> None:
    """Header values must be UTF-8 (aiohttp hands undecodable bytes on as surrogates, which
    fail wherever the value is used: hashing a session id, forwarding, comparing a key)."""
    for name, value in raw_headers:
        if value.isascii():
            continue
        try:
            value.decode("utf-8")
        except UnicodeDecodeError:
            header = name.decode("latin-1")
            raise BadRequest(
                400, f"the value of header {header} is not valid UTF-8", "invalid_header", header
            ) from None


def check_content_encoding(value: str | None) -> None:
    if value is not None and value.strip().lower() not in ("", "identity"):
        raise BadRequest(
            415,
            f"Content-Encoding {value!r} is not supported: send the body uncompressed",
            "unsupported_content_encoding",
        )


def nesting_exceeds(body: bytes, max_depth: int) -> bool:
    """Whether the JSON text nests deeper than ``max_depth`` (or its brackets do not pair up).

    Iterative: each pass deletes the innermost bracket pairs, so a structure of depth d is
    gone after d passes; brackets left after ``max_depth`` passes mean too deep."""
    structure = _STRING.sub(b"", body).translate(_BRACKETS, _NOT_BRACKETS)
    for _ in range(max_depth):
        if not structure:
            return False
        shorter = structure.replace(b"()", b"")
        if len(shorter) == len(structure):
            return True  # no innermost pair: unbalanced
        structure = shorter
    return bool(structure)


def _lone_surrogate(text: str) -> bool:
    if text.isascii():
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _find_lone_surrogate(value: Any) -> bool:
    """Any string (or key) with a lone surrogate, walked with an explicit stack."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if _lone_surrogate(item):
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


def parse_json_body(body: bytes, limits: BodyLimits) -> Any:
    """The parsed body (None when empty), or :class:`BadRequest` saying what is wrong."""
    if not body:
        return None
    if len(body) > limits.max_bytes:
        raise too_large(limits.max_bytes)
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadRequest(400, f"the request body is not valid UTF-8 (byte {e.start})",
                         "invalid_unicode") from None  # fmt: skip
    if nesting_exceeds(body, limits.max_depth):
        raise BadRequest(
            400,
            f"the request body nests deeper than {limits.max_depth} levels",
            "nesting_too_deep",
        )

    def number(literal: str, convert: type[int] | type[float]) -> int | float:
        if len(literal) > limits.max_number_chars:
            raise BadRequest(
                400,
                f"a number in the request body has {len(literal)} characters; at most "
                f"{limits.max_number_chars} are accepted",
                "number_too_long",
            )
        value = convert(literal)
        if isinstance(value, float) and not math.isfinite(value):
            raise BadRequest(400, f"the number {literal} is out of range", "number_out_of_range")
        return value

    def constant(name: str) -> float:
        raise BadRequest(400, f"{name} is not valid JSON", "invalid_json")

    try:
        parsed = json.loads(
            text,
            parse_int=lambda s: number(s, int),
            parse_float=lambda s: number(s, float),
            parse_constant=constant,
        )
    except json.JSONDecodeError as e:
        raise BadRequest(400, f"the request body is not valid JSON: {e}", "invalid_json") from None
    if _find_lone_surrogate(parsed):
        raise BadRequest(
            400,
            "the request body holds a lone UTF-16 surrogate escape (e.g. \\ud800), which is "
            "not valid Unicode text",
            "invalid_unicode",
        )
    return parsed


def too_large(max_bytes: int) -> BadRequest:
    return BadRequest(
        413, f"the request body is larger than {max_bytes} bytes", "request_too_large"
    )


def check_content_length(value: int | None, limits: BodyLimits) -> None:
    """Refuse a declared oversized body before reading any of it."""
    if value is not None and value > limits.max_bytes:
        raise too_large(limits.max_bytes)
