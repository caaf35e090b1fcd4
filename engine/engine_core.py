"""The engine loop: admit requests, schedule, run the model, let the scheduler apply the
token-level stops and the output processor turn the tokens into per-step deltas. Single-threaded;
front ends (offline LLM, AsyncEngine) drive it."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from kvfleet.engine.admission import Admission
from kvfleet.engine.checkpoint_path import find_gguf
from kvfleet.engine.config import EngineArgs, ModelConfig
from kvfleet.engine.distributed import rank_device
from kvfleet.engine.kv_cache_manager import KVCacheManager
from kvfleet.engine.model_runner import InFlightStep, LaunchedStep, ModelRunner
from kvfleet.engine.output_processor import OutputProcessor
from kvfleet.engine.outputs import EngineStats, RequestOutput
from kvfleet.engine.request import EngineRequest, Request, RequestStatus
from kvfleet.engine.sampling_params import SamplingParams, child_seed
from kvfleet.engine.scheduler import Scheduler
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
        self.device = rank_device(args.resolved_device(), 0)
        # Resolved once, here: the workers, the runner and the metrics see the same values.
        self.args = args = args.for_device(self.device)
        self.model_config = ModelConfig.from_args(args, self.device)
        self.tokenizer = tokenizer
        if tokenizer is None and not args.skip_tokenizer_init:
            self.tokenizer = load_tokenizer(args.tokenizer or args.model)
        self.workers: TensorParallelWorkers | None = None
        if args.tensor_parallel_size > 1:
            self.workers = TensorParallelWorkers(args)
        # Whatever fails from here on (the runner's load, the grammar compiler's tokenizer)
        # must not leave the workers, the weights or the KV cache behind on the GPUs.
        try:
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

    def _build(self, args: EngineArgs) -> None:
        """The runner and what reads it, apart so that __init__ can undo a partial build."""
        self.runner = ModelRunner(
            args,
            self.model_config,
            self.device,
            on_loaded=self.workers.wait_loaded if self.workers is not None else None,
        )
        if self.workers is not None:
            self.runner.before_forward = self.workers.send
        self.kv_cache_manager = KVCacheManager(
            self.runner.num_blocks, args.block_size, args.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            self.kv_cache_manager,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
        )
        self.eos_token_ids = eos_token_ids(self.model_config, self.tokenizer)
        self.vocab_size = self.model_config.hf_config.vocab_size
        self.output_processor = OutputProcessor(self.tokenizer)
        # Async scheduling: the step launched last, whose sampling the next call queues, and
        # the one before it, sampled, whose tokens the host has not read yet.
        self._launched: LaunchedStep | None = None
        self._in_flight: InFlightStep | None = None
        self.async_scheduling = args.async_scheduling
        # The last step found nothing to run and nothing on the device: every request waits
        # for its grammar to compile, and the loop may sleep until one is done.
        self.idle = False
        # Tokens of the step now running (or the last one): those it schedules, plus on a GPU
        # those of the step still on the device, whose tokens it waits for. Liveness allows a
        # step time in proportion; read from any thread.
        self.step_tokens = 0
        # Structured outputs need the tokenizer's text of every token id, read by the grammar
        # library; a tokenizer it cannot read turns them off, not the engine.
        self.structured: StructuredOutputs | None = None
        self.structured_unavailable: str | None = "the engine runs without a tokenizer"
        if self.tokenizer is not None:
            try:
                self.structured = StructuredOutputs(
                    self.tokenizer, self.vocab_size, self.eos_token_ids
                )
            except ValueError as e:
                self.structured_unavailable = (
                    f"the grammar library cannot read this model's tokenizer ({e})"
                )
                logger.warning("structured outputs are off: %s", self.structured_unavailable)
            else:
                self.structured_unavailable = None
                self.runner.structured = self.structured
        self.admission = Admission(
            max_model_len=self.model_config.max_model_len,
            vocab_size=self.vocab_size,
            block_size=self.kv_cache_manager.block_size,
            num_kv_blocks=self.kv_cache_manager.pool.num_usable_blocks,
            has_tokenizer=self.tokenizer is not None,
            structured_unavailable=self.structured_unavailable,
        )

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
        # Their logits, tokens' device and pinned memory go with the rest.
        self._launched = self._in_flight = None
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
    ) -> EngineRequest:
        """Admission (self.admission) for the offline front end and tests, from any thread: a
        structured_outputs constraint given without its grammar compiles here, blocking."""
        constraint = params.structured_outputs
        if grammar is None and constraint is not None and self.structured is not None:
            grammar = self.structured.grammar(constraint)
        return self.admission.admit(prompt_token_ids, params, prompt, grammar)

    def add_request(self, request_id: str, request: EngineRequest) -> None:
        """Queue an admitted request, as n child requests when n > 1. Raises ValueError, having
        queued nothing, if the id is in use."""
        if self.output_processor.has_request(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
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
                )
            )
        self.output_processor.add_request(request_id, request, children)
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
        """One step. With async scheduling the next step is launched before the host reads the
        last one's tokens, so the host's work on them (grammar matchers, stop checks, outputs,
        the next masks) runs while the device computes: the outputs returned are the previous
        step's. A request that stopped at that step has run one wasted row in this one.

        The step launched by the last call is sampled at the start of this one, not before the
        last call returned: its grammar masks (about 1 ms of host time for 32 constrained rows
        of a 128k vocabulary) then follow the delivery of the outputs they wait for, instead of
        delaying every token, the first included. The device is still in its forward pass."""
        outputs: list[RequestOutput] = []
        if self._launched is not None:
            self._in_flight = self._sample(self._launched, outputs)
            self._launched = None
        prev, self._in_flight = self._in_flight, None
        out = self.scheduler.schedule()
        self.idle = out.empty and prev is None
        # On a GPU this call also waits for the step still on the device; on the CPU that
        # step's forward pass ran in the call that launched it.
        waits = prev is not None and self.device.type == "cuda"
        self.step_tokens = out.num_batched_tokens + (prev.out.num_batched_tokens if waits else 0)
        launched = self.runner.launch(out, prev)
        self.scheduler.advance(out)
        if out.failed:
            outputs += self._fail(out.failed)
        if prev is not None:
            outputs += self._resolve(prev)
        if self.async_scheduling:
            self._launched = None if out.empty else launched
            return outputs
        flight = self._sample(launched, outputs)
        return outputs + self._resolve(flight)

    def _sample(self, launched: LaunchedStep, outputs: list[RequestOutput]) -> InFlightStep:
        """Queue a launched step's sampling. A request whose grammar is still compiling (its
        prompt ran meanwhile) does not sample now: it steps back, to compute its last position
        again once the grammar is there. One whose grammar failed fails (into `outputs`)."""
        failed = []
        for req in launched.out.unready:
            # (One preempted since the launch starts over anyway.)
            if req.status is not RequestStatus.RUNNING:
                continue
            try:
                if not req.grammar_ready():
                    self.scheduler.step_back(req)
            except Exception as e:
                failed.append((req, e))
        if failed:
            outputs += self._fail(failed)
        return self.runner.sample(launched)

    def _fail(self, failures: list[tuple[Request, Exception]]) -> list[RequestOutput]:
        """End the requests whose grammar failed to compile, each with its error output."""
        processed = self.output_processor.fail(failures, "structured_outputs")
        for req, status in processed.to_finish:
            self.scheduler.finish_request(req, status)
        self._release_finished()
        return list(processed.outputs.values())

    def _resolve(self, flight: InFlightStep) -> list[RequestOutput]:
        """Read a step's tokens and turn them into outputs; end the requests they stop."""
        reqs, sampled = self.runner.resolve(flight)
        self.scheduler.update(
            flight.out,
            {
                r.request_id: t
                for i, (r, t) in enumerate(zip(reqs, sampled.token_ids, strict=True))
                if i not in sampled.failed
            },
        )
        for req in reqs:
            # A grammar that allows no further token ends its sequence as a stop would.
            if req.grammar is not None and req.grammar.terminated:
                self.scheduler.finish_request(req, RequestStatus.FINISHED_STOPPED)
        processed = self.output_processor.process(reqs, sampled)
        # The one place requests end for what the processor found: stop strings, failures.
        for req, status in processed.to_finish:
            self.scheduler.finish_request(req, status)
        self._release_finished()
        return list(processed.outputs.values())

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
            prompt_tokens=self.output_processor.prompt_tokens_total,
            generation_tokens=self.output_processor.generation_tokens_total,
        )
