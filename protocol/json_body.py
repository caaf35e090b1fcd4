"""Reading a request body as the engine's server and the router both must: bounded, strict JSON,
and the header checks that come before it; :func:`decode_json_text` holds JSON given in a string
(a schema as text, a tool call's arguments) to the same bounds. Each refusal is a
:class:`RequestRefused` (HTTP status, OpenAI-style code, message, parameter) that each process
turns into its own error response. The bounds are what parsing costs: depth and value count,
measured without recursion before parsing (``json.loads`` recurses), the length of number
literals (Python converts long integers in quadratic time), no ``NaN`` or ``Infinity``, no lone
surrogate (valid JSON, but no text a tokenizer can encode). docs/routing.md#hostile-clients
lists each refusal with its code.
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

# Strings are cut out of a text a slice of about this many bytes at a time: each step is one C
# call that holds the GIL, a few milliseconds on a slice, a good part of a second on 16 MiB.
_CUT_SLICE = 1 << 20
_BACKSLASHES = re.compile(rb"\\*")
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_NOT_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")
_DEPTH_STEP = {ord("["): 1, ord("{"): 1, ord("]"): -1, ord("}"): -1}
# Brackets whose running depth is summed in one C call: the GIL is held for one slice at a time
# (a 16 MiB body holds millions of brackets), and a run too deep is refused at its first slice.
_DEPTH_SLICE = 1 << 16


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


def check_content_length(value: int | None, limit: int) -> None:
    """A body declared larger than the limit is refused before a byte of it is read (413 at
    once, rather than a wait for a body that is never going to be taken)."""
    if value is not None and value > limit:
        raise RequestRefused(
            413,
            f"the request body is too large: Content-Length {value} is more than the {limit} "
            "bytes accepted",
            "body_too_large",
            "Content-Length",
        )


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
    large one. A text with too many values is refused for them: its depth, the slower count, is
    then not measured (False)."""
    deep = body.count(b"[") + body.count(b"{") > max_depth
    many = max_values is not None and body.count(b",") > max_values
    if not (deep or many):
        return False, False
    structure = _outside_strings(body)
    if many and max_values is not None:
        many = structure.count(b",") > max_values
    if deep and not many:
        deep = _deeper_than(structure.translate(None, _NOT_BRACKET), max_depth)
    return deep and not many, many


def _outside_strings(text: bytes) -> bytes:
    """The text with its strings cut out, a slice at a time (_CUT_SLICE). In each slice escaped
    backslashes and then escaped quotes are dropped, which leaves only the quotes that open and
    close strings; what lies between them at an even count is outside. A slice never ends in a
    run of backslashes or between one and the character it escapes. Past an unterminated
    string the rest is string: json.loads stops there too, before any bracket after it."""
    kept = []
    inside = False
    start = 0
    while start < len(text):
        backslashes = _BACKSLASHES.match(text, min(start + _CUT_SLICE, len(text)))
        assert backslashes is not None  # a run of none matches too
        end = backslashes.end()
        if text[end - 1 : end] == b"\\":
            end += 1
        parts = text[start:end].replace(b"\\\\", b"").replace(b'\\"', b"").split(b'"')
        kept.append(b"".join(parts[int(inside) :: 2]))
        inside = inside != (len(parts) % 2 == 0)
        start = end
    return b"".join(kept)


def _deeper_than(brackets: bytes, max_depth: int) -> bool:
    depth = 0
    for start in range(0, len(brackets), _DEPTH_SLICE):
        steps = map(_DEPTH_STEP.__getitem__, brackets[start : start + _DEPTH_SLICE])
        running = list(accumulate(steps, initial=depth))
        if max(running) > max_depth:
            return True
        depth = running[-1]
    return False


def nesting_exceeds(body: bytes, max_depth: int) -> bool:
    return json_shape(body, max_depth, None)[0]


def _number_parsers(limits: JsonLimits, what: str) -> tuple[Any, Any]:
    def length(literal: str) -> None:
        if len(literal) > MAX_NUMBER_CHARS:
            raise RequestRefused(
                400,
                f"a number in {what} has {len(literal)} characters; at most "
                f"{MAX_NUMBER_CHARS} are accepted",
                "number_too_long",
            )

    def parse_int(literal: str) -> int:
        length(literal)
        digits = len(literal.lstrip("-"))
        if limits.max_int_digits is not None and digits > limits.max_int_digits:
            raise RequestRefused(
                400,
                f"an integer in {what} has {digits} digits; at most "
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


def decode_json(body: bytes, limits: JsonLimits, what: str = "the request body") -> Any:
    """The parsed body, or :class:`RequestRefused` (400) saying what is wrong with it (``what``
    names it in the message)."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RequestRefused(
            400,
            f"{what} is not valid UTF-8: {e.reason} at byte {e.start}",
            "invalid_unicode",
        ) from None
    return _decode(text, body, limits, what)


def decode_json_text(text: str, limits: JsonLimits, what: str) -> Any:
    """A JSON text that a request holds in a string, parsed under the same bounds as a body
    (``json.loads`` on such a text, as on a body, recurses: a thousand levels are a
    RecursionError); :class:`RequestRefused` (400) names it by ``what``."""
    try:
        raw = text.encode("utf-8")
    except UnicodeEncodeError:
        raise RequestRefused(
            400,
            f"{what} holds a lone UTF-16 surrogate, which is not valid Unicode text",
            "invalid_unicode",
        ) from None
    return _decode(text, raw, limits, what)


def _decode(text: str, raw: bytes, limits: JsonLimits, what: str) -> Any:
    deep, many = json_shape(raw, limits.max_depth, limits.max_values)
    if deep:
        raise RequestRefused(
            400, f"{what} nests deeper than {limits.max_depth} levels", "nesting_too_deep"
        )
    if many:
        raise RequestRefused(
            400, f"{what} holds more than {limits.max_values} values", "too_many_values"
        )
    parse_int, parse_float = _number_parsers(limits, what)
    try:
        data = json.loads(
            text, parse_int=parse_int, parse_float=parse_float, parse_constant=_reject_constant
        )
    except json.JSONDecodeError as e:
        raise RequestRefused(400, f"{what} is not valid JSON: {e}", "invalid_json") from None
    except RecursionError:  # only where max_depth is set past what the parser can follow
        raise RequestRefused(
            400, f"{what} nests deeper than the parser follows", "nesting_too_deep"
        ) from None
    # Valid UTF-8 holds no surrogates: a lone one can only come from an escape. A "\ud800"
    # decodes to a lone surrogate (a paired escape to one character, which passes).
    if _SURROGATE_ESCAPE.search(raw) is not None:
        try:
            json.dumps(data, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise RequestRefused(
                400,
                f"{what} holds a lone UTF-16 surrogate escape (e.g. \\ud800), which is "
                "not valid Unicode text",
                "invalid_unicode",
            ) from None
    return data
