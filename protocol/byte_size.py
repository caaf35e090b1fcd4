"""Sizes in bytes as people write them, in flags and settings: a plain integer, or a number with a
unit as Kubernetes quantities have them: Ki, Mi, Gi, Ti are powers of 1024 and K, M, G, T
powers of 1000 (a trailing B is allowed: KiB, MB). Units are case-insensitive."""

from __future__ import annotations

import re
from decimal import Decimal
from typing import Annotated, Any

from pydantic import BeforeValidator

_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    **{p + s: 1000**i for i, p in enumerate("kmgt", 1) for s in ("", "b")},
    **{p + s: 1024**i for i, p in enumerate("kmgt", 1) for s in ("i", "ib")},
}

_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*")
# Longer is no size anyone means (30 digits are past any memory); bounds the decimal work.
_MAX_LENGTH = 40

FORMS = (
    "bytes as an integer, or with a unit: Ki, Mi, Gi, Ti (powers of 1024) or K, M, G, T "
    "(powers of 1000), e.g. 4Gi, 512MB"
)


def parse_byte_size(text: str) -> int:
    """The bytes `text` says ("4Gi", "512MB", "1048576"); ValueError naming the accepted forms."""
    match = _SIZE.fullmatch(text) if len(text) <= _MAX_LENGTH else None
    unit = _UNITS.get(match.group(2).lower()) if match else None
    if match is None or unit is None:
        raise ValueError(f"{text!r} is not a size: give {FORMS}")
    size = Decimal(match.group(1)) * unit
    if size != size.to_integral_value():
        raise ValueError(f"{text!r} is not a whole number of bytes")
    return int(size)


def format_byte_size(size: int) -> str:
    """`size` in the largest binary unit that holds it exactly (16Mi), as a default is shown."""
    for suffix, unit in (("Ti", 1024**4), ("Gi", 1024**3), ("Mi", 1024**2), ("Ki", 1024)):
        if size >= unit and size % unit == 0:
            return f"{size // unit}{suffix}"
    return str(size)


class _ByteSizeSyntax:
    """How a size is written on the command line (a FlagSyntax of kvfleet.telemetry's
    settings_flags, which builds the flags of a ByteSize field)."""

    metavar = "SIZE"
    forms = FORMS

    def parse(self, text: str) -> int:
        return parse_byte_size(text)

    def show(self, value: int) -> str:
        return format_byte_size(value)


def _byte_size_value(value: Any) -> Any:
    # Strings are sizes; anything else (an int) is left to the int validation that follows.
    return parse_byte_size(value) if isinstance(value, str) else value


# A settings field in bytes that also takes "4Gi" or "512MB" (pydantic), and as a flag.
ByteSize = Annotated[int, BeforeValidator(_byte_size_value), _ByteSizeSyntax()]
