"""The async front of the engine: EngineCore runs its loop in a thread of its own, off the event
loop; each request is an async stream of per-step outputs; a stream closed early (a client that
went away) aborts its request and frees its KV blocks at the next step boundary.

A request the engine failed alone (an error in queueing it, its sampling or detokenization)
ends its stream with RequestFailedError and the loop goes on; only errors no request can be
blamed for (the model forward, a batched tensor op, the device, a dead tensor-parallel worker)
end the loop, and then every stream, with EngineDeadError.

The server reaches the engine only through this facade: each public member says which thread
may call it. What the engine thread changes goes through its command queue; what the others
read is fixed at construction or published between steps."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from kvfleet.engine.config import ModelConfig
from kvfleet.engine.engine_core import EngineCore
from kvfleet.engine.kv_event_stream import KVEventStreams, KVEventSubscriber, SnapshotTaken
from kvfleet.engine.liveness import (
    RunningStep,
    StepRate,
    Verdict,
    default_seconds_per_token,
    stall_verdict,
    step_bound,
)
from kvfleet.engine.lora_request import LoRARequest
from kvfleet.engine.model_runner import StepInterrupted
from kvfleet.engine.outputs import EngineStats, RequestOutput
from kvfleet.engine.request import EngineRequest
from kvfleet.engine.sampling_params import SamplingParams, StructuredOutputsParams
from kvfleet.engine.startup_timing import StartupTimer
from kvfleet.engine.structured_output import CompiledGrammar, GrammarJob

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop has stopped; no request can make progress."""


class RequestFailedError(RuntimeError):
    """The engine failed this request alone (its sampling, detokenization, ...); its blocks are
    freed and the engine goes on. The message says which stage failed, without a traceback;
    `param` names the request's parameter when the request itself was at fault."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class RequestAbortedError(RuntimeError):
    """The server aborted this request (abort_all, e.g. at the shutdown deadline)."""


# Commands from the event loop to the engine thread, applied in order between steps.
@dataclass(frozen=True, slots=True)
class AddRequest:
    request_id: str
    request: EngineRequest


@dataclass(frozen=True, slots=True)
class Abort:
    request_id: str


@dataclass(frozen=True, slots=True)
class AbortAll:
    request_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class RemoveAdapter:
    lora: LoRARequest


@dataclass(frozen=True, slots=True)
class SubscribeKVEvents:
    subscriber: KVEventSubscriber


@dataclass(frozen=True, slots=True)
class UnsubscribeKVEvents:
    pass


@dataclass(frozen=True, slots=True)
class ResetPrefixCache:
    done: Future[bool]


Command = (
    AddRequest
    | Abort
    | AbortAll
    | RemoveAdapter
    | SubscribeKVEvents
    | UnsubscribeKVEvents
    | ResetPrefixCache
)


class AsyncEngine:
    def __init__(
        self,
        core: EngineCore,
        *,
        stall_timeout: float = 60.0,
        seconds_per_token: float | None = None,
        on_step: Callable[[list[RequestOutput]], None] | None = None,
        on_abort: Callable[[str], None] | None = None,
    ) -> None:
        """`stall_timeout` and `seconds_per_token` (default: the device's, liveness.py): the
        time a step may run, as liveness.step_bound says, and the time the loop may go without
        a step while requests wait, before the engine counts as stuck."""
        self.core = core
        self.stall_timeout = stall_timeout
        self.seconds_per_token = seconds_per_token or default_seconds_per_token(core.device.type)
        self._on_step = on_step
        self._on_abort = on_abort
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        # Sequences sent to the engine thread that it has not added to the scheduler yet.
        self._pending_lock = threading.Lock()
        self._pending_sequences = 0
        # Published by the engine thread between steps; read from any thread.
        self._stats = core.stats()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.error: BaseException | None = None
        # Published by the engine thread: when it last finished a step or found nothing to do,
        # when the step now running began (None between steps), the rate of recent steps.
        self.last_progress = time.monotonic()
        self._step_started: float | None = None
        self._rate = StepRate()
        # Test-only fault hook: while set, the loop wedges before its next step.
        self.fault_stall = threading.Event()
        # KV events (--kv-events): the subscribers, on the event loop; on the engine thread,
        # how many have subscribed and the seq of the last batch published.
        self.kv_events = KVEventStreams() if core.args.kv_events else None
        self._kv_subscribed = 0
        self._kv_seq = 0

    # -- fixed at construction: any thread -------------------------------------------------
    @property
    def model_config(self) -> ModelConfig:
        """The model's configuration (frozen): any thread."""
        return self.core.model_config

    @property
    def max_model_len(self) -> int:
        """The context length, prompt and completion together: any thread."""
        return self.core.model_config.max_model_len

    @property
    def startup(self) -> StartupTimer:
        """The seconds of each phase of the engine's start: any thread (the engine thread adds
        the graphs captured while serving)."""
        return self.core.startup

    @property
    def vocab_size(self) -> int:
        """Token ids run from 0 to this, exclusive: any thread."""
        return self.core.vocab_size

    @property
    def lora_modules(self) -> list[LoRARequest]:
        """The adapters the engine was started with (--lora-modules), checked: any thread."""
        return self.core.args.lora_requests()

    @property
    def tokenizer(self) -> Any:
        """The engine's tokenizer (None without one), never replaced: any thread."""
        return self.core.tokenizer

    def admit(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        grammar: CompiledGrammar | Future[CompiledGrammar] | None = None,
        *,
        refuse_past_context: bool = False,
        lora: LoRARequest | None = None,
    ) -> EngineRequest:
        """The engine's admission of a request (admission.Admission.admit), which reads only
        limits fixed at construction: any thread, the event loop included."""
        return self.core.admission.admit(
            prompt_token_ids,
            params,
            prompt,
            grammar,
            refuse_past_context=refuse_past_context,
            lora=lora,
        )

    def check_adapter(self, lora: LoRARequest) -> None:
        """LoRAAdapterError (a ValueError) unless the engine can serve the adapter: reads its
        folder (config, tensor header) against the model, changing nothing; any thread, best a
        worker thread (it reads files)."""
        self.core.runner.check_adapter(lora)

    def remove_adapter(self, lora: LoRARequest) -> None:
        """The engine forgets an unloaded adapter at its next step boundary (a command): any
        thread."""
        self._send(RemoveAdapter(lora))

    def admit_embedding(
        self, prompt_token_ids: list[int], dimensions: int | None = None, prompt: str | None = None
    ) -> EngineRequest:
        """The engine's admission of an embedding request (Admission.admit_embedding): any
        thread, the event loop included."""
        return self.core.admission.admit_embedding(prompt_token_ids, dimensions, prompt)

    @property
    def runner(self) -> str:
        """generate, or pooling for an embedding model: any thread."""
        return self.core.model_config.runner

    def compile_grammar(self, constraint: StructuredOutputsParams) -> GrammarJob | None:
        """Start compiling a structured_outputs constraint on a compile thread, never the
        caller's; None when structured outputs are off (admit says why): any thread."""
        structured = self.core.structured
        return None if structured is None else structured.submit(constraint)

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread: on the event loop, which its outputs are delivered to."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="kvfleet-engine", daemon=True)
        self._thread.start()
        if self.core.workers is not None:
            self.core.workers.watch(self._worker_died)

    async def stop(self) -> bool:
        """Stop the loop, interrupting a step in progress between two layers of its forward
        pass, and wait for it as long as it is busy, not stuck (liveness). False if it was stuck
        and is left running: the engine cannot be closed under it, and the process has to exit
        without finalizing (cli._serve). On the event loop."""
        self.end_kv_events()
        self._stopping = True
        self._wakeup.set()
        if self._thread is not None and not await asyncio.to_thread(self._await_end):
            return False
        await asyncio.to_thread(self.core.shutdown)
        return True

    def close(self) -> None:
        """Give back the engine's memory (EngineCore.close): any thread, once stop() returned
        True, when no step runs any more."""
        self.core.close()

    def _await_end(self) -> bool:
        assert self._thread is not None
        asked = time.monotonic()
        with self.core.interrupting():
            while self._thread.is_alive():
                self._thread.join(0.05)
                # Between steps the loop ends at once, however long it had been blocked before.
                verdict = self._verdict(waiting=True, progress=max(self.last_progress, asked))
                if self._thread.is_alive() and not verdict.healthy:
                    logger.error("the engine loop did not stop: %s", verdict.reason)
                    return False
        return True

    def _worker_died(self, reason: str) -> None:
        # The loop thread may be blocked in a collective with the dead rank: fail everything
        # from here rather than wait for it.
        self.error = EngineDeadError(reason)
        self._post(self._fail_all, EngineDeadError(f"the engine loop died: {reason}"))

    @property
    def num_unfinished(self) -> int:
        """Requests whose stream is open: on the event loop."""
        return len(self._streams)

    @property
    def num_waiting_sequences(self) -> int:
        """Sequences (each of a request's n counts) waiting in the scheduler, plus those sent to
        the engine thread and not added yet. Read from any thread: it may count a sequence
        twice for an instant while it moves into the scheduler, never miss one."""
        with self._pending_lock:
            pending = self._pending_sequences
        return self._stats.num_requests_waiting + pending

    def stats(self) -> EngineStats:
        """The engine's state as its thread last published it: between steps, once it has
        applied the commands sent to it. Any thread."""
        return self._stats

    def is_alive(self) -> bool:
        """The engine thread runs and no error has ended it: any thread."""
        return self._thread is not None and self._thread.is_alive() and self.error is None

    def is_healthy(self) -> bool:
        """Alive, and busy or idle rather than stuck (liveness()): on the event loop."""
        return self.is_alive() and self.liveness().healthy

    def liveness(self) -> Verdict:
        """Whether the loop is busy or stuck, and what it is doing: a step within its bound
        (its tokens' allowance) is busy, one past it is stuck, and so is a loop that starts no
        step for stall_timeout while requests wait. Call on the event-loop thread."""
        return self._verdict(waiting=bool(self._streams), progress=self.last_progress)

    def _verdict(self, *, waiting: bool, progress: float) -> Verdict:
        started = self._step_started
        step = None
        if started is not None:
            tokens = self.core.step_tokens
            bound = step_bound(
                tokens, self.stall_timeout, self.seconds_per_token, self._rate.seconds_per_token
            )
            step = RunningStep(started, tokens, bound)
        return stall_verdict(
            time.monotonic(),
            step=step,
            last_progress=progress,
            waiting=waiting,
            stall_timeout=self.stall_timeout,
        )

    # -- the engine thread -----------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopping:
                self._apply_commands()
                if not self.core.has_unfinished_requests():
                    self.last_progress = time.monotonic()
                    # Idle: the decode graphs left to capture, one per pass, so that a request
                    # that arrives waits for one capture at most.
                    if not self.core.capture_next_graph(idle=True):
                        self._wakeup.wait(timeout=1.0)
                        self._wakeup.clear()
                    continue
                while self.fault_stall.is_set() and not self._stopping:
                    time.sleep(0.01)
                started = self._step_started = time.monotonic()
                outputs = self.core.step()
                self.last_progress = time.monotonic()
                self._step_started = None
                self._rate.observe(self.last_progress - started, self.core.step_tokens)
                if self._on_step is not None:
                    self._on_step(outputs)
                if outputs:
                    self._post(self._deliver, outputs)
                self._publish_kv_events()
                # Busy: a graph the batches asked for, now and then (graph_schedule).
                if self.core.graphs_pending:
                    self.core.capture_next_graph(idle=False)
                if self.core.idle:
                    # Until a grammar compiles (its job wakes the loop) or a command comes.
                    self._wakeup.wait(timeout=1.0)
                    self._wakeup.clear()
        except StepInterrupted:
            # Only stop() interrupts a step; its requests were aborted or are left to it.
            logger.info("the step in progress was interrupted: the engine is stopping")
        except BaseException as e:
            logger.exception("engine loop died")
            # A collective failing because a worker died says less than the death itself.
            reason = self.core.worker_failure() or repr(e)
            self.error = e
            self._post(self._fail_all, EngineDeadError(f"the engine loop died: {reason}"))

    def _apply_commands(self) -> None:
        """Apply the commands sent so far, then publish the stats: the state after the last
        step and these commands."""
        received = 0  # sequences taken off the command queue
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(cmd, AddRequest):
                received += cmd.request.params.n
                self._add(cmd)
            elif isinstance(cmd, Abort):
                self._abort(cmd.request_id)
            elif isinstance(cmd, RemoveAdapter):
                self.core.remove_adapter(cmd.lora)
            elif isinstance(cmd, SubscribeKVEvents):
                self._subscribe_kv_events(cmd.subscriber)
            elif isinstance(cmd, UnsubscribeKVEvents):
                self._kv_subscribed -= 1
                if not self._kv_subscribed:
                    self.core.kv_event_log.stop()
            elif isinstance(cmd, ResetPrefixCache):
                cmd.done.set_result(self.core.reset_prefix_cache())
            else:
                for request_id in cmd.request_ids:
                    self._abort(request_id)
        self._publish_kv_events()
        self._stats = self.core.stats()
        # Only now that the scheduler's count is published: a sequence may be counted twice for
        # an instant, never missed.
        if received:
            with self._pending_lock:
                self._pending_sequences -= received

    def _subscribe_kv_events(self, sub: KVEventSubscriber) -> None:
        """Take the subscriber's snapshot after publishing what came before it, so that it and
        the batches after it add up to the cache exactly."""
        assert self.kv_events is not None
        self._publish_kv_events()
        self._kv_subscribed += 1
        self.core.kv_event_log.enabled = True
        gpu, cpu = self.core.cached_block_hashes()
        self._post(self.kv_events.start, sub, SnapshotTaken(self._kv_seq, gpu, cpu))

    def _publish_kv_events(self) -> None:
        log = self.core.kv_event_log
        if not log.enabled:
            return
        events = log.drain()
        if events and self.kv_events is not None:
            self._kv_seq += 1
            self._post(self.kv_events.publish, self._kv_seq, events)

    def _add(self, cmd: AddRequest) -> None:
        try:
            self.core.add_request(cmd.request_id, cmd.request)
        except ValueError as e:
            # Admission checked the request itself: what add_request refuses is the engine's
            # side, such as an adapter whose folder broke since it was loaded (the error says
            # which and how). The request alone fails, as a RequestFailedError the server
            # answers.
            logger.warning("request %s: queueing failed: %s", cmd.request_id, e)
            failure = RequestFailedError(f"queueing failed: {e}")
            self._post(self._deliver_error, cmd.request_id, failure)
        except Exception as e:
            # add_request queues nothing when it raises: the request alone is lost.
            logger.exception("request %s: queueing failed", cmd.request_id)
            failure = RequestFailedError(f"queueing failed: {e or type(e).__name__}")
            self._post(self._deliver_error, cmd.request_id, failure)

    def _abort(self, request_id: str) -> None:
        if self.core.abort_request(request_id) and self._on_abort is not None:
            self._on_abort(request_id)

    def _post(self, fn: Callable[..., None], *args: Any) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(fn, *args)

    # -- event-loop side -------------------------------------------------------------------
    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.put_nowait(
                    out if out.error is None else RequestFailedError(out.error, out.error_param)
                )

    def _deliver_error(self, request_id: str, error: BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.put_nowait(error)

    def _fail_all(self, error: BaseException) -> None:
        for stream in self._streams.values():
            stream.put_nowait(error)
        self.end_kv_events()

    def _send(self, cmd: Command) -> None:
        self._commands.put(cmd)
        self._wakeup.set()

    def subscribe_kv_events(self) -> KVEventSubscriber:
        """A new subscriber to the engine's KV events (--kv-events), its snapshot to come: on
        the event loop. Raises TooManySubscribers, or RuntimeError when events are off or the
        engine is not running. Every subscriber is given back with unsubscribe_kv_events."""
        if self.kv_events is None:
            raise RuntimeError("KV events are off (--no-kv-events)")
        if not self.is_alive():
            raise EngineDeadError("the engine loop is not running")
        sub = self.kv_events.open()
        self._send(SubscribeKVEvents(sub))
        return sub

    def unsubscribe_kv_events(self, sub: KVEventSubscriber) -> None:
        """End a subscription; the engine stops recording events when none is left: on the
        event loop."""
        assert self.kv_events is not None
        self.kv_events.end(sub)
        self._send(UnsubscribeKVEvents())

    def end_kv_events(self) -> None:
        """End every KV-event stream and take no new subscriber (the server drains, the engine
        stops or died): on the event loop."""
        if self.kv_events is not None:
            self.kv_events.close()

    async def reset_prefix_cache(self) -> bool:
        """Forget every cached block at the next step boundary (a command), as vLLM's
        reset_prefix_cache: False, changing nothing, while a request holds blocks. On the event
        loop."""
        if not self.is_alive():
            raise EngineDeadError("the engine loop is not running")
        done: Future[bool] = Future()
        self._send(ResetPrefixCache(done))
        return await asyncio.wrap_future(done)

    def abort(self, request_id: str) -> None:
        """Abort a request at the engine's next step boundary (a command): any thread."""
        self._send(Abort(request_id))

    def abort_all(self, reason: str) -> None:
        """End every unfinished stream now with RequestAbortedError(reason); the engine frees
        their KV blocks at its next step boundary. Call on the event-loop thread."""
        streams, self._streams = self._streams, {}
        if not streams:
            return
        logger.warning("aborting %d requests: %s", len(streams), reason)
        for stream in streams.values():
            stream.put_nowait(RequestAbortedError(reason))
        self._send(AbortAll(tuple(streams)))

    async def generate(
        self,
        request_id: str,
        request: EngineRequest,
        ready: Callable[[], Awaitable[Any]] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream an admitted request's (admit()) per-step deltas until it finishes: on the
        event loop. Raises ValueError before anything is queued if the id is in use;
        RequestFailedError if the engine failed this request, RequestAbortedError if abort_all
        ended it, EngineDeadError if the loop dies. ready(), awaited once the request is queued
        and before its first delta, may end the stream with its error, aborting the request:
        the server's wait for a grammar that compiles while the prompt prefills."""
        if not self.is_alive():
            raise EngineDeadError("the engine loop is not running")
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        stream: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._streams[request_id] = stream
        with self._pending_lock:
            self._pending_sequences += request.params.n
        if isinstance(request.grammar, Future):
            request.grammar.add_done_callback(lambda _: self._wakeup.set())
        self._send(AddRequest(request_id, request))
        finished = False
        try:
            if ready is not None:
                await ready()
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    finished = True  # nothing is left in the engine to abort
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            # abort_all may have replaced this stream's entry already: leave a newer one be.
            if self._streams.get(request_id) is stream:
                del self._streams[request_id]
            if not finished:
                self.abort(request_id)
