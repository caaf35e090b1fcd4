"""Pooling: how an embedding model turns a prompt's final hidden states (after the model's
final norm) into one vector, and how that is chosen for a checkpoint.

A sentence-transformers checkpoint says it in its own files: `modules.json` lists a Pooling
module (its folder's `config.json` names the mode) and, when the vectors are normalised, a
Normalize module. Without them the engine pools as Qwen3-Embedding does: the last token's
hidden state, normalised. `--pooling-type` overrides the mode.

Matryoshka truncation (a request's `dimensions`) is allowed where the checkpoint declares it,
as vLLM reads it: `is_matryoshka: true` in config.json (any size up to the hidden size) or
`matryoshka_dimensions` (those sizes only).

The functions at the bottom are the math, shared by the runner and the tests' oracle."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import torch

PoolingType = Literal["LAST", "MEAN"]

# sentence-transformers' Pooling config keys, in the order it resolves them, for the modes the
# engine runs. A decoder's first token sees nothing after it: CLS pooling has no meaning here.
_ST_MODES: tuple[tuple[str, PoolingType], ...] = (
    ("pooling_mode_lasttoken", "LAST"),
    ("pooling_mode_mean_tokens", "MEAN"),
)
_ST_POOLING = "sentence_transformers.models.Pooling"
_ST_NORMALIZE = "sentence_transformers.models.Normalize"


@dataclass(frozen=True, slots=True)
class PoolerConfig:
    """How this engine pools, resolved once from the checkpoint and the arguments."""

    pooling_type: PoolingType
    normalize: bool
    hidden_size: int
    # None: no Matryoshka truncation; () any size up to hidden_size; else the sizes allowed.
    matryoshka_dimensions: tuple[int, ...] | None

    def check_dimensions(self, dimensions: int | None) -> str | None:
        """Why a request's `dimensions` cannot be served, or None when it can."""
        if dimensions is None or dimensions == self.hidden_size:
            return None
        allowed = self.matryoshka_dimensions
        if allowed is None:
            return (
                "this model does not support Matryoshka dimensions (its config.json declares "
                "neither is_matryoshka nor matryoshka_dimensions)"
            )
        if not 1 <= dimensions <= self.hidden_size:
            return f"dimensions must be between 1 and the model's {self.hidden_size}"
        if allowed and dimensions not in allowed:
            return f"dimensions must be one of {list(allowed)} for this model"
        return None


@dataclass(frozen=True, slots=True)
class PoolingParams:
    """What one embedding request asks of the pooler, admitted (engine-wide settings copied
    in): the runner reads nothing else."""

    pooling_type: PoolingType
    normalize: bool
    # Leading components kept (Matryoshka), None: all of them.
    dimensions: int | None = None


def resolve_pooler(
    model_dir: Path | None, hf_config: object, pooling_type: PoolingType | None
) -> PoolerConfig:
    """The pooler of a checkpoint (a directory, or None for a GGUF file, which has no
    sentence-transformers files), `pooling_type` overriding its mode."""
    declared, normalize = _sentence_transformers_pooling(model_dir)
    if declared is None and normalize is None:
        declared, normalize = "LAST", True  # Qwen3-Embedding's
    mode = pooling_type or declared or "LAST"
    hidden_size = int(getattr(hf_config, "hidden_size"))  # noqa: B009 - an HF config
    dims = getattr(hf_config, "matryoshka_dimensions", None)
    matryoshka: tuple[int, ...] | None = None
    if dims:
        matryoshka = tuple(int(d) for d in dims)
    elif getattr(hf_config, "is_matryoshka", False):
        matryoshka = ()
    return PoolerConfig(mode, bool(normalize), hidden_size, matryoshka)


def has_sentence_transformers_pooling(model_dir: Path) -> bool:
    """Whether the checkpoint ships a sentence-transformers Pooling module: an embedding model
    whatever architecture its config.json names (Qwen3-Embedding's says Qwen3ForCausalLM)."""
    return _pooling_folder(model_dir) is not None


def _modules(model_dir: Path | None) -> list[dict[str, object]]:
    if model_dir is None:
        return []
    path = model_dir / "modules.json"
    if not path.is_file():
        return []
    try:
        modules = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(modules, list):
        raise ValueError(f"{path} must hold a list of modules")
    return [m for m in modules if isinstance(m, dict)]


def _pooling_folder(model_dir: Path | None) -> Path | None:
    for module in _modules(model_dir):
        if module.get("type") == _ST_POOLING:
            assert model_dir is not None
            return model_dir / str(module.get("path", ""))
    return None


def _sentence_transformers_pooling(
    model_dir: Path | None,
) -> tuple[PoolingType | None, bool | None]:
    """The mode the checkpoint's Pooling module names and whether it normalises (None, None
    without sentence-transformers files)."""
    modules = _modules(model_dir)
    if not modules:
        return None, None
    normalize = any(m.get("type") == _ST_NORMALIZE for m in modules)
    folder = _pooling_folder(model_dir)
    if folder is None:
        return None, normalize
    path = folder / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"the Pooling module's {path} cannot be read: {e}") from None
    for key, mode in _ST_MODES:
        if config.get(key):
            return mode, normalize
    named = sorted(k for k, v in config.items() if k.startswith("pooling_mode") and v)
    raise ValueError(
        f"{path} asks for {', '.join(named) or 'no pooling mode'}; the engine pools a decoder's "
        "last token or the mean of its tokens: pass --pooling-type LAST or MEAN"
    )


def finish_embedding(pooled: torch.Tensor, params: PoolingParams) -> torch.Tensor:
    """One pooled vector (fp32) as the request gets it: truncated to `dimensions`, then
    normalised (L2) when the model normalises."""
    import torch

    vec = pooled if params.dimensions is None else pooled[: params.dimensions]
    if params.normalize:
        vec = torch.nn.functional.normalize(vec, p=2.0, dim=-1)
    return vec
