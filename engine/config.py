"""The model facts the engine derives from a checkpoint and its arguments (ModelConfig). The
arguments themselves are kvfleet.engine.engine_args' EngineArgs (also importable from here)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict

from kvfleet.engine.checkpoint_path import find_checkpoint
from kvfleet.engine.engine_args import EngineArgs
from kvfleet.engine.layers.fp8 import Fp8Config, check_fp8_device, resolve_fp8
from kvfleet.engine.pooling import PoolerConfig, has_sentence_transformers_pooling, resolve_pooler

logger = logging.getLogger(__name__)

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
}


class ModelConfig(BaseModel):
    """The checkpoint's HF config plus the settings the engine derives from it."""

    model_config = ConfigDict(arbitrary_types_allowed=True, frozen=True)

    path: Path
    hf_config: object
    architecture: str
    dtype: torch.dtype
    max_model_len: int
    vocab_size: int  # rows of the logits
    num_layers: int
    num_kv_heads: int
    head_dim: int
    quantization: Fp8Config | None = None
    # --runner resolved: generate, or pooling (an embedding model) with its pooler.
    runner: Literal["generate", "pooling"] = "generate"
    pooler: PoolerConfig | None = None
    # Experts placed whole per tensor-parallel rank (a mixture of experts with
    # --enable-expert-parallel and more than one rank).
    expert_parallel: bool = False

    @classmethod
    def from_args(cls, args: EngineArgs, device: torch.device) -> ModelConfig:
        from transformers import AutoConfig

        from kvfleet.engine.models import gguf_checkpoint

        path = find_checkpoint(args.model)
        gguf = path.is_file()
        hf_config = gguf_checkpoint.load_config(path) if gguf else AutoConfig.from_pretrained(path)
        archs = getattr(hf_config, "architectures", None) or []
        if not archs:
            raise ValueError(f"{path} names no architecture")

        native_len = int(hf_config.max_position_embeddings)
        if args.max_model_len is not None and args.max_model_len > native_len:
            raise ValueError(
                f"--max-model-len {args.max_model_len} is more than the model's context length "
                f"of {native_len} tokens (its max_position_embeddings): pass {native_len} or "
                "less, or leave it out to use the model's"
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
        model_dir = None if gguf else path
        runner = _resolve_runner(args.runner, archs[0], model_dir)
        pooler = None
        if runner == "pooling":
            pooler = resolve_pooler(model_dir, hf_config, args.pooling_type)
        elif args.pooling_type is not None:
            raise ValueError("--pooling-type applies to --runner pooling only")
        expert_parallel = _expert_parallel(args, hf_config)
        return cls(
            path=path,
            hf_config=hf_config,
            architecture=archs[0],
            dtype=_resolve_dtype(args.dtype, hf_config, device, gguf=gguf),
            max_model_len=args.max_model_len or native_len,
            vocab_size=hf_config.vocab_size,
            num_layers=hf_config.num_hidden_layers,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            quantization=quantization,
            runner=runner,
            pooler=pooler,
            expert_parallel=expert_parallel,
        )

    def kv_heads_per_rank(self, tensor_parallel_size: int) -> int:
        """KV heads one rank holds; with fewer KV heads than ranks each is replicated."""
        return max(1, self.num_kv_heads // tensor_parallel_size)


def _resolve_runner(
    asked: str, architecture: str, model_dir: Path | None
) -> Literal["generate", "pooling"]:
    from kvfleet.engine.models import POOLING_ARCHITECTURES, SUPPORTED_ARCHITECTURES

    body = architecture in POOLING_ARCHITECTURES and architecture not in SUPPORTED_ARCHITECTURES
    if asked == "auto":
        sentence_transformers = model_dir is not None and has_sentence_transformers_pooling(
            model_dir
        )
        asked = "pooling" if body or sentence_transformers else "generate"
    if asked == "generate" and body:
        raise ValueError(
            f"{architecture} is a decoder body without an LM head: it cannot generate text; "
            "serve it with --runner pooling"
        )
    if asked == "pooling" and architecture not in POOLING_ARCHITECTURES:
        raise ValueError(
            f"--runner pooling supports {', '.join(POOLING_ARCHITECTURES)}, not {architecture}"
        )
    return "pooling" if asked == "pooling" else "generate"


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


def _expert_parallel(args: EngineArgs, hf_config: object) -> bool:
    from kvfleet.engine.models.mixture_of_experts import num_experts

    experts = num_experts(hf_config)
    tp = args.tensor_parallel_size
    if not args.enable_expert_parallel or experts == 0 or tp == 1:
        return False
    if experts % tp:
        raise ValueError(
            f"--enable-expert-parallel: the model's {experts} experts do not divide over "
            f"tensor_parallel_size={tp} ranks"
        )
    return True


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
