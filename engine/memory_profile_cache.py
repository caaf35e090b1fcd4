"""The memory profile's result kept for the next start of an unchanged engine: the peak memory a
forward pass at the largest batch reaches, which sizes the KV cache. It is kept in the compile
cache's folder (compile_cache.py: the GPU, driver and versions) under a key of everything else
that changes it (the model's config, the engine's arguments that shape its batches and memory,
the card's total memory), and it is used only if the weights now on the device take exactly the
bytes they took when it was measured: any difference, and the profile runs again."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, ValidationError

if TYPE_CHECKING:
    from kvfleet.engine.config import EngineArgs, ModelConfig

logger = logging.getLogger(__name__)

# The engine's arguments a forward pass's peak memory depends on.
_ARGS = (
    "max_num_seqs", "max_num_batched_tokens", "block_size", "kv_cache_dtype", "enable_lora",
    "max_loras", "max_lora_rank", "tensor_parallel_size", "enable_expert_parallel",
    "quantization", "attention_backend", "load_format",
)  # fmt: skip


class MemoryProfile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    key: str
    weight_bytes: int  # allocated on the device before the profile ran
    peak_bytes: int  # the profile's peak allocation (weights included)


def profile_key(mc: ModelConfig, args: EngineArgs, total_memory: int) -> str:
    """A digest of what the profile's peak depends on besides the machine's build facts."""
    hf = mc.hf_config
    to_json = getattr(hf, "to_json_string", None)
    facts = {
        "hf_config": to_json() if callable(to_json) else repr(hf),
        "architecture": mc.architecture,
        "dtype": str(mc.dtype),
        "max_model_len": mc.max_model_len,
        "quantization": repr(mc.quantization),
        "runner": mc.runner,
        "expert_parallel": mc.expert_parallel,
        "args": {name: getattr(args, name) for name in _ARGS},
        "backend": args.resolved_backend(),
        "total_memory": total_memory,
    }
    return hashlib.sha256(json.dumps(facts, sort_keys=True, default=str).encode()).hexdigest()


def profile_path(folder: Path, key: str) -> Path:
    return folder / "memory-profiles" / f"{key[:32]}.json"


def load_profile(folder: Path, key: str, weight_bytes: int) -> int | None:
    """The kept peak for `key`, or None (none kept, unreadable, another key, or weights of
    another size on the device: the profile must run)."""
    path = profile_path(folder, key)
    try:
        kept = MemoryProfile.model_validate_json(path.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ValidationError) as e:
        logger.warning("memory profile cache %s unreadable, profiling again: %s", path, e)
        return None
    if kept.key != key:
        return None
    if kept.peak_bytes < kept.weight_bytes:
        # Not a profile this engine wrote (the peak includes the weights): a KV cache sized by
        # it would run the device out of memory mid-serving.
        logger.warning("memory profile cache %s: a peak below the weights; profiling again", path)
        return None
    if kept.weight_bytes != weight_bytes:
        logger.info(
            "memory profile cache %s: the device holds %d bytes of weights, not the %d it was "
            "measured with; profiling again",
            path,
            weight_bytes,
            kept.weight_bytes,
        )
        return None
    return kept.peak_bytes


def store_profile(folder: Path, profile: MemoryProfile) -> None:
    """Keep a profile, written whole or not at all (engines sharing the folder may start at
    once); a folder that cannot be written costs the next start a profile, nothing more."""
    path = profile_path(folder, profile.key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False) as f:
            f.write(profile.model_dump_json())
        os.replace(f.name, path)
    except OSError as e:
        logger.warning("could not keep the memory profile in %s: %s", path, e)
