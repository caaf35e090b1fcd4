"""Reading a request body as the engine's server and the router both must: bounded, strict JSON,
and the header checks that come before it.

Each refusal is a :class:`RequestRefused` (HTTP status, OpenAI-style code, message, parameter);
each process turns it into its own error response. Checks, in order: the body is UTF-8; it nests
at most ``max_depth`` deep and holds at most ``max_values`` values, both measured without
recursion before parsing (``json.loads`` recurses, so a few thousand levels would end in a
RecursionError); each number literal is at most :data:`MAX_NUMBER_CHARS` long (Python converts
long integers in quadratic time and refuses more than 4,300 digits), each integer at most
``max_int_digits`` digits, each float finite; ``NaN`` and ``Infinity`` are not JSON; no string or
key holds a lone surrogate (``"\\ud800"`` is valid JSON but no valid text: no tokenizer can encode
it, and it fails wherever it is hashed or forwarded).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

# Enough for any 64-bit integer or double as serializers write them; what a longer literal
# would cost to convert is the bound, not its range (the engine's schema judges ranges).
MAX_NUMBER_CHARS = 100
# Decoding a larger body takes long enough to stall every other connection of the process, so
# both processes decode it in a thread (a worst-case 16 MiB body takes about a second).
OFF_LOOP_BYTES = 64 << 10

# A JSON string, escapes included; DOTALL so that an escaped newline (invalid, but it must not
# shift where strings end) is inside it, as for the JSON scanner.
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_NOT_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")
_DEPTH_STEP = {ord("["): 1, ord("{"): 1, ord("]"): -1, ord("}"): -1}


@dataclass(frozen=True)
class JsonLimits:
    max_depth: int = 64
    # None: integers as long as MAX_NUMBER_CHARS allows (their range is someone else's to judge).
    max_int_digits: int | None = None
    # None: as many values as fit in the body.
    max_values: int | None = None


class RequestRefused(Exception):
    """A request refused for its form: an HTTP status and an OpenAI-style error."""

    def __init__(
        self, status: int, message: str, code: str | None = None, param: str | None = None
    ) -> None:
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
            raise RequestRefused(
                400, f"the value of header {header} is not valid UTF-8", "invalid_header", header
            ) from None


def check_content_encoding(value: str | None) -> None:
    """Nothing is decompressed: no gzip bombs, and the bytes checked are the bytes used."""
    if value is not None and value.strip().lower() not in ("", "identity"):
        raise RequestRefused(
            415,
            f"Content-Encoding {value!r} is not supported: send the body uncompressed",
            "unsupported_content_encoding",
            "Content-Encoding",
        )


def json_shape(body: bytes, max_depth: int, max_values: int | None) -> tuple[bool, bool]:
    """(nests deeper than ``max_depth``, holds more than ``max_values`` values) for a JSON text,
    found without parsing: the running count of its brackets and the count of its commas, once
    strings are cut out (their brackets and commas are text). Counted with the strings still in
    first, the openers bound the depth and the commas the values from above, which settles
    almost every body: cutting the strings is the one step that takes tens of milliseconds on a
    large one. An unterminated string leaves its brackets in, which can only overstate the shape
    of a text json.loads refuses anyway."""
    deep = body.count(b"[") + body.count(b"{") > max_depth
    many = max_values is not None and body.count(b",") > max_values
    if not (deep or many):
        return False, False
    structure = _STRING.sub(b"", body)
    if deep:
        brackets = structure.translate(None, _NOT_BRACKET)
        deep = max(accumulate(map(_DEPTH_STEP.__getitem__, brackets)), default=0) > max_depth
    if many and max_values is not None:
        many = structure.count(b",") > max_values
    return deep, many


def nesting_exceeds(body: bytes, max_depth: int) -> bool:
    return json_shape(body, max_depth, None)[0]


def _number_parsers(limits: JsonLimits) -> tuple[Any, Any]:
    def length(literal: str) -> None:
        if len(literal) > MAX_NUMBER_CHARS:
            raise RequestRefused(
                400,
                f"a number in the request body has {len(literal)} characters; at most "
                f"{MAX_NUMBER_CHARS} are accepted",
                "number_too_long",
            )

    def parse_int(literal: str) -> int:
        length(literal)
        digits = len(literal.lstrip("-"))
        if limits.max_int_digits is not None and digits > limits.max_int_digits:
            raise RequestRefused(
                400,
                f"an integer in the request body has {digits} digits; at most "
                f"{limits.max_int_digits} (64-bit integers) are accepted",
                "number_too_long",
            )
        return int(literal)

    def parse_float(literal: str) -> float:
        length(literal)
        value = float(literal)
        if not math.isfinite(value):
            raise RequestRefused(
                400, f"the number {literal} is out of range", "number_out_of_range"
            )
        return value

    return parse_int, parse_float


def _reject_constant(name: str) -> Any:
    raise RequestRefused(400, f"{name} is not valid JSON", "invalid_json")


def decode_json(body: bytes, limits: JsonLimits) -> Any:
    """The parsed body, or :class:`RequestRefused` (400) saying what is wrong with it."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RequestRefused(
            400,
            f"the request body is not valid UTF-8: {e.reason} at byte {e.start}",
            "invalid_unicode",
        ) from None
    deep, many = json_shape(body, limits.max_depth, limits.max_values)
    if deep:
        raise RequestRefused(
            400, f"the request body nests deeper than {limits.max_depth} levels", "nesting_too_deep"
        )
    if many:
        raise RequestRefused(
            400, f"the request body holds more than {limits.max_values} values", "too_many_values"
        )
    parse_int, parse_float = _number_parsers(limits)
    try:
        data = json.loads(
            text, parse_int=parse_int, parse_float=parse_float, parse_constant=_reject_constant
        )
    except json.JSONDecodeError as e:
        raise RequestRefused(
            400, f"the request body is not valid JSON: {e}", "invalid_json"
        ) from None
    except RecursionError:  # only where max_depth is set past what the parser can follow
        raise RequestRefused(
            400, "the request body nests deeper than the parser follows", "nesting_too_deep"
        ) from None
    # Valid UTF-8 holds no surrogates: a lone one can only come from an escape. A "\ud800"
    # decodes to a lone surrogate (a paired escape to one character, which passes).
    if _SURROGATE_ESCAPE.search(body) is not None:
        try:
            json.dumps(data, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise RequestRefused(
                400,
                "the request body holds a lone UTF-16 surrogate escape (e.g. \\ud800), which is "
                "not valid Unicode text",
                "invalid_unicode",
            ) from None
    return data
