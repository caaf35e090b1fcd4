"""Structured outputs in the engine: the compiled-grammar cache, the compile jobs that requests
wait on, each sequence's matcher, and the batch's token bitmask. What a constraint compiles to is
`grammar`; every constraint not seen before is compiled first in `grammar_sandbox`'s worker
processes, so a crash of the native compiler fails one request.

The grammar library is llguidance, chosen by measurement (bench/grammar_libs.py, RESULTS.md):
JSON schemas compile in about a millisecond, a mask takes microseconds at a 128k vocabulary, and
its resource limits are deterministic fuel counts rather than a thread to kill.

A compiled grammar is a validated matcher that every sequence copies (copies share the compiled
lexer and grammar); compiled grammars are cached by constraint in an LRU bounded in entries and
in the bytes the sandbox measured. A sequence's matcher lives on its Request, so it survives
preemption and recompute with the output tokens it has seen: the sampler advances it exactly
once per sampled token.
"""

from __future__ import annotations

import asyncio
import json
import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import llguidance
import torch

from kvfleet.engine.grammar import (
    _LIMITS,
    GrammarError,
    compile_matcher,
    grammar_tokenizer,
    tokenizer_json,
)
from kvfleet.engine.grammar_sandbox import COMPILE_STACK_BYTES, GrammarSandbox
from kvfleet.engine.host_cpus import usable_cpus
from kvfleet.engine.request import Request
from kvfleet.engine.sampling_params import StructuredOutputsParams
from kvfleet.kernels import reference
from kvfleet.kernels.availability import triton_available

logger = logging.getLogger(__name__)

# Compiled grammars kept, and the bytes they may hold together (a 60 KB enum schema's grammar
# holds tens of megabytes); a hit costs a dict lookup and a matcher copy.
GRAMMAR_CACHE_SIZE = 256
GRAMMAR_CACHE_BYTES = 256 << 20
# Wall-clock bound on one compilation in the sandbox, counted from when a compile thread takes
# it up; a worker that overruns it is killed.
COMPILE_TIMEOUT_S = 10.0
# Threads that compile grammars, each with a sandbox worker of its own: their own pool, so
# compilations neither queue behind other blocking work nor, in a burst of new schemas, count
# their wait for a thread as compile time.
COMPILE_THREADS = 2
_ALL_ALLOWED = -1  # an int32 bitmask word with every bit set


def mask_threads(cpus: int) -> int:
    """Threads that compute a step's bitmasks: a quarter of the usable CPUs, 1 to 8.
    llguidance's default, 80% of the cores, was no faster on an H100 host of 16 (32 rows under
    a JSON schema, 128k vocabulary, bench/profile_step.py: a step's masks took 0.78-1.02 ms at
    p50 with its 12 threads, 0.57-0.77 ms with 4, 0.85 ms with 1), and in a pod with a CPU
    limit it would size itself by cores the quota does not let it use."""
    return max(1, min(8, cpus // 4))


class GrammarMatcher:
    """One sequence's position in its grammar."""

    __slots__ = ("_matcher",)

    def __init__(self, matcher: Any) -> None:
        self._matcher = matcher

    def accept(self, token_id: int) -> None:
        """Advance past a sampled token; GrammarError if the grammar does not allow it or runs
        out of its limits (a constraint too costly to follow: the request's own fault)."""
        if not self._matcher.consume_token(token_id) or self._matcher.is_error():
            raise GrammarError(
                f"the grammar refused token {token_id}: {self.error}", "structured_outputs"
            )

    @property
    def terminated(self) -> bool:
        """The grammar is complete and allows no further token."""
        return bool(self._matcher.is_stopped())

    @property
    def error(self) -> str | None:
        return self._matcher.get_error() if self._matcher.is_error() else None

    @property
    def raw(self) -> Any:
        return self._matcher


class CompiledGrammar:
    """A validated grammar; matcher() starts a sequence at its beginning."""

    __slots__ = ("_prototype", "kind")

    def __init__(self, kind: str, prototype: Any) -> None:
        self.kind = kind
        self._prototype = prototype

    def matcher(self) -> GrammarMatcher:
        return GrammarMatcher(self._prototype.deep_copy())


def _cache_key(params: StructuredOutputsParams) -> str:
    return json.dumps(params.model_dump(exclude_defaults=True), sort_keys=True)


class GrammarJob:
    """A constraint's compilation in a compile thread. The engine may queue the request before
    it is done: the prompt prefills meanwhile and only its first sampled token waits (the
    scheduler polls `future`). The server awaits wait() for the outcome, its 400 included."""

    __slots__ = ("future", "started")

    def __init__(self) -> None:
        self.future: Future[CompiledGrammar] = Future()
        self.started: float | None = None  # time.monotonic() when a compile thread took it up

    @classmethod
    def done(cls, compiled: CompiledGrammar) -> GrammarJob:
        job = cls()
        job.future.set_result(compiled)
        job.started = time.monotonic()
        return job

    async def wait(self, timeout: float = COMPILE_TIMEOUT_S + 5.0) -> CompiledGrammar:
        """The compiled grammar, or GrammarError: the constraint's own, the sandbox's deadline,
        or (a backstop past that deadline) a timeout counted from when a compile thread took the
        job up (a wait for a free thread, in a burst of new schemas, is not held against the
        request)."""
        if self.future.done():
            return self.future.result()
        outcome = asyncio.wrap_future(self.future)
        # Read, so that a failure after this waiter has gone (timed out, cancelled) is not
        # logged as an exception nobody retrieved.
        outcome.add_done_callback(lambda f: f.cancelled() or f.exception())
        while True:
            started = self.started
            left = timeout if started is None else started + timeout - time.monotonic()
            if left <= 0:
                raise GrammarError(
                    f"the constraint took longer than {timeout:g} s to compile: simplify it",
                    "structured_outputs",
                )
            done, _ = await asyncio.wait([outcome], timeout=left)
            if done:
                return outcome.result()


class _CompileThreads:
    """Daemon threads that run compile tasks, with stacks of COMPILE_STACK_BYTES: deeper than a
    sandbox worker's, which a grammar must have survived first."""

    def __init__(self, count: int) -> None:
        self._tasks: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._closed = False
        previous = threading.stack_size(COMPILE_STACK_BYTES)
        try:
            self._threads = [
                threading.Thread(target=self._run, name=f"grammar-{i}", daemon=True)
                for i in range(count)
            ]
            for thread in self._threads:
                thread.start()
        finally:
            threading.stack_size(previous)

    def submit(self, task: Callable[[], None]) -> None:
        if self._closed:
            raise RuntimeError("cannot compile after shutdown")
        self._tasks.put(task)

    def _run(self) -> None:
        while (task := self._tasks.get()) is not None:
            task()

    def close(self) -> None:
        self._closed = True
        for _ in self._threads:
            self._tasks.put(None)


@dataclass(frozen=True)
class GrammarStats:
    """What the metrics export of the grammar compiler."""

    cache_entries: int
    cache_bytes: int
    compiles: int
    crashes: int


class StructuredOutputs:
    """The engine's grammar compiler and cache, for one tokenizer and vocabulary. ValueError at
    construction when the grammar library cannot read the tokenizer."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: frozenset[int],
        cache_size: int = GRAMMAR_CACHE_SIZE,
        cache_bytes: int = GRAMMAR_CACHE_BYTES,
    ) -> None:
        # The logits may be wider than the tokenizer (a padded vocabulary) or, rarely, narrower:
        # the masks cover both, and ids without a token are never allowed.
        self.mask_vocab = max(vocab_size, len(tokenizer))
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        serialized = tokenizer_json(tokenizer)
        eos = sorted(eos_token_ids)
        self.tokenizer = grammar_tokenizer(serialized, self.mask_vocab, eos)
        self.limits = llguidance.LLParserLimits(**_LIMITS)
        self.cache_size = cache_size
        self.cache_bytes = cache_bytes
        self._cache: OrderedDict[str, tuple[CompiledGrammar, int]] = OrderedDict()
        self._cached_bytes = 0
        self._lock = threading.Lock()
        self._compiling: dict[str, GrammarJob] = {}
        self.executor = llguidance.LLExecutor(num_threads=mask_threads(usable_cpus()))
        self.compiles = 0  # cache misses, for tests and metrics
        self._buffer: torch.Tensor | None = None
        self._sandbox = GrammarSandbox(serialized, self.mask_vocab, eos, COMPILE_THREADS)
        self._compilers = _CompileThreads(COMPILE_THREADS)

    def close(self) -> None:
        """Stop the compile threads and the sandbox's workers."""
        self._compilers.close()
        self._sandbox.close()

    def stats(self) -> GrammarStats:
        with self._lock:
            return GrammarStats(
                len(self._cache), self._cached_bytes, self.compiles, self._sandbox.crashes
            )

    def grammar(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """The compiled grammar of a constraint, from the cache or compiled now (blocking, in
        the caller's thread): in the sandbox first, then here. GrammarError for a bad one."""
        key = _cache_key(params)
        hit = self._lookup(key)
        if hit is not None:
            return hit
        size = self._sandbox.check(params, COMPILE_TIMEOUT_S)
        kind, prototype = compile_matcher(params, self.tokenizer, self.limits, self.eos_token_ids)
        compiled = CompiledGrammar(kind, prototype)
        with self._lock:
            self.compiles += 1
            old = self._cache.pop(key, None)
            if old is not None:
                self._cached_bytes -= old[1]
            self._cache[key] = (compiled, size)
            self._cached_bytes += size
            # The newest entry stays even alone over the byte bound: its requests are running.
            while len(self._cache) > self.cache_size or (
                self._cached_bytes > self.cache_bytes and len(self._cache) > 1
            ):
                _, (_, evicted) = self._cache.popitem(last=False)
                self._cached_bytes -= evicted
        return compiled

    def _lookup(self, key: str) -> CompiledGrammar | None:
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit[0]
            return None

    def submit(self, params: StructuredOutputsParams) -> GrammarJob:
        """Start compiling a constraint in a compile thread: a job already done for a cached one,
        the job in progress when the same constraint is compiling for another request (a burst
        of one new schema compiles it once)."""
        key = _cache_key(params)
        hit = self._lookup(key)
        if hit is not None:
            return GrammarJob.done(hit)
        with self._lock:
            job = self._compiling.get(key)
            if job is not None:
                return job
            job = self._compiling[key] = GrammarJob()
        try:
            self._compilers.submit(lambda: self._run(key, job, params))
        except BaseException:
            self._forget(key)
            raise
        return job

    def _run(self, key: str, job: GrammarJob, params: StructuredOutputsParams) -> None:
        job.started = time.monotonic()
        try:
            compiled = self.grammar(params)  # cached before the job leaves _compiling
        except BaseException as e:  # the request fails with it, never the compile thread
            self._forget(key)
            job.future.set_exception(e)
        else:
            self._forget(key)
            job.future.set_result(compiled)

    def _forget(self, key: str) -> None:
        with self._lock:
            del self._compiling[key]

    def masks(self, reqs: list[Request]) -> GrammarMasks | None:
        """The allowed-token bitmask of every row of a batch (int32, bit t of a row: token t
        allowed; every bit set for a row without a grammar), the constrained rows computed in
        parallel off the GIL; None when no row has a grammar. Rows whose matcher is in error
        fail alone. The buffer is reused by the next call: the sampler copies it first."""
        if all(req.grammar is None for req in reqs):
            return None
        width = (self.mask_vocab + 31) // 32
        if self._buffer is None or self._buffer.shape[0] < len(reqs):
            # Pinned, so the copy to the GPU is asynchronous.
            self._buffer = torch.empty(
                (max(len(reqs), 64), width),
                dtype=torch.int32,
                pin_memory=torch.cuda.is_available(),
            )
        view = self._buffer[: len(reqs)]
        # numpy's fill: no trip through torch's intra-op thread pool for a few kilobytes.
        view.numpy().fill(_ALL_ALLOWED)
        failed: dict[int, Exception] = {}
        rows: list[tuple[Any, int]] = []
        for i, req in enumerate(reqs):
            m = req.grammar
            if m is None:
                continue
            if m.error is not None:
                failed[i] = GrammarError(f"the constraint failed: {m.error}", "structured_outputs")
                continue
            rows.append((m.raw, i))
        if rows:
            # The executor writes each listed row of the contiguous int32 buffer in parallel.
            # (llguidance.torch wraps this same call, but importing it imports torch.compile and
            # with it Triton, seconds of start-up and a Triton not in interpreter mode on CPUs.)
            assert view.dtype == torch.int32 and view.is_contiguous() and not view.is_cuda
            self.executor.unsafe_compute_mask_ptr(
                rows, view.data_ptr(), view.shape[1] * 4, view.shape[0]
            )
        return GrammarMasks(view, failed)


@dataclass
class GrammarMasks:
    """A batch's token bitmask (on the CPU) and the rows that failed to compute theirs."""

    bitmask: torch.Tensor
    failed: dict[int, Exception]


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Ban, in one step for the whole batch, every token whose bit is clear: logits
    [rows, vocab], bitmask int32 [rows, >= vocab / 32] on the logits' device."""
    if logits.is_cuda and triton_available():
        # Imported here: the engine imports no Triton on the CPU.
        from kvfleet.kernels.grammar_mask import apply_token_bitmask

        apply_token_bitmask(logits, bitmask)
    else:
        reference.apply_token_bitmask(logits, bitmask)
