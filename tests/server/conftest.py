"""The default model's server, started once for the modules that talk to it as it ships: each
start reads and dequantizes the GGUF file, which costs more than most of those modules' tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.support.servers import DEFAULT_SERVED_NAME, default_model_server


@pytest.fixture(scope="session")
def default_server(smollm2_gguf: Path) -> Iterator[SimpleNamespace]:
    with default_model_server(smollm2_gguf, DEFAULT_SERVED_NAME) as s:
        yield s
