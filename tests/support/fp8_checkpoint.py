"""FP8 checkpoints of a tiny model, in the formats vLLM reads, and their exact dequantized twins.

`write_fp8_checkpoint` quantizes every linear layer of an HF checkpoint directory (attention and
MLP projections; embeddings, norms and the LM head stay) with scales of at most 4 significant
bits, and, per channel, makes each row's largest entry exactly +-448. Then `q * scale` needs at
most 8 significant bits, so `write_dequantized` stores it exactly in bf16, and quantizing that
twin at load (per channel) gives back the same fp8 weights and scales bit for bit."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Literal

import torch
from safetensors.torch import load_file, save_file

FP8 = torch.float8_e4m3fn
_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Static activation scales per projection: q/k/v (and gate/up) differ, so a fused layer must
# take their maximum.
_INPUT_AMAX = {"q_proj": 9.0, "k_proj": 12.0, "v_proj": 10.0, "o_proj": 6.0,
               "gate_proj": 11.0, "up_proj": 8.0, "down_proj": 7.0}  # fmt: skip


def _four_bits_up(x: torch.Tensor) -> torch.Tensor:
    mantissa, exponent = torch.frexp(x)
    return torch.ldexp(torch.ceil(mantissa * 16) / 16, exponent)


def quantize_fixture(w: torch.Tensor, per_channel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight, fp32 scale: [rows] per channel, a scalar per tensor)."""
    w = w.float()
    amax = w.abs().amax(dim=1) if per_channel else w.abs().amax()
    scale = _four_bits_up(amax / 448.0)
    q = (w / (scale[:, None] if per_channel else scale)).clamp(-448, 448)
    if per_channel:
        top = w.abs().argmax(dim=1)
        rows = torch.arange(w.shape[0])
        q[rows, top] = torch.where(w[rows, top] < 0, -448.0, 448.0)
    return q.to(FP8), scale


def _projection(name: str) -> str | None:
    parts = name.split(".")
    if len(parts) >= 2 and parts[-1] == "weight" and parts[-2] in _PROJECTIONS:
        return parts[-2]
    return None


def write_fp8_checkpoint(
    src: Path,
    dst: Path,
    fmt: Literal["fp8", "compressed-tensors"],
    *,
    per_channel: bool,
    static: bool = False,
) -> Path:
    """An fp8 copy of the checkpoint at `src`. fmt "fp8": vLLM's quant_method fp8 (per-tensor
    scalar scales); "compressed-tensors": llm-compressor's float-quantized format (scales
    [rows, 1] per channel or [1] per tensor)."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    (weights,) = src.glob("*.safetensors")
    out: dict[str, torch.Tensor] = {}
    for name, tensor in load_file(weights).items():
        proj = _projection(name)
        if proj is None:
            out[name] = tensor
            continue
        q, scale = quantize_fixture(tensor, per_channel)
        prefix = name.removesuffix(".weight")
        out[name] = q
        if fmt == "compressed-tensors":
            scale = scale.reshape(-1, 1) if per_channel else scale.reshape(1)
        out[f"{prefix}.weight_scale"] = scale
        if static:
            amax = torch.tensor(_INPUT_AMAX[proj] / 448.0)
            out[f"{prefix}.input_scale"] = amax.reshape(1) if fmt != "fp8" else amax
    save_file(out, dst / weights.name, metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = _quantization_config(fmt, per_channel, static)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def _quantization_config(fmt: str, per_channel: bool, static: bool) -> dict:
    if fmt == "fp8":
        if per_channel:
            raise ValueError("vLLM's fp8 format has per-tensor weight scales")
        return {"quant_method": "fp8", "activation_scheme": "static" if static else "dynamic"}
    acts = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": not static,
            "strategy": "tensor" if static else "token"}  # fmt: skip
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
               "strategy": "channel" if per_channel else "tensor"}  # fmt: skip
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {
            "group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts}
        },
        "ignore": ["lm_head"],
    }


def write_dequantized(fp8_dir: Path, dst: Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """The fp8 checkpoint's weights times their scales, in `dtype` (the other tensors as they
    are), without quantization_config."""
    shutil.copytree(fp8_dir, dst, ignore=shutil.ignore_patterns("*.safetensors"))
    (weights,) = fp8_dir.glob("*.safetensors")
    tensors = load_file(weights)
    out = {}
    for name, tensor in tensors.items():
        if name.endswith((".weight_scale", ".input_scale")):
            continue
        if tensor.dtype == FP8:
            scale = tensors[name.removesuffix("weight") + "weight_scale"].float()
            scale = scale.reshape(-1, 1) if scale.numel() > 1 else scale.reshape(())
            tensor = (tensor.float() * scale).to(dtype)
        out[name] = tensor
    save_file(out, dst / weights.name, metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    del config["quantization_config"]
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst
