"""The engine's tokenizer bundle (GET /tokenizer) is refused, not served half, for a tokenizer
whose saved files a router could not load: a binary file (a slow tokenizer's vocabulary), no
tokenizer.json, a bundle over the bound."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvfleet.engine.server import tokenizer_bundle
from kvfleet.engine.server.tokenizer_bundle import TokenizerNotServable, bundle_bytes


class Saving:
    """A tokenizer whose save_pretrained writes ``files``."""

    def __init__(self, files: dict[str, bytes]) -> None:
        self.files = files

    def save_pretrained(self, folder: str, legacy_format: bool = True) -> None:
        assert legacy_format is False
        for name, data in self.files.items():
            (Path(folder) / name).write_bytes(data)


@pytest.mark.parametrize(
    ("files", "why"),
    [
        ({"tokenizer.json": b"{}", "tokenizer.model": b"\x80\xff\x00"}, "not a text file"),
        ({"tokenizer_config.json": b"{}"}, "no tokenizer.json"),
    ],
)
def test_a_tokenizer_a_router_could_not_load_is_not_served(files: dict[str, bytes], why: str):
    with pytest.raises(TokenizerNotServable, match=why):
        bundle_bytes(Saving(files))


def test_a_bundle_over_the_bound_is_not_served(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(tokenizer_bundle, "MAX_BUNDLE_BYTES", 100)
    assert bundle_bytes(Saving({"tokenizer.json": b"{}"}))
    with pytest.raises(TokenizerNotServable, match="over the bound"):
        bundle_bytes(Saving({"tokenizer.json": b"x" * 100}))
