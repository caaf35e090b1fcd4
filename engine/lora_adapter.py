"""PEFT LoRA adapter folders (adapter_config.json + adapter_model.safetensors): checked against
what the engine supports and against the base model's layers, then read into host memory with
the scaling (lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora) folded into B.

What is supported: LoRA on the attention and MLP projections (q, k, v, o, gate, up, down) of the
dense families, without bias, DoRA, modules_to_save or per-module rank and alpha patterns. Any
other option is refused by name, not ignored: an adapter served without part of itself gives
wrong answers silently."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# adapter_config.json is a few hundred bytes; anything far larger is not one.
MAX_CONFIG_BYTES = 1 << 20

TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

# base_model.model.<module>.lora_A.weight (PEFT's saved names; some tools keep the adapter's
# name, ".default", before ".weight").
_TENSOR = re.compile(
    r"^base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.default)?\.weight$"
)


class LoRAAdapterError(ValueError):
    """An adapter the engine cannot serve, and why."""


@dataclass(frozen=True)
class TargetShape:
    """A projection an adapter may target, as the base checkpoint has it (unsplit): output
    and input features."""

    out_features: int
    in_features: int


@dataclass(frozen=True)
class LoRAAdapter:
    """An adapter in host memory: per target module (its checkpoint name, e.g.
    model.layers.0.self_attn.q_proj), A [r, in] and B [out, r] with the scaling folded in."""

    path: str
    rank: int
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


@dataclass(frozen=True)
class AdapterConfig:
    rank: int
    scaling: float


def _refuse(path: Path, message: str) -> LoRAAdapterError:
    return LoRAAdapterError(f"LoRA adapter {path}: {message}")


def read_config(path: str | Path, max_rank: int) -> AdapterConfig:
    """adapter_config.json checked: a LoRA of rank <= max_rank, every option one the engine
    applies."""
    path = Path(path)
    file = path / CONFIG_FILE
    if not file.is_file():
        raise _refuse(path, f"no {CONFIG_FILE} (a PEFT adapter folder holds it)")
    if file.stat().st_size > MAX_CONFIG_BYTES:
        raise _refuse(path, f"{CONFIG_FILE} is larger than {MAX_CONFIG_BYTES} bytes")
    try:
        config: Any = json.loads(file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _refuse(path, f"{CONFIG_FILE} is not JSON: {e}") from None
    if not isinstance(config, dict):
        raise _refuse(path, f"{CONFIG_FILE} is not a JSON object")
    peft_type = config.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise _refuse(path, f"peft_type {peft_type!r} is not supported, only LORA")
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise _refuse(path, f"r must be a positive integer, not {rank!r}")
    if rank > max_rank:
        raise _refuse(
            path, f"rank {rank} is above the engine's --max-lora-rank {max_rank}: serve with "
            f"--max-lora-rank {rank} or more"
        )  # fmt: skip
    alpha = config.get("lora_alpha", 8)
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise _refuse(path, f"lora_alpha must be a number, not {alpha!r}")
    unsupported = {
        "use_dora": "DoRA (use_dora)",
        "modules_to_save": "modules_to_save (fully trained modules besides the LoRA)",
        "rank_pattern": "per-module ranks (rank_pattern)",
        "alpha_pattern": "per-module alphas (alpha_pattern)",
        "layers_to_transform": "layers_to_transform",
        "layer_replication": "layer_replication",
        "target_parameters": "target_parameters",
        "lora_bias": "lora_bias",
        "fan_in_fan_out": "fan_in_fan_out",
    }
    for key, what in unsupported.items():
        if config.get(key):
            raise _refuse(path, f"{what} is not supported")
    bias = config.get("bias", "none")
    if bias != "none":
        raise _refuse(path, f"bias={bias!r} is not supported (only 'none': no trained biases)")
    targets = config.get("target_modules")
    if isinstance(targets, list):
        other = sorted({str(t) for t in targets} - set(TARGET_MODULES))
        if other:
            raise _refuse(
                path, f"target_modules {other} are not supported; LoRA applies to "
                f"{', '.join(TARGET_MODULES)}"
            )  # fmt: skip
    # A regex or "all-linear": the tensors in the file say which modules it reaches (checked
    # by read_weights).
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return AdapterConfig(rank, float(scaling))


def _module_of(path: Path, key: str, targets: dict[str, TargetShape]) -> tuple[str, str]:
    match = _TENSOR.match(key)
    if match is None:
        raise _refuse(
            path, f"tensor {key!r} is not a LoRA A/B weight of a supported module (only "
            f"{', '.join(TARGET_MODULES)})"
        )  # fmt: skip
    module = match["module"]
    if module not in targets:
        raise _refuse(
            path, f"tensor {key!r} targets {module}, which is not one of the base model's "
            f"{', '.join(TARGET_MODULES)} projections"
        )  # fmt: skip
    return module, match["ab"]


def check_weights(path: str | Path, config: AdapterConfig, targets: dict[str, TargetShape]) -> None:
    """The safetensors file's names and shapes (its header alone) against the base model."""
    _read(Path(path), config, targets, load=False)


def read_weights(
    path: str | Path, config: AdapterConfig, targets: dict[str, TargetShape]
) -> LoRAAdapter:
    """The adapter's tensors, checked against the base model's projections (`targets`, by
    checkpoint module name), B scaled."""
    return _read(Path(path), config, targets, load=True)


def _read(
    path: Path, config: AdapterConfig, targets: dict[str, TargetShape], *, load: bool
) -> LoRAAdapter:
    file = path / WEIGHTS_FILE
    if not file.is_file():
        found = (
            "adapter_model.bin (pickle) is not read: convert it to safetensors"
            if (path / "adapter_model.bin").is_file()
            else "it is missing"
        )
        raise _refuse(path, f"no {WEIGHTS_FILE}: {found}")
    pairs: dict[str, dict[str, torch.Tensor | None]] = {}
    try:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a Mapping
                module, ab = _module_of(path, key, targets)
                shape = tuple(f.get_slice(key).get_shape())
                target = targets[module]
                r = config.rank
                want = (r, target.in_features) if ab == "A" else (target.out_features, r)
                if shape != want:
                    raise _refuse(
                        path, f"tensor {key!r} has shape {list(shape)}; the base model and "
                        f"r={r} need {list(want)}"
                    )  # fmt: skip
                pairs.setdefault(module, {})[ab] = f.get_tensor(key) if load else None
    except LoRAAdapterError:
        raise
    except Exception as e:  # a truncated or corrupt file: safetensors' own error types
        raise _refuse(path, f"{WEIGHTS_FILE} cannot be read: {e}") from None
    if not pairs:
        raise _refuse(path, f"{WEIGHTS_FILE} holds no LoRA weights")
    weights = {}
    for module, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise _refuse(path, f"{module} has lora_{''.join(ab)} without its pair")
        a, b = ab["A"], ab["B"]
        if a is not None and b is not None:
            weights[module] = (a, (b.float() * config.scaling).to(b.dtype))
    return LoRAAdapter(str(path), config.rank, weights)
