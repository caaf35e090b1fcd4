"""The engine's arguments, named like vLLM's: what `kvfleet-engine` and `LLM()` are started with.

Importing this module costs no torch: the command line builds its parser (and prints --help) from
these fields before anything heavy is loaded. torch is imported where a device is looked at,
which is after the arguments are parsed."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvfleet.engine.host_memory import CPU_KV_SHARE, CPU_KV_SHARE_UNDER_LIMIT
from kvfleet.engine.lora_request import LoRARequest
from kvfleet.protocol.byte_size import ByteSize

if TYPE_CHECKING:
    import torch

# GPUs of this much memory or more (H100, H200, A100 80 GB) run more sequences a step by
# default, as vLLM's API server does there (1024): the batch, not the KV cache, then bounds
# throughput. A mixture of experts reads every expert once a step's tokens touch them all, so
# its steps cost nearly the same at 512 and 1024 sequences, and the larger batch serves more
# (Qwen3-30B-A3B on an H200: bench/RESULTS.md, twenty-second session); a dense 8B is
# compute-bound there and serves the same at either. Smaller GPUs hold too few tokens of cache
# to gain. The cost is CUDA graphs for more batch sizes, captured after the engine is ready.
LARGE_GPU_BYTES = 70 * 2**30


def default_max_num_seqs(device: torch.device) -> int:
    import torch

    if device.type == "cuda" and torch.cuda.get_device_properties(device).total_memory >= (
        LARGE_GPU_BYTES
    ):
        return 1024
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


# The largest --max-lora-rank: the batched LoRA kernels' (kvfleet.kernels.lora.MAX_RANK). Each
# LoRA layer holds max_loras slots of this rank.
MAX_LORA_RANK = 256


def parse_lora_module(text: str) -> tuple[str, str]:
    """--lora-modules' item as vLLM takes it: name=path, or {"name": ..., "path": ...}."""
    text = text.strip()
    if text.startswith("{"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"lora module {text!r} is not JSON: {e}") from None
        if not isinstance(value, dict) or set(value) - {"name", "path", "base_model_name"}:
            raise ValueError(
                f'lora module {text!r}: a JSON one is {{"name": ..., "path": ...}} (and an '
                "optional base_model_name)"
            )
        name, path = value.get("name"), value.get("path")
    else:
        name, sep, path = text.partition("=")
        if not sep:
            raise ValueError(f"lora module {text!r} is not name=path")
    if not isinstance(name, str) or not name.strip() or not isinstance(path, str) or not path:
        raise ValueError(f"lora module {text!r} needs a name and a path")
    return name.strip(), path


def default_max_num_batched_tokens(device: torch.device) -> int:
    return GPU_MAX_NUM_BATCHED_TOKENS if device.type == "cuda" else CPU_MAX_NUM_BATCHED_TOKENS


class EngineArgs(BaseModel):
    """Everything the engine is started with. Field names follow `vllm serve` flags."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    model: str = Field(
        description="HF model directory (config.json + *.safetensors), or a .gguf file or a "
        "directory holding one; default: SmolLM2-135M-Instruct (Q4_1 GGUF), fetched once "
        "into ~/.cache/kvfleet and served as smollm2-135m-instruct"
    )
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
        description="sequences run in one batch; default: 1024 on a GPU of "
        f"{LARGE_GPU_BYTES >> 30} GiB or more, 256 on a smaller GPU and on the CPU",
    )
    max_num_batched_tokens: int | None = Field(
        default=None,
        gt=0,
        description="tokens one step runs (prefill chunks plus decodes); default: "
        f"{GPU_MAX_NUM_BATCHED_TOKENS} on a GPU, {CPU_MAX_NUM_BATCHED_TOKENS} on the CPU",
    )
    enable_prefix_caching: bool = Field(
        default=True, description="reuse the KV cache of prompt prefixes seen before"
    )
    kv_events: bool = Field(
        default=True,
        description="publish the prefix cache's block hashes as they are stored and evicted "
        "at GET /kv_events, for routers that score prompts by what each engine holds; "
        "recorded only while a subscriber is connected",
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
    kv_cache_memory_bytes: ByteSize | None = Field(
        default=None,
        gt=0,
        description="memory for the KV cache; default on a GPU: what --gpu-memory-utilization "
        "leaves after the weights and activations; on the CPU: "
        f"1/{round(1 / CPU_KV_SHARE)} of the memory available at start (in a container whose "
        f"memory limit binds, 1/{round(1 / CPU_KV_SHARE_UNDER_LIMIT)} of what the limit leaves), "
        "at least one --max-model-len sequence and at most --max-num-seqs of them",
    )
    cpu_kv_cache_bytes: ByteSize = Field(
        default=0,
        ge=0,
        description="host memory for a second tier of the prefix cache (0: none): full blocks "
        "evicted from the device cache are copied there (pinned memory on a GPU) and a prefix "
        "found there is copied back instead of computed again; like vLLM's kv_offloading_size "
        "(its CPU offloading, formerly its swap space); needs prefix caching",
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
    runner: Literal["auto", "generate", "pooling"] = Field(
        default="auto",
        description="generate: text generation; pooling: an embedding model, which serves "
        "/v1/embeddings (prompts in, one vector each out, nothing generated); auto: pooling "
        "for a checkpoint that ships a sentence-transformers Pooling module (modules.json) or "
        "names a decoder body without its LM head (Qwen3Model, LlamaModel), else generate",
    )
    pooling_type: Literal["LAST", "MEAN"] | None = Field(
        default=None,
        description="with --runner pooling: LAST pools the last token's hidden state, MEAN the "
        "mean of every token's; default: the checkpoint's sentence-transformers Pooling "
        "module's mode, else LAST (normalised, as Qwen3-Embedding)",
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
    compile_cache_dir: str | None = Field(
        default=None,
        description="folder whose subfolder for this GPU, driver and CUDA/torch/Triton/kvfleet "
        "versions keeps Triton's compiled kernels and the memory profile's result between "
        "starts (a second start compiles nothing and skips the profile); default: "
        "$KVFLEET_COMPILE_CACHE_DIR, else Triton's own cache and no kept profile",
    )
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
    enable_lora: bool = Field(
        default=False,
        description="serve LoRA adapters of the model (PEFT folders): --lora-modules at start, "
        "LoRARequest in the Python API, the load endpoints with --enable-runtime-lora-updating",
    )
    lora_modules: list[str] = Field(
        default=[],
        description="adapters served from the start, each name=path (or JSON "
        '{"name": ..., "path": ...}); a request whose model is the name runs with it',
    )
    max_loras: int = Field(
        default=1, ge=1, description="adapters held in GPU slots at once (one batch mixes them)"
    )
    max_lora_rank: int = Field(
        default=16,
        ge=1,
        le=MAX_LORA_RANK,
        description="the largest adapter rank served; each slot holds an adapter of this rank",
    )
    max_cpu_loras: int | None = Field(
        default=None,
        ge=1,
        description="adapters kept in host memory (those in GPU slots included), loaded from "
        "disk when needed; default: --max-loras",
    )
    max_lora_wait_steps: int = Field(
        default=64,
        ge=1,
        description="fairness between adapters: a request whose adapter finds no GPU slot (or no "
        "room in host memory) is passed over by at most this many steps; then no request of "
        "another adapter starts until it has one (the base model's go on)",
    )
    enable_expert_parallel: bool = Field(
        default=False,
        description="mixtures of experts with --tensor-parallel-size N: each rank holds 1/N "
        "of every layer's experts whole (the experts must divide by N) instead of 1/N of "
        "every expert's intermediate dimension; attention stays split by heads. No effect on "
        "a dense model",
    )
    quantization: Literal["fp8"] | None = Field(
        default=None,
        description="fp8: linear-layer weights in fp8 (per-channel scales) with fp8 activations "
        "(per-token scales), quantized at load; needs a GPU of compute capability 8.9+. "
        "Default: as the checkpoint is (an fp8 checkpoint's quantization_config is read)",
    )

    @model_validator(mode="after")
    def _check(self) -> EngineArgs:
        # torch only where the machine decides (the defaults ask nothing of it), so that the
        # command line says a wrong model path before it loads torch.
        if self.device == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise ValueError("device='cuda' was asked for but no CUDA device is visible")
        tp = self.tensor_parallel_size
        if tp > 1 and self.resolved_device().type == "cuda":
            import torch

            if tp > torch.cuda.device_count():
                raise ValueError(
                    f"tensor_parallel_size={tp} needs {tp} GPUs but {torch.cuda.device_count()} "
                    "are visible"
                )
        if self.lora_modules and not self.enable_lora:
            raise ValueError("lora_modules needs enable_lora")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras "
                f"({self.max_loras}): an adapter in a GPU slot keeps its copy in host memory"
            )
        names = [parse_lora_module(m)[0] for m in self.lora_modules]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"lora_modules names {repeated} more than once")
        if self.cpu_kv_cache_bytes and not self.enable_prefix_caching:
            raise ValueError(
                "cpu_kv_cache_bytes needs enable_prefix_caching: the host tier keeps prefix-cache "
                "blocks"
            )
        if self.calculate_kv_scales and self.kv_cache_dtype == "auto":
            raise ValueError("calculate_kv_scales needs an fp8 KV cache (kv_cache_dtype='fp8')")
        if self.kv_cache_dtype != "auto" and self.resolved_device().type == "cuda":
            import torch

            major, minor = torch.cuda.get_device_capability()
            if (major, minor) < (8, 9):
                raise ValueError(
                    f"kv_cache_dtype={self.kv_cache_dtype!r} needs a GPU of compute capability "
                    f"8.9+ (Ada, Hopper or newer) for fp8 conversions; this GPU "
                    f"({torch.cuda.get_device_name()}) is sm_{major}{minor}: serve with "
                    "kv_cache_dtype='auto'"
                )
        return self

    def lora_requests(self) -> list[LoRARequest]:
        """--lora-modules as adapters, with ids 1, 2, ... in their order."""
        return [
            LoRARequest(name, i, path)
            for i, (name, path) in enumerate(map(parse_lora_module, self.lora_modules), 1)
        ]

    @property
    def cpu_loras(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras

    def kv_cache_torch_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        import torch

        return model_dtype if self.kv_cache_dtype == "auto" else torch.float8_e4m3fn

    def resolved_backend(self) -> str:
        if self.attention_backend != "auto":
            return self.attention_backend
        return "triton" if self.resolved_device().type == "cuda" else "torch"

    def resolved_device(self) -> torch.device:
        import torch

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
