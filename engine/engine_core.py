"""The engine loop: admit requests, schedule, run the model, let the scheduler apply the
token-level stops and the output processor turn the tokens into per-step deltas. Single-threaded;
front ends (offline LLM, AsyncEngine) drive it."""

from __future__ import annotations

import bisect
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from kvfleet.engine.admission import Admission
from kvfleet.engine.checkpoint_path import find_gguf
from kvfleet.engine.compile_cache import build_facts, cache_root, open_compile_cache
from kvfleet.engine.config import EngineArgs, ModelConfig
from kvfleet.engine.distributed import rank_device
from kvfleet.engine.kv_cache_manager import KVCacheManager
from kvfleet.engine.kv_event_log import KVEventLog
from kvfleet.engine.lora_request import LoRARequest
from kvfleet.engine.lora_slots import AdapterSlots
from kvfleet.engine.model_runner import ModelRunner, Step
from kvfleet.engine.output_processor import OutputProcessor, ProcessedStep
from kvfleet.engine.outputs import LORA_LOAD_BUCKETS, EngineStats, LoRAStats, RequestOutput
from kvfleet.engine.request import EngineRequest, Request
from kvfleet.engine.sampling_params import SamplingParams, child_seed
from kvfleet.engine.scheduler import Scheduler
from kvfleet.engine.startup_timing import StartupTimer
from kvfleet.engine.structured_output import CompiledGrammar, StructuredOutputs
from kvfleet.engine.workers import TensorParallelWorkers

logger = logging.getLogger(__name__)


def load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    from kvfleet.engine.models import gguf_checkpoint

    gguf_file = find_gguf(path)
    if gguf_file is not None:
        return gguf_checkpoint.load_tokenizer(gguf_file)
    if not Path(path).is_dir():
        # transformers would take the name for a hub id and try to download it.
        raise FileNotFoundError(
            f"tokenizer {path} is not a directory: pass --tokenizer an HF tokenizer directory "
            "(tokenizer.json, tokenizer_config.json) or a .gguf file that carries one"
        )
    return AutoTokenizer.from_pretrained(path)


def eos_token_ids(model_config: ModelConfig, tokenizer: Any) -> frozenset[int]:
    """Every id the checkpoint declares as end of sequence (generation_config may list several,
    as Llama 3 does)."""
    from transformers import GenerationConfig

    ids: set[int] = set()
    declared = [getattr(model_config.hf_config, "eos_token_id", None)]
    # A GGUF file has no generation_config: its metadata (the config) says.
    if model_config.path.is_dir():
        with contextlib.suppress(OSError):
            declared = [GenerationConfig.from_pretrained(model_config.path).eos_token_id]
    for value in declared:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, Sequence):
            ids.update(int(v) for v in value)
    if not ids and getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


class EngineCore:
    def __init__(self, args: EngineArgs, tokenizer: Any | None = None) -> None:
        # The phases of the start, from here to ready (the server adds its own, and logs them).
        self.startup = StartupTimer()
        started = time.perf_counter()
        self.device = rank_device(args.resolved_device(), 0)
        # Resolved once, here: the workers, the runner and the metrics see the same values.
        self.args = args = args.for_device(self.device)
        # Before anything compiles and before the workers start (they inherit the setting).
        self.cache_folder = self._open_compile_cache(args)
        self.model_config = ModelConfig.from_args(args, self.device)
        self.startup.record("config", time.perf_counter() - started)
        started = time.perf_counter()
        self.tokenizer = tokenizer
        if tokenizer is None and not args.skip_tokenizer_init:
            self.tokenizer = load_tokenizer(args.tokenizer or args.model)
        self.eos_token_ids = eos_token_ids(self.model_config, self.tokenizer)
        self.vocab_size = self.model_config.vocab_size
        self.workers: TensorParallelWorkers | None = None
        # Whatever fails from here on (the grammar compiler's tokenizer, a worker, the runner's
        # load) must not leave the compiler's processes, the workers, the weights or the KV
        # cache behind. The grammar compiler starts first: its failure costs no model load.
        try:
            self._start_structured_outputs()
            if args.tensor_parallel_size > 1:
                self.workers = TensorParallelWorkers(args)
            self.startup.record("tokenizer", time.perf_counter() - started)
            self._build(args)
        except BaseException:
            self.close()
            raise
        logger.info(
            "engine ready: %s (%s) on %s x%d, %s, max_model_len=%d, max_num_seqs=%d, "
            "prefix caching %s",
            self.model_config.path,
            self.model_config.architecture,
            self.device,
            args.tensor_parallel_size,
            self.model_config.dtype,
            self.model_config.max_model_len,
            args.max_num_seqs,
            "on" if args.enable_prefix_caching else "off",
        )

    def _start_structured_outputs(self) -> None:
        """Structured outputs need the tokenizer's text of every token id, read by the grammar
        library; a tokenizer it cannot read turns them off, not the engine."""
        self.structured: StructuredOutputs | None = None
        self.structured_unavailable: str | None = "the engine runs without a tokenizer"
        if self.tokenizer is None:
            return
        try:
            self.structured = StructuredOutputs(self.tokenizer, self.vocab_size, self.eos_token_ids)
        except ValueError as e:
            self.structured_unavailable = (
                f"the grammar library cannot read this model's tokenizer ({e})"
            )
            logger.warning("structured outputs are off: %s", self.structured_unavailable)
        else:
            self.structured_unavailable = None

    def _build(self, args: EngineArgs) -> None:
        """The runner and what reads it."""
        workers = self.workers
        self.runner = ModelRunner(
            args,
            self.model_config,
            self.device,
            on_loaded=workers.wait_loaded if workers is not None else None,
            send_plan=workers.send if workers is not None else None,
            structured=self.structured,
            startup=self.startup,
            cache_folder=self.cache_folder,
        )
        self.kv_cache_manager = KVCacheManager(
            self.runner.num_blocks,
            args.block_size,
            args.enable_prefix_caching,
            self.runner.num_host_blocks,
        )
        self.lora_slots = AdapterSlots(args.max_loras, args.cpu_loras) if args.enable_lora else None
        # Adapters whose folder has been checked (check_adapter), by lora_int_id.
        self._checked_loras: dict[int, LoRARequest] = {}
        # For the metrics: requests queued per adapter; slot loads per LORA_LOAD_BUCKETS bucket
        # (not cumulative here), their count and seconds; the adapters of the running and the
        # waiting requests as last seen, and when that changed.
        self._lora_requests: Counter[str] = Counter()
        self._lora_load_hist = [0] * (len(LORA_LOAD_BUCKETS) + 1)
        self._lora_load_seconds = 0.0
        self._lora_in_use: tuple[tuple[str, ...], tuple[str, ...]] = ((), ())
        self._lora_changed_at = time.time()
        self.scheduler = Scheduler(
            self.kv_cache_manager,
            # No more sequences than the runner has block-table rows.
            max_num_seqs=self.runner.max_num_seqs,
            max_num_batched_tokens=self.runner.max_num_batched_tokens,
            lora_slots=self.lora_slots,
            max_lora_wait_steps=args.max_lora_wait_steps,
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        # Async scheduling: the step the last call launched, which the next call samples.
        self._launched: Step | None = None
        self.async_scheduling = args.async_scheduling
        # The last step found nothing to run and nothing on the device: every request waits
        # for its grammar to compile, and the loop may sleep until one is done.
        self.idle = False
        # Tokens of the step now running (or the last one): those it schedules, plus on a GPU
        # those of the step still on the device, whose tokens it waits for. Liveness allows a
        # step time in proportion; read from any thread.
        self.step_tokens = 0
        self.admission = Admission(
            max_model_len=self.model_config.max_model_len,
            vocab_size=self.vocab_size,
            block_size=self.kv_cache_manager.block_size,
            num_kv_blocks=self.kv_cache_manager.pool.num_usable_blocks,
            has_tokenizer=self.tokenizer is not None,
            structured_unavailable=self.structured_unavailable,
            lora_enabled=args.enable_lora,
            pooler=self.model_config.pooler,
        )
        for lora in args.lora_requests():
            self.check_adapter(lora)

    def _open_compile_cache(self, args: EngineArgs) -> Path | None:
        """The compile cache's folder for this GPU and these versions, None on the CPU (whose
        kernels compile nothing to keep) or without a cache root."""
        root = cache_root(args.compile_cache_dir)
        if root is None or self.device.type != "cuda":
            return None
        return open_compile_cache(root, build_facts(self.device))

    def capture_next_graph(self, idle: bool) -> bool:
        """Between steps: capture the next decode CUDA graph the engine's schedule picks now,
        if any (ModelRunner.capture_next_graph); whether one was captured."""
        return self.runner.capture_next_graph(idle)

    @property
    def graphs_pending(self) -> bool:
        """Decode CUDA graphs remain to capture while serving."""
        return self.runner.graphs_pending

    def worker_failure(self) -> str | None:
        """Why a tensor-parallel worker can no longer run steps, or None."""
        return None if self.workers is None else self.workers.failure()

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (nothing to do with one rank)."""
        if self.workers is not None:
            self.workers.shutdown()

    @contextlib.contextmanager
    def interrupting(self) -> Iterator[None]:
        """While in this block a step in progress (and any later one) ends early, between two
        layers of its forward pass, with StepInterrupted: a stopping engine need not wait out a
        long step (a chunk of a long prompt runs seconds or more on a CPU). Not with
        tensor-parallel workers: they would wait forever in the step's next collective for this
        rank; the stop waits for their step instead."""
        if self.workers is not None:
            yield
            return
        with self.runner.interrupting():
            yield

    def close(self) -> None:
        """Give back the runner's memory (KV cache, CUDA graphs, weights), then shutdown():
        what the engine's owner calls when it is done with it; no step runs after this. The
        runner goes first: NCCL does not destroy a communicator while a CUDA graph that captured
        its collectives lives (its teardown waits for them)."""
        # The launched step's logits and tokens (device and pinned memory) go with the rest.
        self._launched = None
        runner = getattr(self, "runner", None)  # absent when the model failed to load
        if runner is not None:
            runner.release()
        structured = getattr(self, "structured", None)
        if structured is not None:
            structured.close()
        self.shutdown()

    # -- requests --------------------------------------------------------------------------
    def admit(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        grammar: CompiledGrammar | Future[CompiledGrammar] | None = None,
        lora: LoRARequest | None = None,
    ) -> EngineRequest:
        """Admission (self.admission) for the offline front end and tests, from any thread: a
        structured_outputs constraint given without its grammar compiles here, blocking."""
        constraint = params.structured_outputs
        if grammar is None and constraint is not None and self.structured is not None:
            grammar = self.structured.grammar(constraint)
        return self.admission.admit(prompt_token_ids, params, prompt, grammar, lora=lora)

    def check_adapter(self, lora: LoRARequest) -> None:
        """LoRAAdapterError (a ValueError) unless the engine can serve this adapter: its
        folder read once per adapter (config, tensor names and shapes), not per request."""
        if lora.lora_int_id in self._checked_loras:
            known = self._checked_loras[lora.lora_int_id]
            if known != lora:
                raise ValueError(
                    f"lora_int_id {lora.lora_int_id} is {known.lora_name!r} ({known.lora_path}) "
                    f"already; {lora.lora_name!r} needs an id of its own"
                )
            return
        self.runner.check_adapter(lora)
        self._checked_loras[lora.lora_int_id] = lora

    def remove_adapter(self, lora: LoRARequest) -> None:
        """Forget an adapter no request will ask for again (unloaded): its cached blocks go
        now; its slot and host copy too if no request of it is in the engine, else they age
        out as any unused one."""
        self._checked_loras.pop(lora.lora_int_id, None)
        self.kv_cache_manager.drop_adapter_blocks(lora.lora_int_id)
        slots = self.lora_slots
        if slots is None:
            return
        if any(r.lora == lora for r in self.scheduler.requests.values()):
            return
        slots.remove(lora)
        self.runner.drop_adapter(lora.lora_int_id)
        # Its series leave /metrics with it: adapters come and go, the exposition stays bounded.
        self._lora_requests.pop(lora.lora_name, None)

    def add_request(self, request_id: str, request: EngineRequest) -> None:
        """Queue an admitted request, as n child requests when n > 1. Raises ValueError, having
        queued nothing, if the id is in use or its LoRA adapter cannot be served."""
        if self.output_processor.has_request(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        if request.lora is not None:
            self.check_adapter(request.lora)
        params = request.params
        children = []
        for i in range(params.n):
            child_params = params
            if params.n > 1:
                seed = None if params.seed is None else child_seed(params.seed, i)
                child_params = params.model_copy(update={"n": 1, "seed": seed})
            children.append(
                Request(
                    f"{request_id}#{i}",
                    request.prompt_token_ids,
                    child_params,
                    self.eos_token_ids,
                    request.max_tokens,
                    request.arrival_time,
                    request.grammar,
                    request.lora,
                    request.pooling,
                )
            )
        self.output_processor.add_request(request_id, request, children)
        if request.lora is not None:
            self._lora_requests[request.lora.lora_name] += 1
        try:
            for child in children:
                self.scheduler.add_request(child)
        except BaseException:
            self.abort_request(request_id)  # leave nothing of it behind
            raise

    def abort_request(self, request_id: str) -> bool:
        """Stop a request now and free its KV blocks. False if it was not running."""
        children = self.output_processor.abort_request(request_id)
        for child in children:
            self.scheduler.abort_request(child.request_id)
        self._release_finished()
        return bool(children)

    def _release_finished(self) -> None:
        for rid in self.scheduler.take_finished():
            self.runner.finish_request(rid)

    def has_unfinished_requests(self) -> bool:
        return bool(self.output_processor.num_requests)

    @property
    def num_requests(self) -> int:
        return self.output_processor.num_requests

    # -- the loop --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One step: schedule, launch the forward pass, update the requests with the tokens of
        the step before. With async scheduling the host reads a step's tokens only after it has
        launched the next one, so its work on them (grammar matchers, stops, outputs) runs while
        the device computes: the outputs are the previous step's, and a request that stopped
        there has run one wasted row in this one. The step the last call launched samples at
        the start of this one, so that its grammar masks do not delay that call's outputs."""
        outputs: list[RequestOutput] = []
        prev, self._launched = self._launched, None
        if prev is not None:
            outputs += self._fail(self.scheduler.settle_grammars(prev.out))
            self.runner.sample(prev)
        outputs += self._host_adapters()
        self.scheduler.transfers_done(self.runner.take_kv_transfers_done())
        out = self.scheduler.schedule()
        # A request waiting for its copy from the host tier keeps the loop polling.
        self.idle = out.empty and prev is None and not self.scheduler.loading
        # On a GPU this call also waits for the step still on the device; on the CPU that
        # step's forward pass ran in the call that launched it.
        on_gpu = self.device.type == "cuda"
        waited = prev.out.num_batched_tokens if prev is not None and on_gpu else 0
        self.step_tokens = out.num_batched_tokens + waited
        step = self.runner.launch(out, prev)
        for _, seconds in self.runner.take_lora_load_seconds():
            self._lora_load_hist[bisect.bisect_left(LORA_LOAD_BUCKETS, seconds)] += 1
            self._lora_load_seconds += seconds
        self.scheduler.advance(out)
        outputs += self._fail(out.failed)
        if prev is not None:
            outputs += self._update(prev)
        if self.async_scheduling:
            self._launched = None if out.empty else step
            return outputs
        outputs += self._fail(self.scheduler.settle_grammars(out))
        self.runner.sample(step)
        return outputs + self._update(step)

    def _update(self, step: Step) -> list[RequestOutput]:
        """Read a step's tokens: the scheduler appends them and applies the token-level stops,
        the output processor turns them into deltas."""
        result = self.runner.resolve(step)
        self.scheduler.update(step.out, result.new_tokens())
        return self._finish(self.output_processor.process(result))

    def _host_adapters(self) -> list[RequestOutput]:
        """Read into host memory the adapter of each waiting request that has no copy there,
        so that the scheduler may start it and the step's slot copies never read the disk. An
        adapter whose folder went bad since it was checked (a file deleted, truncated, other
        shapes) fails its waiting requests alone, which never ran: no KV blocks, no slot. When
        every host copy is in use, the adapters left wait for the requests of one to end;
        the scheduler's starved adapter goes first and may take the copy of one whose requests
        only wait."""
        slots = self.lora_slots
        if slots is None:
            return []
        waiting = self.scheduler.waiting
        starved = self.scheduler.starved_lora()
        adapters: dict[int, LoRARequest] = {} if starved is None else {starved.lora_int_id: starved}
        adapters.update((r.lora.lora_int_id, r.lora) for r in waiting if r.lora is not None)
        outputs: list[RequestOutput] = []
        for lora in adapters.values():
            if slots.is_hosted(lora):
                continue
            dropped = slots.make_room(starved=lora == starved)
            if dropped is None:
                break
            for victim in dropped:
                self.runner.drop_adapter(victim)
            try:
                adapter = self.runner.read_adapter(lora)
            except Exception as e:  # its own files, whatever the error: its requests alone
                failed = [(r, e) for r in waiting if r.lora == lora]
                outputs += self._fail(failed, f"reading LoRA adapter {lora.lora_name!r}")
                continue
            slots.host(lora)
            self.runner.host_adapter(lora, adapter)
        return outputs

    def _fail(
        self, failures: list[tuple[Request, Exception]], stage: str = "structured_outputs"
    ) -> list[RequestOutput]:
        """End these requests (their grammar failed to compile, or their adapter to load),
        each with its error output."""
        if not failures:
            return []
        return self._finish(self.output_processor.fail(failures, stage))

    def _finish(self, processed: ProcessedStep) -> list[RequestOutput]:
        """The one place requests end for what the output processor found (stop strings,
        failures); its deltas."""
        for req, status in processed.to_finish:
            self.scheduler.finish_request(req, status)
        self._release_finished()
        return list(processed.outputs.values())

    @property
    def kv_event_log(self) -> KVEventLog:
        """What the prefix cache gained and lost since the last drain (AsyncEngine publishes
        it as KV events)."""
        return self.kv_cache_manager.pool.events

    def cached_block_hashes(self) -> tuple[list[bytes], list[bytes]]:
        """Every block hash the engine holds, on the GPU and in host memory (a KV-events
        snapshot)."""
        kv = self.kv_cache_manager
        return kv.pool.cached_hashes(), kv.cached_host_hashes()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block, on the device and in host memory; False, changing nothing,
        while a request holds blocks."""
        return self.kv_cache_manager.reset_prefix_cache()

    def stats(self) -> EngineStats:
        s = self.scheduler.stats
        return EngineStats(
            num_requests_running=self.scheduler.num_running,
            num_requests_waiting=self.scheduler.num_waiting,
            kv_cache_usage_perc=self.kv_cache_manager.usage,
            num_free_blocks=self.kv_cache_manager.num_free_blocks,
            num_usable_blocks=self.kv_cache_manager.pool.num_usable_blocks,
            num_cached_blocks=len(self.kv_cache_manager.pool.cached),
            num_preemptions=s.num_preemptions,
            prefix_cache_queries=s.prefix_cache_queries,
            prefix_cache_hits=s.prefix_cache_hits,
            host_cache_queries=s.host_cache_queries,
            host_cache_hits=s.host_cache_hits,
            num_host_cache_blocks=self.kv_cache_manager.num_host_blocks,
            host_cache_block_bytes=self.runner.block_bytes * self.args.tensor_parallel_size,
            prompt_tokens=self.output_processor.prompt_tokens_total,
            generation_tokens=self.output_processor.generation_tokens_total,
            lora=self._lora_stats(),
        )

    def _lora_stats(self) -> LoRAStats | None:
        slots = self.lora_slots
        if slots is None:
            return None
        sched = self.scheduler
        in_use = (
            tuple(sorted({r.lora.lora_name for r in sched.running if r.lora is not None})),
            tuple(sorted({r.lora.lora_name for r in sched.waiting if r.lora is not None})),
        )
        if in_use != self._lora_in_use:
            self._lora_in_use, self._lora_changed_at = in_use, time.time()
        hist = self._lora_load_hist
        return LoRAStats(
            running=in_use[0],
            waiting=in_use[1],
            changed_at=self._lora_changed_at,
            max_loras=slots.max_loras,
            resident=tuple(sorted(slots.resident().items())),
            requests=tuple(sorted(self._lora_requests.items())),
            loads=tuple(sorted(slots.stats.loads.items())),
            evictions=tuple(sorted(slots.stats.evictions.items())),
            load_buckets=tuple(sum(hist[: i + 1]) for i in range(len(LORA_LOAD_BUCKETS))),
            load_count=sum(hist),
            load_seconds=self._lora_load_seconds,
        )
