"""The built-in default model: a tiny random-weight Llama built on first use in the user's cache
directory, so the engine runs on any machine with nothing downloaded. Its text is noise."""

from __future__ import annotations

import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "kvfleet-tiny-random-llama"
MEANINGLESS = (
    "the built-in default model has random weights: its output is meaningless text; pass "
    "--model PATH (an HF model directory with config.json and *.safetensors) for a real model"
)


def cache_dir() -> Path:
    root = os.environ.get("KVFLEET_CACHE_DIR") or os.environ.get("XDG_CACHE_HOME")
    base = Path(root) if root else Path.home() / ".cache"
    return base if os.environ.get("KVFLEET_CACHE_DIR") else base / "kvfleet"


def default_model_path() -> Path:
    """Path of the default model, built there first if it is not yet."""
    from kvfleet.engine.tiny_model import build_tiny_model

    path = build_tiny_model(
        cache_dir() / DEFAULT_MODEL_NAME,
        "llama",
        seed=0,
        vocab_size=1024,
        hidden_size=128,
        num_layers=4,
        num_heads=8,
        num_kv_heads=2,
        max_position_embeddings=2048,
    )
    logger.warning(MEANINGLESS)
    return path
