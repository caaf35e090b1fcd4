"""The engine loop: admit requests, schedule, run the model, apply stop conditions, detokenize,
and hand back per-step deltas. Single-threaded; front ends (offline LLM, AsyncEngine) drive it."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvfleet.engine.config import EngineArgs, ModelConfig
from kvfleet.engine.detokenizer import IncrementalDetokenizer
from kvfleet.engine.distributed import rank_device
from kvfleet.engine.kv_cache_manager import KVCacheManager
from kvfleet.engine.model_runner import ModelRunner
from kvfleet.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvfleet.engine.request import InvalidRequestError, Request, RequestStatus
from kvfleet.engine.sampling_params import SamplingParams, child_seed
from kvfleet.engine.scheduler import Scheduler
from kvfleet.engine.workers import TensorParallelWorkers

logger = logging.getLogger(__name__)


def load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def eos_token_ids(model_config: ModelConfig, tokenizer: Any) -> frozenset[int]:
    """Every id the checkpoint declares as end of sequence (generation_config may list several,
    as Llama 3 does)."""
    from transformers import GenerationConfig

    ids: set[int] = set()
    try:
        gen = GenerationConfig.from_pretrained(model_config.path)
        declared = [gen.eos_token_id]
    except OSError:
        declared = [getattr(model_config.hf_config, "eos_token_id", None)]
    for value in declared:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, Sequence):
            ids.update(int(v) for v in value)
    if not ids and getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


@dataclass
class _Parent:
    """A user request; with n > 1 it runs as n child requests that share the prompt."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[Request]
    detokenizers: list[IncrementalDetokenizer] | None
    cumulative_logprobs: list[float] = field(default_factory=list)
    num_unfinished: int = 0


class EngineCore:
    def __init__(self, args: EngineArgs, tokenizer: Any | None = None) -> None:
        self.args = args
        self.device = rank_device(args.resolved_device(), 0)
        self.model_config = ModelConfig.from_args(args, self.device)
        self.tokenizer = tokenizer
        if tokenizer is None and not args.skip_tokenizer_init:
            self.tokenizer = load_tokenizer(args.tokenizer or args.model)
        self.workers: TensorParallelWorkers | None = None
        if args.tensor_parallel_size > 1:
            self.workers = TensorParallelWorkers(args)
        try:
            self.runner = ModelRunner(
                args,
                self.model_config,
                self.device,
                on_loaded=self.workers.wait_loaded if self.workers is not None else None,
            )
        except BaseException:
            self.shutdown()
            raise
        if self.workers is not None:
            self.runner.before_forward = self.workers.send
        self.kv_cache_manager = KVCacheManager(
            self.runner.num_blocks, args.block_size, args.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            self.kv_cache_manager,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=self.model_config.max_model_len,
        )
        self.eos_token_ids = eos_token_ids(self.model_config, self.tokenizer)
        self.vocab_size = self.model_config.hf_config.vocab_size
        self._parents: dict[str, _Parent] = {}
        self._child_of: dict[str, tuple[_Parent, int]] = {}
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        logger.info(
            "engine ready: %s (%s) on %s x%d, %s, max_model_len=%d, prefix caching %s",
            self.model_config.path,
            self.model_config.architecture,
            self.device,
            args.tensor_parallel_size,
            self.model_config.dtype,
            self.model_config.max_model_len,
            "on" if args.enable_prefix_caching else "off",
        )

    def worker_failure(self) -> str | None:
        """Why a tensor-parallel worker can no longer run steps, or None."""
        return None if self.workers is None else self.workers.failure()

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (nothing to do with one rank)."""
        if self.workers is not None:
            self.workers.shutdown()

    # -- requests --------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        arrival_time: float | None = None,
    ) -> None:
        """Queue a request. Raises ValueError, having queued nothing, if it can never run."""
        if request_id in self._parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.validate_request(prompt_token_ids, params)
        children = []
        for i in range(params.n):
            child_params = params
            if params.n > 1:
                seed = None if params.seed is None else child_seed(params.seed, i)
                child_params = params.model_copy(update={"n": 1, "seed": seed})
            children.append(
                Request(
                    f"{request_id}#{i}",
                    prompt_token_ids,
                    child_params,
                    self.eos_token_ids,
                    self.model_config.max_model_len,
                    arrival_time,
                )
            )
        parent = _Parent(
            request_id,
            prompt,
            list(prompt_token_ids),
            children,
            None
            if self.tokenizer is None
            else [
                IncrementalDetokenizer(
                    self.tokenizer, prompt_token_ids, params.stop, params.skip_special_tokens
                )
                for _ in children
            ],
            [0.0] * len(children),
            len(children),
        )
        self._parents[request_id] = parent
        try:
            for i, child in enumerate(children):
                self._child_of[child.request_id] = (parent, i)
                self.scheduler.add_request(child)
        except BaseException:
            self.abort_request(request_id)  # leave nothing of it behind
            raise

    def validate_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise InvalidRequestError (a ValueError) for a request that could never run. Reads
        only fixed settings, so front ends may call it from any thread."""
        if params.stop and self.tokenizer is None:
            raise InvalidRequestError(
                "stop strings need a tokenizer (the engine runs without one)", "stop"
            )
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})",
                "prompt",
            )
        bad = [t for t in params.stop_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"stop_token_ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})",
                "stop_token_ids",
            )
        if params.top_k > self.vocab_size:
            raise InvalidRequestError(
                f"top_k ({params.top_k}) must not exceed the vocabulary size ({self.vocab_size})",
                "top_k",
            )
        room = self.model_config.max_model_len - len(prompt_token_ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        self.scheduler.check_request(len(prompt_token_ids), max_tokens)
        if params.min_tokens > room:
            raise InvalidRequestError(
                f"min_tokens ({params.min_tokens}) exceeds the {room} tokens the context length "
                f"(max_model_len {self.model_config.max_model_len}) leaves after the prompt",
                "min_tokens",
            )

    def abort_request(self, request_id: str) -> bool:
        """Stop a request now and free its KV blocks. False if it was not running."""
        parent = self._parents.pop(request_id, None)
        if parent is None:
            return False
        for child in parent.children:
            self.scheduler.abort_request(child.request_id)
            self._child_of.pop(child.request_id, None)
        self._release_finished()
        return True

    def _release_finished(self) -> None:
        for rid in self.scheduler.take_finished():
            self.runner.finish_request(rid)

    def has_unfinished_requests(self) -> bool:
        return bool(self._parents)

    @property
    def num_requests(self) -> int:
        return len(self._parents)

    # -- the loop --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        out = self.scheduler.schedule()
        sample_reqs, sampled = self.runner.execute(out)
        deltas: dict[str, RequestOutput] = {}
        for i, error in sampled.failed.items():
            self._fail(sample_reqs[i], "sampling", error, deltas)
        self.scheduler.update(
            out,
            {
                r.request_id: t
                for i, (r, t) in enumerate(zip(sample_reqs, sampled.token_ids, strict=True))
                if i not in sampled.failed
            },
        )
        self.generation_tokens_total += len(sample_reqs) - len(sampled.failed)

        finished_parents: list[_Parent] = []
        for i, (req, token, logprobs) in enumerate(
            zip(sample_reqs, sampled.token_ids, sampled.logprobs, strict=True)
        ):
            entry = self._child_of.get(req.request_id)
            if entry is None or i in sampled.failed:
                continue  # aborted, or failed with its parent (this step or before)
            parent, index = entry
            try:
                if self._emit(parent, index, req, token, logprobs, deltas):
                    finished_parents.append(parent)
            except Exception as e:
                self._fail(req, "detokenization", e, deltas)

        self._release_finished()
        for parent in finished_parents:
            if parent.request_id not in self._parents:
                continue  # a later child of the same step failed it
            deltas[parent.request_id].finished = True
            del self._parents[parent.request_id]
            for child in parent.children:
                del self._child_of[child.request_id]
        return list(deltas.values())

    def _emit(
        self,
        parent: _Parent,
        index: int,
        req: Request,
        token: int,
        logprobs: tuple[float, list[tuple[int, float]]] | None,
        deltas: dict[str, RequestOutput],
    ) -> bool:
        """Detokenize one child's new token, apply stop strings, add it to its parent's delta.
        True when this token finished the parent's last unfinished child."""
        status = req.status
        first_token = len(req.output_token_ids) == 1
        detok = parent.detokenizers[index] if parent.detokenizers else None
        text = ""
        if detok is not None:
            stop = detok.add_token(token)
            if stop is not None:
                if not status.finished:
                    self.scheduler.finish_request(req, RequestStatus.FINISHED_STOPPED)
                status = req.status = RequestStatus.FINISHED_STOPPED
                req.stop_reason = stop
            text = detok.take_delta(status.finished)
        completion = CompletionOutput(index, text, [token])
        if status.finished:
            completion.finish_reason = status.finish_reason
            completion.stop_reason = req.stop_reason
        if logprobs is not None:
            chosen, top = logprobs
            parent.cumulative_logprobs[index] += chosen
            completion.logprobs = [{token: chosen, **dict(top)}]
            completion.cumulative_logprob = parent.cumulative_logprobs[index]
        delta = deltas.get(parent.request_id)
        if delta is None:
            first = parent.children[0]
            delta = deltas[parent.request_id] = RequestOutput(
                parent.request_id,
                parent.prompt_token_ids,
                [],
                num_cached_tokens=max(first.num_cached_tokens, 0),
                prompt=parent.prompt,
            )
        if first_token:
            self.prompt_tokens_total += req.num_prompt_tokens
        if first_token or status.finished:
            # Latency metrics need the timestamps only at the first token and at the end.
            first = parent.children[0]
            delta.metrics = RequestMetrics(
                first.arrival_time, first.first_scheduled_time, first.first_token_time
            )
        delta.outputs.append(completion)
        if not status.finished:
            return False
        parent.num_unfinished -= 1
        return not parent.num_unfinished

    def _fail(
        self, req: Request, stage: str, error: Exception, deltas: dict[str, RequestOutput]
    ) -> None:
        """Fail the user request `req` belongs to (all its n children) and free its blocks;
        the engine goes on. Its delta this step becomes the failure."""
        entry = self._child_of.get(req.request_id)
        if entry is None:
            return  # already failed through a sibling
        parent = entry[0]
        message = f"{stage} failed: {str(error) or type(error).__name__}"
        logger.error("request %s: %s", parent.request_id, message, exc_info=error)
        for child in parent.children:
            # Blocks go back now; the runner and sampler forget it at the step's end.
            self.scheduler.finish_request(child, RequestStatus.FINISHED_ERROR)
            del self._child_of[child.request_id]
        del self._parents[parent.request_id]
        deltas[parent.request_id] = RequestOutput(
            parent.request_id,
            parent.prompt_token_ids,
            [CompletionOutput(i, finish_reason="error") for i in range(len(parent.children))],
            finished=True,
            prompt=parent.prompt,
            error=message,
        )

    def stats(self) -> dict[str, float]:
        s = self.scheduler.stats
        return {
            "num_requests_running": self.scheduler.num_running,
            "num_requests_waiting": self.scheduler.num_waiting,
            "kv_cache_usage_perc": self.kv_cache_manager.usage,
            "num_free_blocks": self.kv_cache_manager.num_free_blocks,
            "num_usable_blocks": self.kv_cache_manager.pool.num_usable_blocks,
            "num_preemptions": s.num_preemptions,
            "prefix_cache_queries": s.prefix_cache_queries,
            "prefix_cache_hits": s.prefix_cache_hits,
            "prompt_tokens": self.prompt_tokens_total,
            "generation_tokens": self.generation_tokens_total,
        }
