"""Engine arguments (named like vLLM's) and the model facts derived from a checkpoint."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvfleet.engine.layers.fp8 import Fp8Config, check_fp8_device, resolve_fp8

logger = logging.getLogger(__name__)

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
}


class EngineArgs(BaseModel):
    """Everything the engine is started with. Field names follow `vllm serve` flags."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    model: str
    tokenizer: str | None = Field(
        default=None,
        description="HF tokenizer directory, for a GGUF file without one; default: the model's",
    )
    dtype: Literal["auto", "float32", "float", "float16", "half", "bfloat16"] = Field(
        default="auto",
        description="weights and activations; auto: the checkpoint's own dtype, and for GGUF "
        "bf16 on CUDA (fp16 without bf16), fp32 on the CPU",
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        default="auto", description="auto: cuda when a GPU is visible, else cpu"
    )
    block_size: Literal[16] = Field(default=16, description="tokens per KV-cache block")
    max_model_len: int | None = Field(
        default=None,
        gt=0,
        description="longest prompt + output in tokens; default: the model's context length",
    )
    max_num_seqs: int | None = Field(
        default=None,
        gt=0,
        description="sequences run in one batch; default: 512 on a GPU of 70 GiB or more, else 256",
    )
    max_num_batched_tokens: int | None = Field(
        default=None,
        gt=0,
        description="tokens one step runs (prefill chunks plus decodes); default: 8192 on a "
        "GPU, 512 on the CPU",
    )
    enable_prefix_caching: bool = Field(
        default=True, description="reuse the KV cache of prompt prefixes seen before"
    )
    num_gpu_blocks_override: int | None = Field(
        default=None,
        gt=1,
        description="KV-cache blocks to allocate; default: as many as the memory budget holds",
    )
    gpu_memory_utilization: float = Field(
        default=0.9,
        gt=0.0,
        le=1.0,
        description="fraction of the GPU's memory for weights, activations and the KV cache",
    )
    kv_cache_memory_bytes: int | None = Field(
        default=None,
        gt=0,
        description="bytes for the KV cache; default: what gpu_memory_utilization leaves on a "
        "GPU; on the CPU 1/64 of the memory available at start (in a container whose memory "
        "limit binds, half of what the limit leaves), at least one max_model_len sequence and "
        "at most max_num_seqs of them",
    )
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3"] = Field(
        default="auto",
        description="KV-cache element type; auto: the model dtype; fp8 (= fp8_e4m3): "
        "float8_e4m3fn with per-layer k/v scales (the checkpoint's, else 1.0, or see "
        "--calculate-kv-scales), half the bytes of bf16, so about twice the cached tokens; "
        "on a GPU it needs compute capability 8.9+",
    )
    calculate_kv_scales: bool = Field(
        default=False,
        description="with an fp8 KV cache: set each layer's k/v scales from the first batch's "
        "K/V (their absolute maximum, with 2x headroom) instead of the checkpoint's or 1.0",
    )
    load_format: Literal["auto", "dummy"] = Field(
        default="auto", description="dummy: random weights of the architecture, for benchmarks"
    )
    skip_tokenizer_init: bool = Field(
        default=False,
        description="no tokenizer: prompts must be token ids and outputs carry no text",
    )
    seed: int = Field(default=0, description="seed of random sampling and of dummy weights")
    attention_backend: Literal["auto", "torch", "triton"] = Field(
        default="auto", description="auto: triton on CUDA, the PyTorch reference on the CPU"
    )
    enforce_eager: bool = Field(default=False, description="never use CUDA graphs")
    async_scheduling: bool = Field(
        default=True,
        description="launch each step before the host has read the previous step's tokens, so "
        "the host's work on them (grammar, stop checks, outputs) overlaps the GPU's; off: "
        "every step waits for its tokens before the next is scheduled",
    )
    tensor_parallel_size: int = Field(
        default=1,
        ge=1,
        description="split the model over this many GPUs of this machine, one process each",
    )
    quantization: Literal["fp8"] | None = Field(
        default=None,
        description="fp8: linear-layer weights in fp8 (per-channel scales) with fp8 activations "
        "(per-token scales), quantized at load; needs a GPU of compute capability 8.9+. "
        "Default: as the checkpoint is (an fp8 checkpoint's quantization_config is read)",
    )

    @model_validator(mode="after")
    def _check(self) -> EngineArgs:
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' was asked for but no CUDA device is visible")
        tp = self.tensor_parallel_size
        if tp > 1 and self.resolved_device().type == "cuda" and tp > torch.cuda.device_count():
            raise ValueError(
                f"tensor_parallel_size={tp} needs {tp} GPUs but {torch.cuda.device_count()} "
                "are visible"
            )
        if self.calculate_kv_scales and self.kv_cache_dtype == "auto":
            raise ValueError("calculate_kv_scales needs an fp8 KV cache (kv_cache_dtype='fp8')")
        if self.kv_cache_dtype != "auto" and self.resolved_device().type == "cuda":
            major, minor = torch.cuda.get_device_capability()
            if (major, minor) < (8, 9):
                raise ValueError(
                    f"kv_cache_dtype={self.kv_cache_dtype!r} needs a GPU of compute capability "
                    f"8.9+ (Ada, Hopper or newer) for fp8 conversions; this GPU "
                    f"({torch.cuda.get_device_name()}) is sm_{major}{minor}: serve with "
                    "kv_cache_dtype='auto'"
                )
        return self

    def kv_cache_torch_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return model_dtype if self.kv_cache_dtype == "auto" else torch.float8_e4m3fn

    def resolved_backend(self) -> str:
        if self.attention_backend != "auto":
            return self.attention_backend
        return "triton" if self.resolved_device().type == "cuda" else "torch"

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def for_device(self, device: torch.device) -> EngineArgs:
        """These arguments with the defaults that depend on the device filled in."""
        update: dict[str, int] = {}
        if self.max_num_seqs is None:
            update["max_num_seqs"] = default_max_num_seqs(device)
        if self.max_num_batched_tokens is None:
            update["max_num_batched_tokens"] = default_max_num_batched_tokens(device)
        return self.model_copy(update=update) if update else self


# GPUs of this much memory or more (H100, H200, A100 80 GB) run more sequences a step by
# default, as vLLM's defaults do there: the batch, not the KV cache, then bounds throughput. On
# an H100, Llama-3-8B 1000 x 256/256 ran 7% faster in bf16 and 11% with fp8 weights and cache
# at 512 than at 256 (bench/RESULTS.md, twelfth session), for 7 s more of CUDA graph capture
# and 2% less KV cache; smaller GPUs hold too few tokens of cache to gain.
LARGE_GPU_BYTES = 70 * 2**30


def default_max_num_seqs(device: torch.device) -> int:
    if device.type == "cuda" and torch.cuda.get_device_properties(device).total_memory >= (
        LARGE_GPU_BYTES
    ):
        return 512
    return 256


# A step's time is what every running request waits for its next token, and a long prompt is
# computed a chunk of this many tokens a step. On the CPU a chunk of 2,048 tokens runs tens of
# seconds on a few cores while its cost per token is no lower than in chunks of 256 or 512 (the
# reference attention materializes each chunk's scores over its whole context): smaller chunks
# keep the other requests moving for no loss of throughput. The CPU's 512 still fits a decode
# row for each of its default 256 sequences beside a chunk. vLLM's API server takes 2,048 on the
# CPU, for many-core servers, and 8,192 on large GPUs.
GPU_MAX_NUM_BATCHED_TOKENS = 8192
CPU_MAX_NUM_BATCHED_TOKENS = 512


def default_max_num_batched_tokens(device: torch.device) -> int:
    return GPU_MAX_NUM_BATCHED_TOKENS if device.type == "cuda" else CPU_MAX_NUM_BATCHED_TOKENS


class ModelConfig(BaseModel):
    """The checkpoint's HF config plus the settings the engine derives from it."""

    model_config = ConfigDict(arbitrary_types_allowed=True, frozen=True)

    path: Path
    hf_config: object
    architecture: str
    dtype: torch.dtype
    max_model_len: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    quantization: Fp8Config | None = None

    @classmethod
    def from_args(cls, args: EngineArgs, device: torch.device) -> ModelConfig:
        from transformers import AutoConfig

        from kvfleet.engine.models import gguf_checkpoint

        path = Path(args.model)
        gguf_file = gguf_checkpoint.find_gguf(path)
        if gguf_file is not None:
            path = gguf_file
            hf_config = gguf_checkpoint.load_config(gguf_file)
        elif (path / "config.json").is_file():
            hf_config = AutoConfig.from_pretrained(path)
        else:
            raise FileNotFoundError(
                f"{args.model!r} has no config.json: kvfleet loads models from a local GGUF file "
                "or directory (HF layout: config.json + *.safetensors); it never downloads from "
                "a hub"
            )
        archs = getattr(hf_config, "architectures", None) or []
        if not archs:
            raise ValueError(f"{path} names no architecture")

        native_len = int(hf_config.max_position_embeddings)
        if args.max_model_len is not None and args.max_model_len > native_len:
            raise ValueError(
                f"max_model_len={args.max_model_len} exceeds the model's "
                f"max_position_embeddings={native_len}"
            )
        num_heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
        _check_tensor_parallel(args.tensor_parallel_size, num_heads, num_kv_heads)
        quantization = resolve_fp8(
            args.quantization,
            getattr(hf_config, "quantization_config", None),
            dummy=args.load_format == "dummy",
        )
        if quantization is not None:
            check_fp8_device(device)
        return cls(
            path=path,
            hf_config=hf_config,
            architecture=archs[0],
            dtype=_resolve_dtype(args.dtype, hf_config, device, gguf=gguf_file is not None),
            max_model_len=args.max_model_len or native_len,
            num_layers=hf_config.num_hidden_layers,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            quantization=quantization,
        )

    def kv_heads_per_rank(self, tensor_parallel_size: int) -> int:
        """KV heads one rank holds; with fewer KV heads than ranks each is replicated."""
        return max(1, self.num_kv_heads // tensor_parallel_size)


def _check_tensor_parallel(tp: int, num_heads: int, num_kv_heads: int) -> None:
    if num_heads % tp:
        raise ValueError(
            f"tensor_parallel_size={tp} does not divide the model's {num_heads} attention heads"
        )
    if num_kv_heads % tp and tp % num_kv_heads:
        raise ValueError(
            f"tensor_parallel_size={tp} and the model's {num_kv_heads} KV heads: one must divide "
            "the other"
        )


def _resolve_dtype(
    name: str, hf_config: object, device: torch.device, *, gguf: bool
) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    if gguf:
        # A GGUF file declares no dtype (its tensors are quantized): the device decides.
        bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
        return gguf_auto_dtype(device.type, bf16_supported=bf16)
    declared = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(declared, str):
        declared = _DTYPES.get(declared, torch.float32)
    dtype = declared if isinstance(declared, torch.dtype) else torch.float32
    if device.type == "cpu" and dtype == torch.float16:
        # CPU fp16 matmuls are slow and imprecise; bf16 or fp32 are the CPU choices.
        return torch.float32
    return dtype


def gguf_auto_dtype(device_type: str, *, bf16_supported: bool) -> torch.dtype:
    """`--dtype auto` for a GGUF checkpoint, as vLLM picks it: bf16 on a GPU that has it, else
    fp16. On the CPU fp32, for accuracy first: bf16 keeps 8 mantissa bits: a bf16 matmul of 576-wide
    rows (the default model's width) errs by ~1% of its result, enough to change a small
    model's greedy tokens (and the suite's oracle, HF transformers, runs GGUF in fp32). Speed
    does not argue the other way in general: half precision is fast on a CPU only with
    AVX512-BF16 or AMX; without them PyTorch converts on the fly (fp16 measured 1.8x slower
    than fp32 on an EPYC). `--dtype bfloat16` opts in where the CPU has it."""
    if device_type == "cuda":
        return torch.bfloat16 if bf16_supported else torch.float16
    return torch.float32
