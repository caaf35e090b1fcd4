"""The packages the engine's and the router's processes keep transformers from importing
(protocol/unused_packages.py): torchvision and scikit-learn, which transformers imports with any
model's config when they are installed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvfleet.engine import cli as engine_cli
from kvfleet.protocol.unused_packages import UNUSED_PACKAGES
from kvfleet.router import main as router_main
from tests.support.tiny_model import tiny_model_path

# Loads the model's config and tokenizer as the engine (ModelConfig.from_args, load_tokenizer)
# and the router (AutoTokenizer) do, after the entry point's call.
LOAD = """
import sys
from kvfleet.protocol.unused_packages import keep_out_unused_packages
if sys.argv[2] == "kept-out":
    keep_out_unused_packages()
from transformers import AutoConfig, AutoTokenizer
AutoConfig.from_pretrained(sys.argv[1])
AutoTokenizer.from_pretrained(sys.argv[1])
"""


def _installed_fakes(root: Path) -> Path:
    """Stand-ins for the unused packages that record their import in root/imported."""
    for name in UNUSED_PACKAGES:
        package = root / name
        package.mkdir(parents=True)
        (package / "__init__.py").write_text(
            f"with open({str(root / 'imported')!r}, 'a') as f:\n    f.write({name!r} + ' ')\n"
        )
    return root / "imported"


@pytest.mark.parametrize("entry", ["kept-out", "plain"])
def test_a_model_config_and_tokenizer_load_without_the_unused_packages(tmp_path, entry):
    imported = _installed_fakes(tmp_path / "site")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), *sys.path])}
    subprocess.run(
        [sys.executable, "-c", LOAD, str(tiny_model_path()), entry],
        env=env,
        check=entry == "kept-out",
        capture_output=True,
        timeout=120,
    )
    found = imported.read_text().split() if imported.exists() else []
    if entry == "kept-out":
        assert found == []
    else:
        # Without the call transformers imports what it finds (and fails on the stand-in's
        # missing modules), as it imports the real packages.
        assert "torchvision" in found


class _Called(Exception):
    pass


def _record(*_: object) -> list[str]:
    raise _Called


def test_the_engine_and_the_router_keep_them_out_before_they_run(monkeypatch):
    for module in (engine_cli, router_main):
        monkeypatch.setattr(module, "keep_out_unused_packages", _record)
    with pytest.raises(_Called):
        engine_cli.main(["serve", "/nonexistent/model"])
    with pytest.raises(_Called):
        router_main.main(["--endpoints", "127.0.0.1:1"])
