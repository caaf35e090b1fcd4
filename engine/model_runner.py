"""Runs the model on one flat batch per step. Rank 0 turns the scheduler's decision into a
`StepPlan` (input ids, lengths, the block-table entries that changed) that every tensor-parallel
rank runs through its shard of the model; rank 0 alone samples and reads the tokens back: a
`Step` goes through launch(), sample() and resolve()."""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from kvfleet.engine.attention_backend import get_attention_backend
from kvfleet.engine.attention_metadata import AttentionMetadata, attention_context
from kvfleet.engine.config import EngineArgs, ModelConfig
from kvfleet.engine.cuda_graphs import DecodeGraphs
from kvfleet.engine.distributed import all_reduce_min, broadcast_from_rank0, tp_rank, tp_size
from kvfleet.engine.graph_schedule import upfront_sizes
from kvfleet.engine.host_kv_cache import HostKVCache
from kvfleet.engine.host_memory import available_memory, cpu_kv_budget
from kvfleet.engine.kv_cache_manager import cdiv
from kvfleet.engine.kv_transfers import KVTransfers, TransfersDone
from kvfleet.engine.layers.attention import Attention
from kvfleet.engine.layers.fp8 import fp8_linear_layers
from kvfleet.engine.layers.lora import LoRALayers, attach_lora, lora_context
from kvfleet.engine.layers.moe import expert_parallel_layers
from kvfleet.engine.lora_adapter import LoRAAdapter, check_weights, read_config
from kvfleet.engine.lora_adapter import read_weights as read_lora_weights
from kvfleet.engine.lora_request import LoRARequest
from kvfleet.engine.lora_slot_loads import SlotLoads
from kvfleet.engine.lora_slots import SlotChanges
from kvfleet.engine.memory_profile_cache import (
    MemoryProfile,
    load_profile,
    profile_key,
    store_profile,
)
from kvfleet.engine.models import build_pooling_model, get_model_class
from kvfleet.engine.models.loader import init_dummy_weights, load_weights
from kvfleet.engine.pooling import finish_embedding
from kvfleet.engine.request import Request
from kvfleet.engine.sampler import Logprobs, SampledBatch, Sampler, to_device
from kvfleet.engine.scheduler import SchedulerOutput
from kvfleet.engine.startup_timing import AFTER_READY, StartupTimer
from kvfleet.engine.structured_output import StructuredOutputs

logger = logging.getLogger(__name__)

# K/V token reads a step may add by running its prompt tokens as decode rows (each re-reads its
# context): 32k token-positions x ~4 KB a layer for 8B-class models stays under a millisecond on
# an H100, against 15-25 ms of host time for an eager forward pass.
_GRAPH_EXTRA_KV_READS = 32768

# Prompt positions whose logits exist at once when scoring a prompt: bounds the memory at this many
# rows of the vocabulary in fp32 (256 x 128k words = 128 MiB), whatever the chunk size.
_PROMPT_LOGPROBS_ROWS = 256


@runtime_checkable
class LanguageModel(Protocol):
    """What the runner calls on a model (engine/models): the forward pass of one flat batch,
    the logits of chosen hidden states, its attention layers."""

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def attention_layers(self) -> list[Attention]: ...


class StepInterrupted(Exception):
    """The runner's owner interrupted the forward pass in progress (ModelRunner.interrupting)."""


def _interrupt(module: torch.nn.Module, args: object) -> None:
    raise StepInterrupted("the forward pass was interrupted")


def fits_decode_graph(positions: np.ndarray, seq_lens: np.ndarray, max_rows: int) -> bool:
    """Whether a step can replay a decode CUDA graph with one row per token. A prompt token at
    position p is a decode row over positions 0..p of its sequence: exact, because each layer
    writes the step's K/V before it attends. Worth it for short prompts and small chunks next to
    decodes (the eager pass they would otherwise force is host-bound); not for a long context's
    chunk, whose every token would re-read the whole context."""
    if len(positions) > max_rows:
        return False
    extra_reads = int(positions.sum()) + len(positions) - int(seq_lens.sum())
    return extra_reads <= _GRAPH_EXTRA_KV_READS


# Cascade attention (a shared prefix attended once per decode step, not once per sequence) pays
# for its extra kernel and merge only from a prefix of this many tokens and this many rows.
CASCADE_MIN_PREFIX = 256
CASCADE_MIN_ROWS = 8


def shared_prefix_len(tables: np.ndarray, seq_lens: np.ndarray, block_size: int) -> int:
    """Tokens at the start of every row's context held in the same physical blocks (prefix-cache
    hits on one prompt, or rows of one prompt), in whole blocks no longer than the shortest row,
    so each block is full and was written no later than this step's K/V."""
    full = int(seq_lens.min()) // block_size if len(seq_lens) else 0
    # Most batches share nothing: one column settles that without comparing whole tables.
    if full == 0 or not (tables[:, 0] == tables[0, 0]).all():
        return 0
    same = (tables[:, :full] == tables[0, :full]).all(axis=0)
    return (full if same.all() else int(same.argmin())) * block_size


@dataclass(frozen=True, slots=True)
class StepPlan:
    """One step, as every rank needs it: small (O(batch) plus the block ids the scheduler just
    appended), because rank 0 sends it to each tensor-parallel worker every step."""

    rows: np.ndarray  # block-table row of each sequence
    num_new: np.ndarray  # tokens each sequence adds this step
    computed: np.ndarray  # tokens each sequence already has in the KV cache
    input_ids: np.ndarray
    table_writes: list[tuple[int, int, list[int]]]  # (row, first column, block ids)
    sampling: np.ndarray  # indices of the sequences that sample this step
    # Input ids still on the device: the previous step's sampled tokens (async scheduling).
    # input_ids[pending_ids[j]] is that step's token pending_src[j] of its num_prev_sampled;
    # rank 0 broadcasts them to the other ranks.
    pending_ids: np.ndarray
    pending_src: np.ndarray
    num_prev_sampled: int
    # Sequences that score prompt tokens this step: (sequence index, top N, the prompt tokens
    # that its chunk's first positions predict). Every rank computes their logits (the LM head
    # is a collective); rank 0 keeps the logprobs.
    prompt_logprobs: tuple[tuple[int, int, tuple[int, ...]], ...] = ()
    # Each sequence's LoRA slot (-1: the base model); empty when the engine serves no LoRA or
    # no sequence of the step uses an adapter. The adapters every rank copies into slots first.
    lora_slots: np.ndarray | None = None
    lora_changes: SlotChanges | None = None
    # Tensor parallelism: the adapters rank 0 read into host memory (or dropped, None) since
    # the last plan, for the workers' copies; rank 0 alone reads the disk. Sent once per
    # adapter read, not per step.
    lora_host_changes: dict[int, LoRAAdapter | None] | None = None
    # Embedding requests (a pooling engine): the sequences whose chunk adds to a mean pooling,
    # and those whose prompt ends this step, which rank 0 pools.
    pool_mean: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    pool_end: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    # KV blocks copied to and from the host tier before the forward pass.
    kv_transfers: KVTransfers | None = None


def transfers_plan(transfers: KVTransfers) -> StepPlan:
    """A plan that runs no sequence, only the host tier's copies (a step whose only request
    started a load)."""
    empty = np.zeros(0, dtype=np.int64)
    return StepPlan(
        rows=empty,
        num_new=empty,
        computed=empty,
        input_ids=empty,
        table_writes=[],
        sampling=empty,
        pending_ids=empty,
        pending_src=empty,
        num_prev_sampled=0,
        kv_transfers=transfers,
    )


# A sequence's prompt tokens scored in one step: the position in the prompt of the first, and
# each one's logprob and top N.
PromptLogprobsChunk = tuple[int, list[Logprobs]]


@dataclass(slots=True)
class Step:
    """One step on rank 0, from its launch to the host reading its tokens: launch() queues its
    forward pass, sample() its sampling (the logits give way to the sampled batch), resolve()
    reads it."""

    out: SchedulerOutput
    reqs: list[Request]  # the sequences that sample, row for row of `logits`, then of `sampled`
    logits: torch.Tensor | None
    prompt_logprobs: dict[str, PromptLogprobsChunk]
    # Request id -> its embedding (fp32, on the device), for the embedding requests whose
    # prompt ended in this step.
    embeddings: dict[str, torch.Tensor] = field(default_factory=dict)
    sampled: SampledBatch | None = None
    # Request id -> its row of sampled.token_ids, where the next step finds its input id.
    sampled_rows: dict[str, int] = field(default_factory=dict)


@dataclass(slots=True)
class StepResult:
    """A step's results on the host: the tokens its live rows sampled, row for row with their
    requests, and the prompt tokens it scored."""

    reqs: list[Request]
    token_ids: list[int]
    logprobs: list[Logprobs | None]  # None where the request did not ask
    # Row -> the error that failed that request's sampling; its token is void.
    failed: dict[int, Exception] = field(default_factory=dict)
    # Request id -> the prompt tokens it scored (prompt_logprobs), sampling or not.
    prompt_logprobs: dict[str, PromptLogprobsChunk] = field(default_factory=dict)
    # Request id -> its embedding, for the embedding requests whose prompt ended in the step.
    embeddings: dict[str, list[float]] = field(default_factory=dict)

    def new_tokens(self) -> dict[str, int]:
        """Each request's token, those of the failed rows left out."""
        failed = self.failed
        return {
            r.request_id: t
            for i, (r, t) in enumerate(zip(self.reqs, self.token_ids, strict=True))
            if i not in failed
        }


def build_model(mc: ModelConfig, device: torch.device) -> torch.nn.Module:
    """The model's modules on ``device`` in mc.dtype (weights unloaded), in this rank's share:
    the generating or the embedding model as mc.runner says, fp8 linears and experts as
    mc.quantization says, experts placed as mc.expert_parallel says."""
    prev_dtype = torch.get_default_dtype()
    torch.set_default_dtype(mc.dtype)
    try:
        with (
            torch.device(device),
            fp8_linear_layers(mc.quantization),
            expert_parallel_layers(mc.expert_parallel),
        ):
            if mc.runner == "pooling":
                return build_pooling_model(mc.hf_config, mc.architecture)
            return get_model_class(mc.architecture)(mc.hf_config, mc.architecture)
    finally:
        torch.set_default_dtype(prev_dtype)


def weight_bytes_per_rank(mc: ModelConfig) -> int:
    """What this rank's weights take, counted on the meta device: every parameter the model
    builds, so a mixture of experts counts all its experts (or this rank's share of them),
    not the few a token uses."""
    model = build_model(mc, torch.device("meta"))
    return sum(p.numel() * p.element_size() for p in model.parameters())


class ModelRunner:
    def __init__(
        self,
        args: EngineArgs,
        model_config: ModelConfig,
        device: torch.device,
        on_loaded: Callable[[], None] | None = None,
        send_plan: Callable[[StepPlan], None] | None = None,
        structured: StructuredOutputs | None = None,
        startup: StartupTimer | None = None,
        cache_folder: Path | None = None,
    ) -> None:
        """`on_loaded` runs once the weights are in, before the first collective: the
        tensor-parallel ranks check each other there. Rank 0 of several hands each step's plan
        to the other ranks through `send_plan`, and samples under the grammars of `structured`
        (the engine's, when it has a tokenizer). `startup` times the phases of the set-up;
        `cache_folder` (compile_cache.py) keeps the memory profile's result between starts."""
        self.args = args
        self.model_config = model_config
        self.device = device
        self.send_plan = send_plan
        self.structured = structured
        self.cache_folder = cache_folder
        self.dtype = model_config.dtype
        self.kv_dtype = args.kv_cache_torch_dtype(self.dtype)
        self.block_size = args.block_size
        self.max_blocks_per_seq = cdiv(model_config.max_model_len, self.block_size)
        self.num_kv_heads = model_config.kv_heads_per_rank(tp_size())
        # EngineCore resolved them for the device (EngineArgs.for_device) for every rank.
        if args.max_num_seqs is None or args.max_num_batched_tokens is None:
            raise ValueError("the runner needs arguments resolved by EngineArgs.for_device")
        self.max_num_seqs = args.max_num_seqs
        self.max_num_batched_tokens = args.max_num_batched_tokens
        # release() gives the model and its memory back; no step runs after.
        self.released = False

        # A pooling engine's sequences end at their prompt's last position: no logits, no
        # decode steps (and so no decode CUDA graphs).
        self.pooling = model_config.runner == "pooling"
        # Block-table row -> the sum of its mean-pooled sequence's hidden states so far (fp32):
        # a chunked prompt's mean spans its chunks. Dropped with the row.
        self.pool_sums: dict[int, torch.Tensor] = {}

        torch.manual_seed(args.seed)
        # LoRA: the projections adapters may target (by checkpoint module name) and their
        # slots; the adapters held in host memory, by lora_int_id, each as its slot image (the
        # bytes of one slot on this rank: a load is one copy); the loads in flight.
        self.lora: LoRALayers | None = None
        self.lora_host: dict[int, torch.Tensor] = {}
        self.lora_loads: SlotLoads | None = None
        # Rank 0 of several: lora_host's changes since the last plan, for the workers.
        self._lora_host_changes: dict[int, LoRAAdapter | None] = {}
        self.startup = startup = startup or StartupTimer(process_seconds=0.0)
        with startup.phase("weights"):
            self.model = self._load_model()
            if on_loaded is not None:
                on_loaded()
        self.backend = get_attention_backend(args.resolved_backend(), model_config.max_model_len)
        with startup.phase("memory_profile"):
            self.num_blocks = self._num_kv_blocks()
        with startup.phase("kv_cache"):
            self.kv_caches = self._allocate_kv_cache(self.num_blocks)
            self.host_kv = self._allocate_host_tier()
        self.num_host_blocks = 0 if self.host_kv is None else self.host_kv.num_slots
        # Only rank 0 samples; the workers' logits are computed (the LM head is a collective)
        # and dropped.
        vocab = model_config.vocab_size
        self.sampler = Sampler(vocab, device, args.seed) if tp_rank() == 0 else None
        if device.type == "cuda":  # kernels compile now, not in someone's request
            with startup.phase("warm_up"):
                for num_seqs in self.backend.warm_up_batches(self.max_num_seqs):
                    self._dummy_forward([32] * num_seqs)
        # Only layers without a sliding window take the shared-prefix pass.
        self.cascade = self.backend.supports_cascade and any(
            layer.sliding_window is None for layer in self.model.attention_layers()
        )
        self.graphs: DecodeGraphs | None = None
        if (
            device.type == "cuda"
            and self.backend.supports_cuda_graphs
            and not args.enforce_eager
            and not self.pooling
        ):
            self.graphs = DecodeGraphs(
                self.model,
                self.max_num_seqs,
                self.max_blocks_per_seq,
                model_config.max_model_len,
                device,
                CASCADE_MIN_ROWS if self.cascade else None,
                lora=args.enable_lora,
            )
            # One rank captures a few sizes now and the rest while serving, between steps
            # (capture_next_graph). Tensor-parallel ranks capture every size now: a graph holds
            # collectives, which every rank would have to capture in the same step.
            with startup.phase("graph_capture"):
                sizes = self.graphs.sizes if tp_size() > 1 else upfront_sizes(self.graphs.sizes)
                self.graphs.capture(sizes)
        # The first real batch sets the FP8 KV scales (the warm-up and capture above ran on
        # dummy inputs); it runs eagerly, since a captured graph does not calibrate.
        self.kv_scales_pending = args.calculate_kv_scales
        for layer in self.model.attention_layers():
            layer.calculate_kv_scales = args.calculate_kv_scales

        # Persistent block tables, one row per running request: each step writes only the block
        # ids the scheduler appended, so host work does not grow with context length.
        self.block_table = np.zeros((self.max_num_seqs, self.max_blocks_per_seq), dtype=np.int32)
        self.row_len = np.zeros(self.max_num_seqs, dtype=np.int64)
        self.rows: dict[str, int] = {}
        self.free_rows = list(range(self.max_num_seqs - 1, -1, -1))

    # -- set-up ----------------------------------------------------------------------------
    def _load_model(self) -> LanguageModel:
        mc = self.model_config
        if self.device.type == "cuda":
            self._check_weights_fit()
        model = build_model(mc, self.device)
        if self.args.load_format == "dummy":
            init_dummy_weights(model, self.args.seed)
        else:
            # One bar for the process group: every rank loads the same tensors.
            block = mc.quantization.weight_block_size if mc.quantization else None
            # One rank reads straight to its GPU; tensor-parallel ranks read on the host and
            # send only their slice of each tensor over PCIe.
            load_weights(
                model,
                mc.path,
                progress=tp_rank() == 0,
                weight_block_size=block,
                device=self.device if tp_size() == 1 else None,
            )
        model.eval()
        if self.args.enable_lora:
            self.lora = attach_lora(
                model, self.args.max_loras, self.args.max_lora_rank, self.dtype, self.device
            )
            if not self.lora.targets:
                raise ValueError(
                    f"LoRA (enable_lora) is not supported for {mc.architecture}: it has none "
                    "of the q/k/v/o/gate/up/down projections adapters target"
                )
            self._check_host_memory(
                self._lora_host_bytes(), "the LoRA adapters' host copies", "--max-cpu-loras"
            )
            # Rank 0's load times are the metrics; the workers keep no record.
            self.lora_loads = SlotLoads(self.lora, timed=tp_rank() == 0)
            buffer = self.lora.buffer
            if tp_rank() == 0:
                logger.info(
                    "LoRA: %d slots of %.1f MiB a rank (rank %d); each adapter in host memory "
                    "takes one slot's size, %d at most", buffer.shape[0],
                    buffer[0].nbytes / (1 << 20), self.args.max_lora_rank, self.args.cpu_loras,
                )  # fmt: skip
        if not isinstance(model, LanguageModel):
            raise TypeError(f"{type(model).__name__} lacks what the runner calls on a model")
        return model

    def _check_weights_fit(self) -> None:
        """Fail with the numbers, not a CUDA out-of-memory error halfway through loading."""
        mc = self.model_config
        need = weight_bytes_per_rank(mc)
        total = torch.cuda.get_device_properties(self.device).total_memory
        budget = total * self.args.gpu_memory_utilization
        if need > budget:
            raise ValueError(
                f"the model's weights take {need / 2**30:.1f} GiB per GPU at {mc.dtype}"
                f"{' (linear layers in fp8)' if mc.quantization else ''} with "
                f"tensor_parallel_size={tp_size()}, more than gpu_memory_utilization="
                f"{self.args.gpu_memory_utilization} of this GPU's {total / 2**30:.1f} GiB: "
                "raise tensor_parallel_size (or gpu_memory_utilization)"
            )

    def _allocate_host_tier(self) -> HostKVCache | None:
        """The host tier of --cpu-kv-cache-bytes (None without it): its slots hold whole blocks
        of every rank's heads, the flag being the engine's host memory, each rank pinning its
        share."""
        args = self.args
        num = args.cpu_kv_cache_bytes // (self.block_bytes * tp_size())
        if not num or not args.enable_prefix_caching or self.pooling:
            return None
        self._check_host_tier_fits(num)
        host_kv = HostKVCache(self.kv_caches, num, self.device, track=tp_rank() == 0)
        if tp_rank() == 0:
            logger.info(
                "host KV tier: %d blocks (%.2f GiB of host memory%s)",
                num,
                num * self.block_bytes * tp_size() / 2**30,
                ", pinned" if self.device.type == "cuda" else "",
            )
        return host_kv

    def _lora_host_bytes(self) -> int:
        """What the adapters' host copies take at most, every rank's: max_cpu_loras slot
        images each (pinned on a GPU), allocated as adapters are read."""
        if self.lora is None:
            return 0
        return self.args.cpu_loras * self.lora.buffer[0].nbytes * tp_size()

    def _check_host_tier_fits(self, num_blocks: int) -> None:
        """The host tier is allocated (and pinned) whole at start, beside the adapters' host
        copies: a tier the host cannot hold with them is refused now rather than killed later."""
        tier = num_blocks * self.block_bytes * tp_size()
        lora = self._lora_host_bytes()
        what = "the host KV tier" + (" and the LoRA adapters' host copies" if lora else "")
        self._check_host_memory(tier + lora, what, "--cpu-kv-cache-bytes")

    def _check_host_memory(self, need: int, what: str, flag: str) -> None:
        """`need` bytes of host memory for `what` at most, refused (lower `flag`) when the host
        has fewer available. Under a container's memory limit the headroom left counts the
        page cache (the weights just read) as used, though the kernel reclaims it: there more
        than it is only warned of."""
        available = available_memory()
        if need <= available.bytes:
            return
        if available.under_limit:
            logger.warning(
                "%s take %.1f GiB of host memory; the container's memory limit leaves %.1f GiB "
                "beyond what the cgroup holds now, page cache included: if they do not fit, "
                "lower %s",
                what,
                need / 2**30,
                available.bytes / 2**30,
                flag,
            )
            return
        raise ValueError(
            f"{what} take {need / 2**30:.1f} GiB of host memory but {available.bytes / 2**30:.1f}"
            f" GiB are available: lower {flag}"
        )

    def capture_next_graph(self, idle: bool) -> bool:
        """Between steps: capture the decode graph the schedule picks now (graph_schedule), if
        any; whether one was captured."""
        graphs = self.graphs
        if graphs is None or graphs.schedule.done or self.released:
            return False
        size = graphs.schedule.next_capture(time.monotonic(), idle)
        if size is None:
            return False
        started = time.perf_counter()
        graphs.capture([size])
        self.startup.record(AFTER_READY, time.perf_counter() - started)
        return True

    def capture_all_graphs(self) -> None:
        """Capture every decode graph not captured yet (an offline engine, which serves no
        one before its first batch)."""
        if self.graphs is not None and not self.graphs.schedule.done:
            with self.startup.phase("graph_capture"):
                self.graphs.capture()

    @property
    def graphs_pending(self) -> bool:
        return self.graphs is not None and not self.graphs.schedule.done and not self.released

    @property
    def block_bytes(self) -> int:
        mc = self.model_config
        per_layer = 2 * self.block_size * self.num_kv_heads * mc.head_dim * self.kv_dtype.itemsize
        return per_layer * mc.num_layers

    def _num_kv_blocks(self) -> int:
        args = self.args
        if args.num_gpu_blocks_override is not None:
            num = args.num_gpu_blocks_override
        else:
            budget = args.kv_cache_memory_bytes
            if budget is None and self.device.type == "cuda":
                budget = self._cuda_kv_budget()
            elif budget is None:
                sequence = self.max_blocks_per_seq * self.block_bytes
                # Plus the null block, so that the floor of one full sequence holds.
                budget = cpu_kv_budget(available_memory(), sequence, self.max_num_seqs)
                budget += self.block_bytes
            num = budget // self.block_bytes
            # Every rank holds the same blocks (its own heads of them): the smallest budget wins.
            num = all_reduce_min(num, self.device)
        if num < 2:
            raise ValueError(
                f"the KV cache budget holds {num} blocks of {self.block_bytes} bytes; at least 2 "
                "are needed (raise gpu_memory_utilization or kv_cache_memory_bytes)"
            )
        tokens = (num - 1) * self.block_size
        if tp_rank() == 0:
            self._log_kv_size(num, tokens)
        return num

    def _log_kv_size(self, num: int, tokens: int) -> None:
        logger.info(
            "KV cache: %d blocks of %d tokens (%d tokens, %.2f GiB, %s); max concurrency at "
            "max_model_len=%d: %.2fx (--kv-cache-memory-bytes sets the size)",
            num - 1,
            self.block_size,
            tokens,
            num * self.block_bytes / 2**30,
            str(self.kv_dtype).removeprefix("torch."),
            self.model_config.max_model_len,
            tokens / self.model_config.max_model_len,
        )

    def _cuda_kv_budget(self) -> int:
        """Memory left for the KV cache after the weights and the peak activations of a forward
        pass at max_num_batched_tokens, within gpu_memory_utilization of the whole card."""
        torch.cuda.empty_cache()
        peak, kept = self._profile_peak()
        free, total = torch.cuda.mem_get_info(self.device)
        outside_torch = (total - free) - torch.cuda.memory_reserved(self.device)
        budget = int(total * self.args.gpu_memory_utilization) - peak - max(outside_torch, 0)
        logger.info(
            "memory profile%s: %.2f GiB peak in torch, %.2f GiB outside torch, %.2f GiB total; "
            "%.2f GiB left for the KV cache",
            " (kept from an earlier start)" if kept else "",
            peak / 2**30,
            outside_torch / 2**30,
            total / 2**30,
            budget / 2**30,
        )
        return max(budget, 0)

    def _profile_peak(self) -> tuple[int, bool]:
        """The peak memory of a forward pass at the largest batch, and whether it was kept from
        an earlier start of this configuration rather than measured. One rank alone: the
        profile of several is a forward pass with collectives, which every rank runs."""
        folder = self.cache_folder if tp_size() == 1 else None
        weights = torch.cuda.memory_allocated(self.device)
        key = ""
        if folder is not None:
            total = torch.cuda.get_device_properties(self.device).total_memory
            key = profile_key(self.model_config, self.args, total)
            peak = load_profile(folder, key, weights)
            if peak is not None:
                return peak, True
        torch.cuda.reset_peak_memory_stats(self.device)
        self._profile_run()
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        if folder is not None:
            store_profile(folder, MemoryProfile(key=key, weight_bytes=weights, peak_bytes=peak))
        return peak, False

    def _profile_run(self) -> None:
        """A forward pass as large as the scheduler can ever ask for, against a one-block cache
        that every slot points at, then sampling for max_num_seqs rows."""
        max_seqs = self.max_num_seqs
        num_tokens = min(self.max_num_batched_tokens, max_seqs * self.model_config.max_model_len)
        num_seqs = min(max_seqs, num_tokens)
        lens = [num_tokens // num_seqs] * num_seqs
        lens[-1] += num_tokens - sum(lens)
        caches = self._allocate_kv_cache(1)
        self._dummy_forward(lens)
        del caches
        self._bind_kv_cache([])

    def _dummy_forward(self, lens: list[int]) -> None:
        """Forward + sampling-sized logits for sequences of the given lengths, every slot and
        block-table entry pointing at block 0 (the null block, never handed to a request)."""
        num_tokens, num_seqs = sum(lens), len(lens)
        qsl = np.concatenate([[0], np.cumsum(lens)])
        positions = np.concatenate([np.arange(n) for n in lens])
        meta = AttentionMetadata(
            slot_mapping=torch.zeros(num_tokens, dtype=torch.long, device=self.device),
            block_tables=torch.zeros(
                (num_seqs, cdiv(max(lens), self.block_size)), dtype=torch.int32, device=self.device
            ),
            seq_lens=torch.tensor(lens, device=self.device),
            query_start_loc=torch.tensor(qsl, device=self.device),
            seq_lens_cpu=list(lens),
            query_start_loc_cpu=qsl.tolist(),
            max_query_len=max(lens),
            max_seq_len=max(lens),
        )
        ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        pos = torch.from_numpy(positions).to(self.device)
        # Every token through slot 0: the adapters' activations count in the memory profile.
        slots = None
        if self.lora is not None:
            slots = torch.zeros(num_tokens, dtype=torch.int32, device=self.device)
        with torch.inference_mode(), attention_context(meta), lora_context(slots):
            hidden = self.model(ids, pos)
            if not self.pooling:
                logits = self.model.compute_logits(hidden[qsl[1:] - 1]).float()
                logits.softmax(-1).sort(dim=-1)

    def _allocate_kv_cache(self, num_blocks: int) -> list[torch.Tensor]:
        mc = self.model_config
        shape = (2, num_blocks, self.block_size, self.num_kv_heads, mc.head_dim)
        caches = [
            torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
            for _ in range(mc.num_layers)
        ]
        self._bind_kv_cache(caches)
        return caches

    def release(self) -> None:
        """Give back the KV cache, the CUDA graphs and the weights (the runner runs no step
        after this): a stopped engine frees its memory even while something still refers to
        it (a server object a caller keeps, an LLM in a notebook)."""
        if self.released:
            return
        self._bind_kv_cache([])
        self.kv_caches = []
        self.host_kv = None
        self.graphs = None
        del self.model
        self.released = True
        # Now rather than whenever the collector runs: a tensor-parallel teardown waits for
        # every CUDA graph that captured a collective to be destroyed.
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    @contextlib.contextmanager
    def interrupting(self) -> Iterator[None]:
        """While in this block the forward pass in progress, from any thread, and any later one
        raise StepInterrupted before their next attention layer. Hooks put on for the block
        alone: the forward passes of serving pay nothing for it. (A replayed CUDA graph runs no
        hook: it is one short decode step.)"""
        if self.released:
            yield
            return
        # Torch reads a module's hooks into a tuple at each call, under the GIL: adding them
        # while another thread is in the forward pass is safe.
        handles = [
            layer.register_forward_pre_hook(_interrupt) for layer in self.model.attention_layers()
        ]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _bind_kv_cache(self, caches: list[torch.Tensor]) -> None:
        layers = self.model.attention_layers()
        for i, layer in enumerate(layers):
            layer.kv_cache = caches[i] if caches else None
            layer.backend = self.backend

    # -- per step --------------------------------------------------------------------------
    def _release(self, request_id: str) -> None:
        row = self.rows.pop(request_id, None)
        if row is not None:
            self.row_len[row] = 0
            self.pool_sums.pop(row, None)
            self.free_rows.append(row)

    def finish_request(self, request_id: str) -> None:
        """Forget everything held for a request that has left the engine."""
        self._release(request_id)
        if self.sampler is not None:
            self.sampler.forget(request_id)

    def launch(self, out: SchedulerOutput, prev: Step | None = None) -> Step:
        """Queue one step's forward pass (rank 0), its plan sent to the other ranks first.
        Tokens of `prev` that the host has not read yet are taken from the device. Nothing here
        waits for the device unless the step scores prompt tokens."""
        for rid in out.preempted:
            self._release(rid)
        if not out.scheduled:
            if out.kv_transfers:
                plan = transfers_plan(out.kv_transfers)
                if self.send_plan is not None:
                    self.send_plan(plan)
                self.forward(plan)
            return Step(out, [], None, {})
        plan = self.plan(out, prev)
        if self.send_plan is not None:
            self.send_plan(plan)
        prev_tokens = None if prev is None or prev.sampled is None else prev.sampled.token_ids
        logits, scored, pooled = self.forward(plan, prev_tokens)
        prompt_logprobs = {out.scheduled[i][0].request_id: chunk for i, chunk in scored.items()}
        sample_reqs = [out.scheduled[i][0] for i in plan.sampling]
        embeddings = {}
        for i, vec in pooled.items():
            req = out.scheduled[i][0]
            assert req.pooling is not None  # only embedding requests pool
            embeddings[req.request_id] = finish_embedding(vec, req.pooling)
        return Step(out, sample_reqs, logits, prompt_logprobs, embeddings)

    def sample(self, step: Step) -> None:
        """Queue a launched step's sampling behind its forward pass, the grammar masks computed
        on the host meanwhile. Rows of requests that finished since the launch, or that wait for
        their grammar (the scheduler stepped them back), do not sample."""
        logits, step.logits = step.logits, None
        if logits is None:
            return
        reqs = step.reqs
        live = [
            i for i, r in enumerate(reqs) if not r.status.finished and r.pending_grammar is None
        ]
        if len(live) < len(reqs):
            reqs = step.reqs = [reqs[i] for i in live]
            if not reqs:
                return
            logits = logits[to_device(live, torch.long, logits.device)]
        assert self.sampler is not None  # logits come back on rank 0 alone
        grammar = self.structured.masks(reqs) if self.structured is not None else None
        with torch.inference_mode():
            step.sampled = self.sampler.sample(logits, reqs, grammar)
        step.sampled_rows = {r.request_id: i for i, r in enumerate(reqs)}

    def resolve(self, step: Step) -> StepResult:
        """Wait for a sampled step's tokens. Each live row's grammar matcher accepts its token and
        its penalty counts take it; rows of requests that finished since the sampling (aborted,
        or stopped by their previous token) are left out, their tokens void."""
        result = StepResult([], [], [], prompt_logprobs=step.prompt_logprobs)
        if step.embeddings:
            # One copy to the host for the whole step, not one wait per request.
            flat = torch.cat(list(step.embeddings.values())).tolist()
            start = 0
            for rid, vec in step.embeddings.items():
                result.embeddings[rid] = flat[start : start + len(vec)]
                start += len(vec)
        batch = step.sampled
        if batch is None:
            return result
        assert self.sampler is not None
        tokens, logprobs = batch.read()
        with torch.inference_mode():  # the penalty counts are inference tensors
            for i, req in enumerate(step.reqs):
                if req.status.finished:
                    continue
                token, error = tokens[i], batch.failed.get(i)
                if error is None:
                    try:
                        if req.grammar is not None:
                            req.grammar.accept(token)
                        self.sampler.record(req, token)
                    except Exception as e:
                        error = e
                if error is not None:
                    result.failed[len(result.reqs)] = error
                result.reqs.append(req)
                result.token_ids.append(token)
                result.logprobs.append(logprobs[i])
        return result

    def plan(self, out: SchedulerOutput, prev: Step | None = None) -> StepPlan:
        """Rows for new requests, the block ids appended since the last step, the input ids
        (those the host does not know yet: where in `prev`'s sampled tokens they are)."""
        rows_l: list[int] = []
        pending_ids: list[int] = []
        pending_src: list[int] = []
        num_new_l: list[int] = []
        computed_l: list[int] = []
        input_ids: list[int] = []
        sampling: list[int] = []
        lora_slots: list[int] = []
        pool_mean: list[int] = []
        pool_end: list[int] = []
        scored: list[tuple[int, int, tuple[int, ...]]] = []
        writes: list[tuple[int, int, list[int]]] = []
        row_len, row_of, started = self.row_len, self.rows, out.started
        new_block_ids = out.new_block_ids
        for i, (req, n) in enumerate(out.scheduled):
            rid = req.request_id
            row = row_of.get(rid)
            if row is None or rid in started:
                self._release(rid)
                row = row_of[rid] = self.free_rows.pop()
            new_blocks = new_block_ids[rid]
            if new_blocks:
                start = int(row_len[row])
                writes.append((row, start, new_blocks))
                row_len[row] = start + len(new_blocks)
            c = req.num_computed_tokens
            lora_slots.append(req.lora_slot)
            rows_l.append(row)
            num_new_l.append(n)
            computed_l.append(c)
            tokens = req.all_token_ids
            known = len(tokens)
            if c + n > known:
                # Its last token is still on the device: only ever one, the newest, which the
                # previous step sampled (a request that resumes has had it appended).
                assert prev is not None and c + n == known + 1, (req, c, n)
                pending_ids.append(len(input_ids) + n - 1)
                pending_src.append(prev.sampled_rows[rid])
                input_ids.extend(tokens[c:known])
                input_ids.append(0)
            elif n == 1:
                input_ids.append(tokens[c])
            else:
                input_ids.extend(tokens[c : c + n])
            pooling = req.pooling
            if pooling is not None:
                if pooling.pooling_type == "MEAN":
                    pool_mean.append(i)
                if req.samples_after(n):
                    pool_end.append(i)
            elif req.samples_after(n):
                sampling.append(i)
            top_n = req.sampling_params.prompt_logprobs
            if top_n is not None:
                # Position p scores prompt token p + 1; the last prompt position samples instead.
                count = min(c + n, req.num_prompt_tokens - 1) - c
                if count > 0:
                    scored.append((i, top_n, tuple(tokens[c + 1 : c + 1 + count])))
        return StepPlan(
            rows=np.array(rows_l, dtype=np.int64),
            num_new=np.array(num_new_l, dtype=np.int64),
            computed=np.array(computed_l, dtype=np.int64),
            input_ids=np.array(input_ids, dtype=np.int64),
            table_writes=writes,
            sampling=np.array(sampling, dtype=np.int64),
            prompt_logprobs=tuple(scored),
            pending_ids=np.array(pending_ids, dtype=np.int64),
            pending_src=np.array(pending_src, dtype=np.int64),
            pool_mean=np.array(pool_mean, dtype=np.int64),
            pool_end=np.array(pool_end, dtype=np.int64),
            num_prev_sampled=0 if prev is None or prev.sampled is None else len(prev.sampled_rows),
            lora_slots=np.array(lora_slots, dtype=np.int32) if max(lora_slots) >= 0 else None,
            lora_changes=out.lora_changes or None,
            lora_host_changes=self._take_lora_host_changes(),
            kv_transfers=out.kv_transfers or None,
        )

    def _cascade_prefix(self, tables: np.ndarray, seq_lens: np.ndarray) -> int:
        """The shared prefix a decode step should attend once for all its rows; 0 for none."""
        if not self.cascade or len(seq_lens) < CASCADE_MIN_ROWS:
            return 0
        prefix = shared_prefix_len(tables, seq_lens, self.block_size)
        return prefix if prefix >= CASCADE_MIN_PREFIX else 0

    def forward(
        self, plan: StepPlan, prev_tokens: torch.Tensor | None = None
    ) -> tuple[torch.Tensor | None, dict[int, PromptLogprobsChunk], dict[int, torch.Tensor]]:
        """Run a plan through this rank's model: the logits of the sampling sequences (None
        when none samples), the scored prompt tokens of the sequences that asked, and the
        pooled hidden states of the embedding requests whose prompt ends here, both by
        sequence index (rank 0 only). `prev_tokens`: rank 0's tokens of the previous step, where
        the plan's pending input ids are."""
        if plan.lora_host_changes is not None:
            for key, adapter in plan.lora_host_changes.items():
                self._set_host_copy(key, adapter)
        if plan.lora_changes is not None:
            self._apply_lora_changes(plan.lora_changes)
        if plan.kv_transfers is not None:
            if self.host_kv is None:
                raise RuntimeError("host KV copies were planned for a runner without a host tier")
            self.host_kv.apply(plan.kv_transfers)
        if not len(plan.rows):
            return None, {}, {}
        bs = self.block_size
        table = self.block_table
        for row, start, blocks in plan.table_writes:
            table[row, start : start + len(blocks)] = blocks
        rows, num_new, computed = plan.rows, plan.num_new, plan.computed
        num_seqs = len(rows)
        qsl = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(num_new, out=qsl[1:])
        num_tokens = int(qsl[-1])
        positions = np.arange(num_tokens) + np.repeat(computed - qsl[:-1], num_new)
        seq_lens = computed + num_new
        token_rows = np.repeat(rows, num_new)
        slots = table[token_rows, positions // bs].astype(np.int64) * bs + positions % bs
        max_seq_len = int(seq_lens.max())
        width = cdiv(max_seq_len, bs)

        dev = self.device
        ids = self._input_ids(plan, prev_tokens)
        token_lora = None
        if plan.lora_slots is not None:
            token_lora = np.repeat(plan.lora_slots, num_new)
        graphs = None if self.kv_scales_pending else self.graphs
        bs = None
        if (
            graphs is not None
            and not plan.prompt_logprobs
            and fits_decode_graph(positions, seq_lens, graphs.max_size)
        ):
            bs = graphs.replay_size(num_tokens)
        if graphs is not None and bs is not None:
            token_tables = table[token_rows, :width]
            row_lens = positions + 1
            prefix = self._cascade_prefix(token_tables, row_lens)
            with torch.inference_mode():
                hidden = graphs.run(
                    ids, positions, slots, token_tables, row_lens, bs, prefix, token_lora
                )
                # Every row samples in a pure decode step; a one-token chunk of a longer prompt
                # (a budget's last token) makes a row that does not.
                if len(plan.sampling) == num_tokens:
                    return self.model.compute_logits(hidden), {}, {}
                if not len(plan.sampling):
                    return None, {}, {}
                return self.model.compute_logits(hidden[qsl[1:][plan.sampling] - 1]), {}, {}

        seq_tables = table[rows, :width]
        # Only a pure decode step runs the decode kernel, which has the cascade pass.
        prefix = self._cascade_prefix(seq_tables, seq_lens) if num_tokens == num_seqs else 0
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(slots).to(dev, non_blocking=True),
            block_tables=torch.from_numpy(seq_tables).to(dev, non_blocking=True),
            seq_lens=torch.from_numpy(seq_lens).to(dev, non_blocking=True),
            query_start_loc=torch.from_numpy(qsl).to(dev, non_blocking=True),
            seq_lens_cpu=seq_lens.tolist(),
            query_start_loc_cpu=qsl.tolist(),
            max_query_len=int(num_new.max()),
            max_seq_len=max_seq_len,
            cascade_prefix_len=to_device([prefix], torch.long, dev) if prefix else None,
        )
        pos = torch.from_numpy(positions).to(dev, non_blocking=True)
        lora = (
            None if token_lora is None else torch.from_numpy(token_lora).to(dev, non_blocking=True)
        )
        with torch.inference_mode(), attention_context(meta), lora_context(lora):
            hidden = self.model(ids, pos)
            self.kv_scales_pending = False
            scored = self._score_prompts(plan, hidden, qsl) if plan.prompt_logprobs else {}
            pooled = self._pool(plan, hidden, qsl) if self.sampler is not None else {}
            if not len(plan.sampling):
                return None, scored, pooled
            logits_idx = torch.from_numpy(qsl[1:][plan.sampling] - 1).to(dev, non_blocking=True)
            return self.model.compute_logits(hidden[logits_idx]), scored, pooled

    def _pool(
        self, plan: StepPlan, hidden: torch.Tensor, qsl: np.ndarray
    ) -> dict[int, torch.Tensor]:
        """Each embedding request's chunk of final hidden states folded into its pooling: a
        mean's running sum grows by the chunk; a prompt that ends here is pooled (fp32), the
        last position's state or the sum over the whole prompt divided by its length. A mean
        request never takes prefix-cache hits, so every position of it runs here."""
        sums = self.pool_sums
        for i in plan.pool_mean:
            row = int(plan.rows[i])
            chunk = hidden[int(qsl[i]) : int(qsl[i + 1])].float().sum(dim=0)
            prev = sums.get(row)
            sums[row] = chunk if prev is None else prev + chunk
        pooled: dict[int, torch.Tensor] = {}
        for i in plan.pool_end:
            row = int(plan.rows[i])
            total = sums.pop(row, None)
            if total is None:  # last-token pooling
                pooled[int(i)] = hidden[int(qsl[i + 1]) - 1].float()
            else:
                pooled[int(i)] = total / float(plan.computed[i] + plan.num_new[i])
        return pooled

    # -- LoRA adapters -----------------------------------------------------------------------
    def check_adapter(self, lora: LoRARequest) -> None:
        """LoRAAdapterError (a ValueError) unless this engine can serve the adapter: its config
        and the names and shapes of its tensors, read without the tensors themselves."""
        if self.lora is None:
            raise ValueError("the engine serves no LoRA adapters (enable_lora is off)")
        config = read_config(lora.lora_path, self.args.max_lora_rank)
        check_weights(lora.lora_path, config, self.lora.targets)

    def read_adapter(self, lora: LoRARequest) -> LoRAAdapter:
        """The adapter's tensors from its folder, checked again (the folder may have changed
        since check_adapter): LoRAAdapterError, or the OSError of the read, when they cannot be
        served. Outside any step: the engine core fails the adapter's requests alone."""
        if self.lora is None:
            raise ValueError("the engine serves no LoRA adapters (enable_lora is off)")
        config = read_config(lora.lora_path, self.args.max_lora_rank)
        return read_lora_weights(lora.lora_path, config, self.lora.targets)

    def host_adapter(self, lora: LoRARequest, adapter: LoRAAdapter) -> None:
        """Keep a read adapter in host memory as its slot image, which slot loads copy (every
        rank its own; rank 0 sends the workers the adapter's tensors with the next plan)."""
        self._set_host_copy(lora.lora_int_id, adapter)
        if self.send_plan is not None:
            self._lora_host_changes[lora.lora_int_id] = adapter

    def drop_adapter(self, lora_int_id: int) -> None:
        """Let an adapter's host copy go (every rank)."""
        self._set_host_copy(lora_int_id, None)
        if self.send_plan is not None:
            self._lora_host_changes[lora_int_id] = None

    def _set_host_copy(self, key: int, adapter: LoRAAdapter | None) -> None:
        # The image alone stays: a slot load needs nothing else, and the tensors as read (a
        # different dtype, unpadded, unsharded) would take host memory besides it.
        if adapter is None:
            self.lora_host.pop(key, None)
            if self.lora_loads is not None:  # its image goes now if no copy reads it still
                self.lora_loads.settle()
        else:
            assert self.lora is not None
            self.lora_host[key] = self.lora.image(adapter)

    def _take_lora_host_changes(self) -> dict[int, LoRAAdapter | None] | None:
        changes, self._lora_host_changes = self._lora_host_changes, {}
        return changes or None

    def _apply_lora_changes(self, changes: SlotChanges) -> None:
        """Copy adapters into their slots from their host images, which the engine core read
        before it let their requests be scheduled: a step never reads the disk. One copy per
        adapter, queued on the device's stream behind the step before, which may still read
        the slot (SlotLoads)."""
        assert self.lora_loads is not None
        for slot, lora in changes.loads:
            image = self.lora_host.get(lora.lora_int_id)
            if image is None:
                raise RuntimeError(
                    f"LoRA adapter {lora.lora_name!r} was scheduled without its host copy"
                )
            with torch.inference_mode():
                self.lora_loads.load(slot, lora.lora_name, image)

    def take_kv_transfers_done(self) -> TransfersDone:
        """The host tier's copies (rank 0's) complete since the last call."""
        return TransfersDone() if self.host_kv is None else self.host_kv.take_done()

    def take_lora_load_seconds(self) -> list[tuple[str, float]]:
        """(adapter name, seconds) of each slot load the device completed since the last call
        (rank 0's; a load's copy may complete a step after it was issued)."""
        return [] if self.lora_loads is None else self.lora_loads.take_seconds()

    def _input_ids(self, plan: StepPlan, prev_tokens: torch.Tensor | None) -> torch.Tensor:
        """The step's input ids on the device, the pending ones filled in there from the previous
        step's sampled tokens (which rank 0 sends the other ranks, in stream order)."""
        dev = self.device
        ids = torch.from_numpy(plan.input_ids).to(dev, non_blocking=True)
        if not len(plan.pending_ids):
            return ids
        if prev_tokens is None:  # a tensor-parallel worker: rank 0 holds them
            prev_tokens = torch.empty(plan.num_prev_sampled, dtype=torch.long, device=dev)
        prev_tokens = broadcast_from_rank0(prev_tokens)
        src = torch.from_numpy(plan.pending_src).to(dev, non_blocking=True)
        dst = torch.from_numpy(plan.pending_ids).to(dev, non_blocking=True)
        ids[dst] = prev_tokens[src]
        return ids

    def _score_prompts(
        self, plan: StepPlan, hidden: torch.Tensor, qsl: np.ndarray
    ) -> dict[int, PromptLogprobsChunk]:
        """Logprob and top N of the prompt tokens each asking sequence's chunk predicts, from the
        log_softmax of a bounded number of positions at a time; only those numbers stay."""
        dev = self.device
        idx = np.concatenate(
            [np.arange(qsl[i], qsl[i] + len(targets)) for i, _, targets in plan.prompt_logprobs]
        )
        targets_t = torch.tensor(
            [t for _, _, targets in plan.prompt_logprobs for t in targets], device=dev
        )
        idx_t = torch.from_numpy(idx).to(dev)
        top_n = max(max(n for _, n, _ in plan.prompt_logprobs), 1)
        chosen_parts, top_val_parts, top_id_parts = [], [], []
        for s in range(0, len(idx), _PROMPT_LOGPROBS_ROWS):
            logits = self.model.compute_logits(hidden[idx_t[s : s + _PROMPT_LOGPROBS_ROWS]])
            if self.sampler is None:
                continue  # a worker's part ends at the collective
            logprobs = torch.log_softmax(logits.float(), dim=-1)
            chunk_targets = targets_t[s : s + _PROMPT_LOGPROBS_ROWS].unsqueeze(1)
            chosen_parts.append(logprobs.gather(1, chunk_targets).squeeze(1).cpu())
            top = logprobs.topk(min(top_n, logprobs.shape[-1]), dim=-1)
            top_val_parts.append(top.values.cpu())
            top_id_parts.append(top.indices.cpu())
        if self.sampler is None:
            return {}
        chosen = torch.cat(chosen_parts).tolist()
        top_vals = torch.cat(top_val_parts).tolist()
        top_ids = torch.cat(top_id_parts).tolist()
        scored: dict[int, PromptLogprobsChunk] = {}
        k = 0
        for i, n, targets in plan.prompt_logprobs:
            entries = [
                (chosen[j], list(zip(top_ids[j][:n], top_vals[j][:n], strict=True)))
                for j in range(k, k + len(targets))
            ]
            scored[i] = (int(plan.computed[i]) + 1, entries)
            k += len(targets)
        return scored
