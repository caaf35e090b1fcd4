"""FP8 checkpoints of a tiny model, in the formats vLLM reads, and their exact dequantized twins.

`write_fp8_checkpoint` quantizes every linear layer of an HF checkpoint directory (attention and
MLP projections, each expert's of a mixture of experts; embeddings, norms, a router and the LM
head stay) with scales of at most 4 significant bits, and, per channel, makes each row's largest
entry exactly +-448. Then `q * scale` needs at most 8 significant bits, so `write_dequantized`
stores it exactly in bf16, and quantizing that twin at load (per channel) gives back the same
fp8 weights and scales bit for bit. Block-scaled ("fp8-block", DeepSeek-V3's and Qwen3's
*-FP8 layout) have one such scale per tile: their twin is exact too, and a loader that
requantizes them per channel holds what the twin quantized at load holds."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Literal

import torch
from safetensors.torch import load_file, save_file

FP8 = torch.float8_e4m3fn
# Static activation scales per projection: q/k/v (and gate/up) differ, so a fused layer must
# take their maximum. w1/w3/w2: Mixtral's experts' gate/up/down.
_INPUT_AMAX = {"q_proj": 9.0, "k_proj": 12.0, "v_proj": 10.0, "o_proj": 6.0,
               "gate_proj": 11.0, "up_proj": 8.0, "down_proj": 7.0,
               "w1": 11.0, "w3": 8.0, "w2": 7.0}  # fmt: skip
_PROJECTIONS = tuple(_INPUT_AMAX)
# Tiles of the fixture's block-scaled format: small, so a tiny matrix has several, and not
# dividing its sides, so the last tiles are partial.
FIXTURE_BLOCK = (32, 48)


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


def quantize_blocks_fixture(
    w: torch.Tensor, block: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight, fp32 weight_scale_inv [ceil(rows / block[0]), ceil(cols / block[1])])."""
    w = w.float()
    rows, cols = w.shape
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    scale = torch.empty(grid)
    for i in range(grid[0]):
        for j in range(grid[1]):
            tile = w[i * block[0] : (i + 1) * block[0], j * block[1] : (j + 1) * block[1]]
            # Tiles of different magnitudes, as a trained matrix's are.
            scale[i, j] = _four_bits_up(tile.abs().amax() * (1 + i + 2 * j) / 448.0)
    full = scale.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    q = (w / full).clamp(-448, 448)
    return q.to(FP8), scale


def _projection(name: str) -> str | None:
    parts = name.split(".")
    if len(parts) >= 2 and parts[-1] == "weight" and parts[-2] in _PROJECTIONS:
        return parts[-2]
    return None


def write_fp8_checkpoint(
    src: Path,
    dst: Path,
    fmt: Literal["fp8", "fp8-block", "compressed-tensors"],
    *,
    per_channel: bool,
    static: bool = False,
) -> Path:
    """An fp8 copy of the checkpoint at `src`. fmt "fp8": vLLM's quant_method fp8 (per-tensor
    scalar scales); "fp8-block": the same with weight_block_size FIXTURE_BLOCK (a
    weight_scale_inv grid per weight); "compressed-tensors": llm-compressor's float-quantized
    format (scales [rows, 1] per channel or [1] per tensor)."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    (weights,) = src.glob("*.safetensors")
    out: dict[str, torch.Tensor] = {}
    for name, tensor in load_file(weights).items():
        proj = _projection(name)
        if proj is None:
            out[name] = tensor
            continue
        prefix = name.removesuffix(".weight")
        if fmt == "fp8-block":
            out[name], out[f"{prefix}.weight_scale_inv"] = quantize_blocks_fixture(
                tensor, FIXTURE_BLOCK
            )
            continue
        q, scale = quantize_fixture(tensor, per_channel)
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
    if fmt == "compressed-tensors" and ("num_experts" in config or "num_local_experts" in config):
        # As llm-compressor writes a mixture of experts: its routers stay unquantized.
        config["quantization_config"]["ignore"].append("re:.*mlp.gate$")
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def _quantization_config(fmt: str, per_channel: bool, static: bool) -> dict:
    if fmt == "fp8-block":
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                "weight_block_size": list(FIXTURE_BLOCK)}  # fmt: skip
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
    config = json.loads((fp8_dir / "config.json").read_text())
    block = config["quantization_config"].get("weight_block_size")
    out = {}
    for name, tensor in tensors.items():
        if name.endswith((".weight_scale", ".input_scale", ".weight_scale_inv")):
            continue
        if tensor.dtype == FP8 and block:
            scale = tensors[name + "_scale_inv"].float()
            rows, cols = tensor.shape
            full = scale.repeat_interleave(block[0], 0)[:rows]
            tensor = (tensor.float() * full.repeat_interleave(block[1], 1)[:, :cols]).to(dtype)
        elif tensor.dtype == FP8:
            scale = tensors[name.removesuffix("weight") + "weight_scale"].float()
            scale = scale.reshape(-1, 1) if scale.numel() > 1 else scale.reshape(())
            tensor = (tensor.float() * scale).to(dtype)
        out[name] = tensor
    save_file(out, dst / weights.name, metadata={"format": "pt"})
    del config["quantization_config"]
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst
