"""kvfleet.protocol.byte_size: sizes written as Kubernetes quantities (4Gi, 512MB) or plain bytes,
in flags and in settings models; anything else is refused with the forms it could have taken."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from kvfleet.engine.engine_args import EngineArgs
from kvfleet.engine.server.settings import ServerSettings
from kvfleet.protocol.byte_size import format_byte_size, parse_byte_size


@pytest.mark.parametrize(
    "text,size",
    [
        ("1048576", 1 << 20),
        ("0", 0),
        ("1Ki", 1024),
        ("512Mi", 512 << 20),
        ("1Gi", 1 << 30),
        ("2Ti", 2 << 40),
        ("1GiB", 1 << 30),
        ("1gi", 1 << 30),
        ("1K", 1000),
        ("512MB", 512_000_000),
        ("4G", 4_000_000_000),
        ("4gb", 4_000_000_000),
        ("1T", 10**12),
        ("100B", 100),
        ("1.5Gi", 3 << 29),
        ("0.5K", 500),
        (" 16 Mi ", 16 << 20),
    ],
)
def test_sizes_as_people_write_them(text: str, size: int) -> None:
    assert parse_byte_size(text) == size


@pytest.mark.parametrize(
    "text", ["", "Gi", "1X", "1Gix", "-1Gi", "1e9", "1,000", "0x10", "1 G i", "1" * 60]
)
def test_anything_else_names_the_forms(text: str) -> None:
    with pytest.raises(ValueError, match=r"is not a size: give bytes as an integer.*Ki, Mi, Gi"):
        parse_byte_size(text)


def test_a_fraction_of_a_byte_is_refused() -> None:
    with pytest.raises(ValueError, match="not a whole number of bytes"):
        parse_byte_size("1.0001K")


@pytest.mark.parametrize(
    "size,shown", [(16 << 20, "16Mi"), (1 << 30, "1Gi"), (3 << 39, "1536Gi"), (1000, "1000")]
)
def test_a_default_is_shown_in_the_largest_exact_unit(size: int, shown: str) -> None:
    assert format_byte_size(size) == shown
    assert parse_byte_size(shown) == size


def test_settings_models_take_sizes_and_keep_their_bounds() -> None:
    assert EngineArgs(model="m", kv_cache_memory_bytes="1Gi").kv_cache_memory_bytes == 1 << 30
    assert EngineArgs(model="m", kv_cache_memory_bytes=4096).kv_cache_memory_bytes == 4096
    assert ServerSettings(max_request_body_bytes="8Mi").max_request_body_bytes == 8 << 20
    with pytest.raises(ValidationError, match="is not a size"):
        EngineArgs(model="m", kv_cache_memory_bytes="lots")
    with pytest.raises(ValidationError, match="greater than or equal to 1024"):
        ServerSettings(max_request_body_bytes="1K")
