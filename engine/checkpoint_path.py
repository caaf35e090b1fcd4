"""Where the model argument points: a GGUF file, an HF model directory, or nothing this engine
loads, said in one line with what to pass instead. Free of torch, so the command line checks
the path before it imports the engine."""

from __future__ import annotations

import re
from pathlib import Path

GGUF_SUFFIX = ".gguf"
# The first bytes of every GGUF file.
GGUF_MAGIC = b"GGUF"

# A Hugging Face hub id: an organization or user and a name, as meta-llama/Llama-3.1-8B.
_HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")
_CHECKPOINTS = "an HF model directory (config.json + *.safetensors) or a .gguf file"


def find_gguf(model: str | Path) -> Path | None:
    """The GGUF file `model` names: the file itself, or the only *.gguf of a directory that has
    no HF config.json. None for anything else (an HF directory); ValueError for a .gguf file
    that is not one."""
    path = Path(model)
    if path.suffix == GGUF_SUFFIX and path.is_file():
        return _checked_gguf(path)
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    files = sorted(path.glob(f"*{GGUF_SUFFIX}"))
    if len(files) > 1:
        raise ValueError(
            f"{path} holds {len(files)} GGUF files ({', '.join(f.name for f in files)}): "
            "name one of them as the model"
        )
    return _checked_gguf(files[0]) if files else None


def _checked_gguf(file: Path) -> Path:
    with file.open("rb") as f:
        if f.read(len(GGUF_MAGIC)) != GGUF_MAGIC:
            raise ValueError(
                f"{file} is not a GGUF file (it does not begin with the GGUF magic bytes): pass "
                "a llama.cpp .gguf checkpoint, or an HF model directory"
            )
    return file


def find_checkpoint(model: str) -> Path:
    """The checkpoint `model` names: its GGUF file, or its HF directory (one with a
    config.json). FileNotFoundError saying what to pass instead for anything else."""
    gguf_file = find_gguf(model)
    if gguf_file is not None:
        return gguf_file
    path = Path(model)
    if (path / "config.json").is_file():
        return path
    raise FileNotFoundError(_not_a_checkpoint(model))


def _not_a_checkpoint(model: str) -> str:
    path = Path(model)
    if path.is_dir():
        return f"{model} holds neither a config.json nor a .gguf file: pass {_CHECKPOINTS}"
    if path.exists():
        return f"{model} is not a .gguf file: pass {_CHECKPOINTS}"
    if _HUB_ID.fullmatch(model) and not model.startswith("."):
        return (
            f"{model} does not exist here, and kvfleet does not download from the Hugging Face "
            f"hub: fetch it first (hf download {model} --local-dir DIR) and pass --model DIR"
        )
    return f"{model} does not exist: pass {_CHECKPOINTS}"
