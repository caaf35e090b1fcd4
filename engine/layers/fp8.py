"""FP8 weights with FP8 activations (W8A8), as `--quantization fp8` and pre-quantized
checkpoints ask for: float8_e4m3fn weights with one fp32 scale per output channel, activations
quantized per token as they arrive (or with the checkpoint's static `input_scale`), and the
matmul through `torch._scaled_mm` (cuBLASLt on CUDA sm_89+; the same call, same arithmetic, on
the CPU, so CPU tests check the real thing).

Per-channel weight scales make fusing exact: q/k/v and gate/up rows keep the scales of the
matrices they came from, and a checkpoint's per-tensor scale is expanded to every row of its
shard rather than requantized to a common maximum.

Block-scaled checkpoints (`weight_block_size`, one scale per 128x128 tile, as DeepSeek-V3 and
Qwen3's *-FP8 ship) are requantized per output channel as they load: each weight is multiplied
out by its tile scales (exact in fp32) and quantized per row like a bf16 weight. That costs one
more e4m3 rounding of each entry on its row's grid instead of its tile's: at most 1/16 of an
entry relatively, and entries of tiles far smaller than their row's largest lose bits to
subnormals (tests/engine/test_moe_fp8.py measures it on random tiles: ~2% of a matrix's
norm, as much as quantizing a bf16 weight costs)."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from kvfleet.kernels.reference import FP8, FP8_MAX, MIN_SCALE, quantize_tokens

# Decode batches up to this many tokens run our own GEMM, one launch with the scales and bias
# inside (kernels.fp8_gemm; its MAX_TOKENS, which is not imported here to keep triton out).
# From there up to _SMALL_BATCH, cuBLASLt's unscaled (per-tensor) FP8 GEMM plus a scaling
# epilogue beats its row-wise-scaled GEMM (bench/fp8_linear_bench.py on an H100: 1.1-2.5x
# faster at Llama-3-8B's shapes up to 64 tokens, about even from 256).
_GEMM_TOKENS = 16
_SMALL_BATCH = 64
# cuBLASLt's FP8 GEMM wants the reduction and output dimensions in multiples of 16 (checked on
# torch 2.11 / H100; the batch dimension is free).
_CUBLAS_ALIGN = 16


@dataclass(frozen=True)
class Fp8Config:
    """checkpoint_fp8: the checkpoint holds fp8 weights and their scales; otherwise its
    bf16/fp16/fp32 (or dequantized GGUF) weights are quantized as they load.
    static_activations: the checkpoint holds one `input_scale` per linear layer.
    weight_block_size: the checkpoint's fp8 weights are scaled per tile of this many (rows,
    columns) by a `weight_scale_inv` grid; the loader multiplies them out and the layers
    quantize them again per channel (see the module docstring)."""

    checkpoint_fp8: bool = False
    static_activations: bool = False
    weight_block_size: tuple[int, int] | None = None


def _entry(config: Any, key: str) -> Any:
    return config.get(key) if isinstance(config, dict) else getattr(config, key, None)


def _from_fp8_method(qc: Any) -> Fp8Config:
    """vLLM's own format (quant_method "fp8", written by AutoFP8 and llm-compressor's legacy
    path): per-tensor `weight_scale`, `input_scale` when activation_scheme is static; or, with
    `weight_block_size` (DeepSeek-V3's and Qwen3's *-FP8), a `weight_scale_inv` per tile."""
    scheme = _entry(qc, "activation_scheme") or "dynamic"
    if scheme not in ("static", "dynamic"):
        raise ValueError(f"fp8 activation_scheme {scheme!r}: expected 'static' or 'dynamic'")
    block = _entry(qc, "weight_block_size")
    if block is None:
        return Fp8Config(checkpoint_fp8=True, static_activations=scheme == "static")
    if (
        not isinstance(block, list | tuple)
        or len(block) != 2
        or not all(isinstance(b, int) and b > 0 for b in block)
    ):
        raise ValueError(f"fp8 weight_block_size {block!r}: expected [rows, columns] > 0")
    if scheme == "static":
        raise ValueError(
            "block-quantized fp8 checkpoint with static activation scales: only dynamic "
            "activations (quantized per token) load with weight_block_size"
        )
    return Fp8Config(checkpoint_fp8=True, weight_block_size=(block[0], block[1]))


# The layers kvfleet never quantizes, as a checkpoint's ignore list names them: the LM head, and
# the routers of a mixture of experts (each layer's `mlp.gate`, Mixtral's `block_sparse_moe.gate`),
# one by one or by a pattern ("re:.*mlp.gate$", as RedHatAI's Qwen3-MoE FP8 models write it).
_UNQUANTIZED = re.compile(r"^(re:)?(.*[.*])?(lm_head|(mlp|block_sparse_moe)\\?\.gate)\$?$")


def _kept_unquantized(name: str) -> bool:
    return _UNQUANTIZED.match(name) is not None


def _from_compressed_tensors(qc: Any) -> Fp8Config:
    """llm-compressor's format (RedHatAI's *-FP8-dynamic / *-FP8 models): one config group of
    8-bit float weights with a tensor or channel strategy, activations per token (dynamic) or
    per tensor (static)."""
    groups = _entry(qc, "config_groups") or {}
    if len(groups) != 1:
        raise ValueError(
            f"compressed-tensors checkpoint with {len(groups)} config groups; kvfleet loads one "
            "group of fp8 weights"
        )
    (group,) = groups.values()
    weights, acts = _entry(group, "weights") or {}, _entry(group, "input_activations")
    if _entry(weights, "type") != "float" or _entry(weights, "num_bits") != 8:
        raise ValueError(
            "compressed-tensors checkpoint whose weights are not 8-bit floats "
            f"({_entry(weights, 'type')}, {_entry(weights, 'num_bits')} bits): only its fp8 "
            "formats load"
        )
    if _entry(weights, "strategy") not in ("tensor", "channel"):
        raise ValueError(
            f"compressed-tensors fp8 weight strategy {_entry(weights, 'strategy')!r}: only "
            "'tensor' and 'channel' load"
        )
    if acts is None or _entry(acts, "type") != "float" or _entry(acts, "num_bits") != 8:
        raise ValueError(
            "compressed-tensors fp8 checkpoint without fp8 input activations (weight-only "
            "fp8): kvfleet runs fp8 weights with fp8 activations only"
        )
    static = not _entry(acts, "dynamic")
    if static and _entry(acts, "strategy") != "tensor":
        raise ValueError("compressed-tensors static fp8 activations must be per tensor")
    ignored = [name for name in _entry(qc, "ignore") or [] if not _kept_unquantized(name)]
    if ignored:
        raise ValueError(
            f"compressed-tensors checkpoint leaves {ignored[:4]} unquantized; kvfleet keeps "
            "only the LM head and a mixture of experts' routers out of fp8"
        )
    return Fp8Config(checkpoint_fp8=True, static_activations=static)


def resolve_fp8(flag: str | None, quantization_config: Any, *, dummy: bool) -> Fp8Config | None:
    """The fp8 setting from `--quantization` and the checkpoint's config.json
    `quantization_config`: a pre-quantized fp8 checkpoint is served in fp8 without the flag;
    any other quantized checkpoint is an error. Dummy weights are random: quantized at load,
    activations dynamic."""
    method = _entry(quantization_config, "quant_method") if quantization_config else None
    if method is None:
        return Fp8Config() if flag == "fp8" else None
    if method == "fp8":
        config = _from_fp8_method(quantization_config)
    elif method == "compressed-tensors":
        config = _from_compressed_tensors(quantization_config)
    else:
        asked = f"--quantization {flag} conflicts with it" if flag else "it is not supported"
        raise ValueError(
            f"the checkpoint is quantized with {method!r} (config.json quantization_config): "
            f"{asked}; kvfleet loads bf16/fp16/fp32, GGUF and fp8 checkpoints"
        )
    return Fp8Config() if dummy else config


def check_fp8_device(device: torch.device) -> None:
    if device.type != "cuda":
        return
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        raise ValueError(
            f"fp8 weights need sm_89+ (Ada, Hopper or newer) for FP8 matmuls; this GPU "
            f"({torch.cuda.get_device_name(device)}) is sm_{major}{minor}: serve without "
            "--quantization fp8 and with a bf16/fp16 checkpoint"
        )


def check_fp8_shape(out_features: int, in_features: int, what: str) -> None:
    if out_features % _CUBLAS_ALIGN or in_features % _CUBLAS_ALIGN:
        raise ValueError(
            f"{what}: fp8 weights of {out_features}x{in_features} per rank; FP8 matmuls need "
            f"both dimensions in multiples of {_CUBLAS_ALIGN}"
        )


@dataclass(frozen=True)
class Fp8Activations:
    """A linear layer's input, quantized per token by the kernel that produced it (an RMSNorm or
    a gated activation feeding an fp8 layer): fp8 values [..., K], fp32 scales [tokens, 1], and
    the dtype the values had, which the layer's output takes."""

    data: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype


class Fp8Input:
    """Set on a layer whose output only an fp8 linear reads, so that it quantizes the output
    itself: the consumer's static input scale, when its checkpoint has one, read at each call
    since it loads after the model is built. A plain object: not a submodule or parameter of
    the producing layer."""

    def __init__(self, consumer: Any) -> None:
        self._consumer = consumer

    @property
    def static_scale(self) -> torch.Tensor | None:
        return self._consumer.input_scale


def quantize_input(x: torch.Tensor, static_scale: torch.Tensor | None) -> Fp8Activations:
    """The PyTorch twin of the producing kernels' quantization (the CPU path)."""
    lead = x.shape[:-1]
    data, scale = quantize_tokens(x.reshape(-1, x.shape[-1]), static_scale)
    return Fp8Activations(data.view(*lead, x.shape[-1]), scale, x.dtype)


_current: Fp8Config | None = None


@contextlib.contextmanager
def fp8_linear_layers(config: Fp8Config | None) -> Iterator[None]:
    """Linear layers built inside hold fp8 weights (None: the model dtype), as
    torch.set_default_dtype decides the dtype of everything else built."""
    global _current
    previous, _current = _current, config
    try:
        yield
    finally:
        _current = previous


def current_fp8() -> Fp8Config | None:
    return _current


def quantize_rows(
    weight: torch.Tensor, amax: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight, fp32 scale per row) with weight ~= fp8 * scale[:, None]. amax: the rows'
    largest magnitudes when `weight` is only a slice of them (a row-parallel rank's columns),
    so every rank scales a row alike."""
    weight = weight.float()
    if amax is None:
        amax = weight.abs().amax(dim=1)
    scale = (amax.float() / FP8_MAX).clamp(min=MIN_SCALE)
    fp8 = (weight / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    return fp8, scale


def dequantize_blocks(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], what: str
) -> torch.Tensor:
    """A block-scaled fp8 weight [rows, columns] multiplied out in fp32: each (block[0] x
    block[1]) tile times its entry of ``scale_inv`` [ceil(rows / block[0]), ceil(columns /
    block[1])] (the dequantization multiplier, despite its name)."""
    if weight.dim() != 2:
        raise ValueError(f"{what}: a block-quantized fp8 weight of shape {tuple(weight.shape)}")
    rows, cols = weight.shape
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    if tuple(scale_inv.shape) != grid:
        raise ValueError(
            f"{what}: weight_scale_inv of shape {tuple(scale_inv.shape)} for a {rows}x{cols} "
            f"weight in {block[0]}x{block[1]} blocks; expected {grid}"
        )
    scale = scale_inv.float()
    if not bool(torch.isfinite(scale).all()) or bool((scale < 0).any()):
        raise ValueError(f"{what}: weight_scale_inv holds negative or non-finite scales")
    scale = scale.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return weight.float() * scale


def fp8_linear(
    x: torch.Tensor | Fp8Activations,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor | None,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """x @ (weight * weight_scale[:, None]).T + bias in x's dtype. weight: fp8 [out, in],
    row-major, so its transpose is the column-major operand cuBLASLt wants, with no copy. x comes
    unquantized, or as Fp8Activations from a kernel that quantized it while producing it. On
    CUDA the elementwise work runs in Triton kernels (kernels.fp8_quant), on the CPU in their
    PyTorch twins."""
    if isinstance(x, Fp8Activations):
        lead, dtype = x.data.shape[:-1], x.dtype
        x_fp8, x_scale = x.data.reshape(-1, x.data.shape[-1]), x.scale
    else:
        lead, dtype = x.shape[:-1], x.dtype
        x2 = x.reshape(-1, x.shape[-1])
        if x.is_cuda:
            from kvfleet.kernels import fp8_quant

            x_fp8, x_scale = fp8_quant.quantize_tokens(x2.contiguous(), input_scale)
        else:
            x_fp8, x_scale = quantize_tokens(x2, input_scale)
    if x_fp8.is_cuda and x_fp8.shape[0] <= _GEMM_TOKENS:
        from kvfleet.kernels import fp8_gemm

        y = fp8_gemm.small_batch_gemm(x_fp8, x_scale, weight, weight_scale, bias, dtype)
        return y.view(*lead, y.shape[-1])
    if x_fp8.is_cuda and x_fp8.shape[0] <= _SMALL_BATCH:
        from kvfleet.kernels import fp8_quant

        one = _unit_scale(x_fp8.device)
        # torch's FP8 GEMM is public in use but private by name: its stubs do not export it.
        acc = torch._scaled_mm(  # pyright: ignore[reportPrivateImportUsage]
            x_fp8, weight.t(), scale_a=one, scale_b=one, out_dtype=torch.float32
        )
        y = fp8_quant.scale_rows_cols(acc, x_scale, weight_scale, bias, dtype)
        return y.view(*lead, y.shape[-1])
    y = torch._scaled_mm(  # pyright: ignore[reportPrivateImportUsage]  # as above
        x_fp8,
        weight.t(),
        scale_a=x_scale,
        scale_b=weight_scale.view(1, -1),
        out_dtype=dtype,
        bias=bias,
    )
    return y.view(*lead, y.shape[-1])


_UNIT_SCALES: dict[torch.device, torch.Tensor] = {}


def _unit_scale(device: torch.device) -> torch.Tensor:
    # Made by the first (warm-up) forward pass, before any CUDA graph is captured.
    if device not in _UNIT_SCALES:
        _UNIT_SCALES[device] = torch.ones((), dtype=torch.float32, device=device)
    return _UNIT_SCALES[device]
