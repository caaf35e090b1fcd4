"""Continuous batching: which requests run this step, and how many tokens each, under a token
budget; chunked prefill; preemption by recompute when KV blocks run out.

Pure decision logic over Requests and the KVCacheManager: no model, no tensors."""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

from kvfleet.engine.kv_cache_manager import KVCacheManager
from kvfleet.engine.kv_transfers import KVTransfers, TransfersDone
from kvfleet.engine.lora_request import LoRARequest
from kvfleet.engine.lora_slots import AdapterSlots, SlotChanges
from kvfleet.engine.request import Request, RequestStatus

logger = logging.getLogger(__name__)


@dataclass
class SchedulerOutput:
    # (request, number of its tokens computed this step), running requests first.
    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    # Block ids appended to each scheduled request's block table in this step.
    new_block_ids: dict[str, list[int]] = field(default_factory=dict)
    # Requests whose block table starts afresh (first run, or resumed after preemption).
    started: set[str] = field(default_factory=set)
    # Requests preempted in this step; their KV blocks are already released.
    preempted: list[str] = field(default_factory=list)
    # Requests whose grammar failed to compile, with the error: the engine fails them.
    failed: list[tuple[Request, Exception]] = field(default_factory=list)
    # Requests scheduled to sample while their grammar was still compiling: checked again at
    # sampling (these alone, not the whole batch) by settle_grammars.
    unready: list[Request] = field(default_factory=list)
    # Whether Scheduler.advance has moved the requests past this step.
    advanced: bool = False
    # LoRA adapters to copy into GPU slots (or drop from host memory) before this step runs.
    lora_changes: SlotChanges = field(default_factory=SlotChanges)
    # KV blocks to copy to and from the host tier before this step runs.
    kv_transfers: KVTransfers = field(default_factory=KVTransfers)

    @property
    def num_batched_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    @property
    def empty(self) -> bool:
        return not self.scheduled


@dataclass
class SchedulerStats:
    num_preemptions: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens found
    host_cache_queries: int = 0  # prompt tokens the device missed, looked up in the host tier
    host_cache_hits: int = 0  # of those, tokens found (copied back instead of computed)


class Scheduler:
    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        lora_slots: AdapterSlots | None = None,
        max_lora_wait_steps: int = 64,
    ) -> None:
        """`lora_slots`: where the LoRA adapters are (enable_lora): a request of an adapter
        starts only once its adapter is in host memory (the engine core reads it there) and
        has a GPU slot, pinned until it stops running; the host copy stays while the request
        is in the engine. A request passed over `max_lora_wait_steps` times for want of its
        adapter's slot is starved: see starved_lora."""
        if max_lora_wait_steps < 1:
            raise ValueError(f"max_lora_wait_steps must be >= 1, not {max_lora_wait_steps}")
        self.kv = kv_cache_manager
        self.lora_slots = lora_slots
        self.max_lora_wait_steps = max_lora_wait_steps
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Requests whose prefix is being copied back from the host tier, by id.
        self.loading: dict[str, Request] = {}
        self.requests: dict[str, Request] = {}
        self.stats = SchedulerStats()
        self._finished: list[str] = []

    # -- requests --------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        """Queue a request admission has resolved (EngineRequest): it fits the context and the
        KV cache, so it is queued as it is."""
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        if req.lora is not None:
            self._lora_slots.add_user(req.lora)
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.loading)

    def transfers_done(self, done: TransfersDone) -> None:
        """Copies to and from the host tier completed: stored blocks become servable, and each
        request whose prefix came back waits at the front, in the order of its load, to find
        it in the device cache."""
        self.kv.host_stored(done.stored, done.store_failed)
        returned = []
        for load_id, ok in done.loaded:
            req = self.loading.pop(self.kv.finish_load(load_id, ok), None)
            if req is not None:  # not aborted meanwhile
                req.status = RequestStatus.WAITING
                returned.append(req)
        self.waiting.extendleft(reversed(returned))

    # -- one step --------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        preempted = False

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            # (An embedding request generates nothing: it runs until its prompt is computed.)
            if req.pooling is None and req.num_output_tokens + req.num_pending >= req.max_tokens:
                i += 1  # its last token is in flight: it ends at length once that is read
                continue
            num_new = min(req.num_tokens + req.num_pending - req.num_computed_tokens, budget)
            num_new = self._until_grammar(req, req.num_computed_tokens, num_new, out)
            if num_new == 0:
                i += 1
                continue
            block_ids = self.kv.allocate_slots(req, num_new)
            while block_ids is None:
                victim = self.running.pop()  # the newest running request gives way
                self._preempt(victim, out)
                preempted = True
                if victim is req:
                    break
                block_ids = self.kv.allocate_slots(req, num_new)
            if block_ids is None:
                break
            out.scheduled.append((req, num_new))
            out.new_block_ids[req.request_id] = block_ids
            budget -= num_new
            i += 1

        starved = self.starved_lora()
        # After a preemption the pool is known to be short: admitting more would only thrash.
        w = 0
        while (
            not preempted
            and w < len(self.waiting)
            and budget > 0
            and len(self.running) < self.max_num_seqs
        ):
            req = self.waiting[w]
            lora = req.lora
            if starved is not None and lora is not None and lora != starved:
                # Held back while another adapter's request starves, so that the slots' running
                # requests drain; the base model's go on (they take no slot).
                w += 1
                continue
            if lora is not None and not self._lora_slots.can_acquire(lora):
                # Its adapter is not read into host memory yet, or every slot is pinned by other
                # adapters' running requests: this one waits; requests of held adapters and of
                # the base model go on, until it has waited max_lora_wait_steps.
                req.lora_waited_steps += 1
                w += 1
                continue
            hits, num_cached = self.kv.get_computed_blocks(req)
            host_hits = self.kv.get_host_blocks(req, len(hits))
            if host_hits:
                if not self.kv.start_load(req, hits, host_hits):
                    break
                del self.waiting[w]
                req.status = RequestStatus.WAITING_FOR_HOST_KV
                self.loading[req.request_id] = req
                if req.num_cached_tokens < 0:
                    self._count_lookup(req, num_cached, len(host_hits) * self.kv.block_size)
                continue
            num_new = min(req.num_tokens - num_cached, budget)
            num_new = self._until_grammar(req, num_cached, num_new, out)
            if num_new == 0:
                w += 1  # it waits for its grammar; those behind it need not
                continue
            block_ids = self.kv.allocate_slots(req, num_new, hits)
            if block_ids is None:
                break
            del self.waiting[w]
            if lora is not None:
                req.lora_slot = self._lora_slots.acquire(lora)
                req.lora_waited_steps = 0
            req.num_computed_tokens = num_cached
            req.status = RequestStatus.RUNNING
            if req.num_cached_tokens < 0:
                self._count_lookup(req, num_cached, 0)
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.monotonic()
            self.running.append(req)
            out.scheduled.append((req, num_new))
            out.new_block_ids[req.request_id] = block_ids
            out.started.add(req.request_id)
            budget -= num_new
        if self.lora_slots is not None:
            out.lora_changes = self.lora_slots.take_changes()
        out.kv_transfers = self.kv.take_transfers()
        return out

    def _count_lookup(self, req: Request, device_hits: int, host_hits: int) -> None:
        """A request's first lookup in the prefix cache, counted once in its life: tokens found
        on the device, then of those missed there, tokens found in the host tier."""
        req.num_cached_tokens = device_hits + host_hits
        self.stats.prefix_cache_queries += req.num_tokens
        self.stats.prefix_cache_hits += device_hits
        if self.kv.host is not None:
            self.stats.host_cache_queries += req.num_tokens - device_hits
            self.stats.host_cache_hits += host_hits

    def starved_lora(self) -> LoRARequest | None:
        """The adapter of the first waiting request that its adapter's want of a slot (or of
        host memory) has passed over max_lora_wait_steps times, if any. Until that request
        starts, no request of another adapter starts: FCFS with skipping alone would let a
        steady stream of requests of resident adapters keep every slot pinned, and this one
        waiting for ever. The engine core reads this adapter into host memory first, making
        room from copies that only waiting requests use."""
        bound = self.max_lora_wait_steps
        for req in self.waiting:
            if req.lora is not None and req.lora_waited_steps >= bound:
                return req.lora
        return None

    @property
    def _lora_slots(self) -> AdapterSlots:
        if self.lora_slots is None:
            raise ValueError("a LoRA request reached a scheduler without LoRA slots")
        return self.lora_slots

    def _unpin(self, req: Request) -> None:
        """A request that stops running gives back its hold on its adapter's slot."""
        if req.lora is not None and req.lora_slot >= 0:
            self._lora_slots.release(req.lora)
            req.lora_slot = -1

    @staticmethod
    def _until_grammar(req: Request, computed: int, num_new: int, out: SchedulerOutput) -> int:
        """num_new, or 0 for a request that would only compute the position that samples while
        its grammar still compiles: nothing to run until the grammar is there. A longer run
        goes ahead, listed in out.unready (the grammar is needed at sampling, one forward pass
        later; if it is not there yet, the engine steps the request back). A grammar that
        failed: 0, and the request goes in out.failed."""
        if req.pending_grammar is None or computed + num_new < req.num_tokens + req.num_pending:
            return num_new
        try:
            if req.grammar_ready():
                return num_new
        except Exception as e:
            out.failed.append((req, e))
            return 0
        if num_new == 1:
            return 0
        out.unready.append(req)
        return num_new

    def settle_grammars(self, out: SchedulerOutput) -> list[tuple[Request, Exception]]:
        """Before a launched step samples: each request it lists as unready samples if its
        grammar has compiled since, or steps back if not. Returns those whose grammar failed,
        with the error, for the engine to fail."""
        failed = []
        for req in out.unready:
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted since the launch, it starts over anyway; or finished
            try:
                if not req.grammar_ready():
                    self.step_back(req)
            except Exception as e:
                failed.append((req, e))
        return failed

    def step_back(self, req: Request) -> None:
        """Undo the sampling a launched step planned for `req` (its grammar is still
        compiling): its last position is computed again, and samples, in a later step."""
        req.num_pending -= 1
        req.num_computed_tokens -= 1

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.kv.free(req)
        self._unpin(req)
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.stats.num_preemptions += 1
        # Older requests were popped later and so land in front: FCFS order survives.
        self.waiting.appendleft(req)
        out.preempted.append(req.request_id)
        logger.debug("preempted %s", req)

    def advance(self, out: SchedulerOutput) -> None:
        """Move the scheduled requests past this step once it is launched, before its tokens are
        known: the next schedule plans from here. A request that reached the end of its tokens
        has one more on the way (num_pending) until update() appends it."""
        if out.advanced:
            return
        out.advanced = True
        for req, num_new in out.scheduled:
            if req.status is not RequestStatus.RUNNING:
                continue  # aborted before the step was launched
            if req.samples_after(num_new) and req.pooling is None:
                req.num_pending += 1
            req.num_computed_tokens += num_new

    def update(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Append the tokens a step sampled (advancing it first if that is not done) and apply
        the token-level stop conditions. A request preempted since the step was launched keeps
        its token; one that finished meanwhile (aborted, or stopped by the token before) takes
        none. Returns the requests that got a new token."""
        self.advance(out)
        advanced = []
        for req, _ in out.scheduled:
            token = sampled.get(req.request_id)
            if token is None or req.status.finished:
                continue  # a prefill chunk short of the prompt's end, or a request gone
            req.num_pending -= 1
            req.append_token(token)
            if req.first_token_time is None:
                req.first_token_time = time.monotonic()
            advanced.append(req)
            status = self._stop_status(req, token)
            if status is not None:
                self.finish_request(req, status)
        return advanced

    def _stop_status(self, req: Request, token: int) -> RequestStatus | None:
        sp = req.sampling_params
        if req.num_output_tokens >= sp.min_tokens:
            if not sp.ignore_eos and token in req.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token in sp.stop_token_ids:
                req.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= req.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        # A grammar that allows no further token ends its sequence as a stop would.
        if req.grammar is not None and req.grammar.terminated:
            return RequestStatus.FINISHED_STOPPED
        return None

    def finish_request(self, req: Request, status: RequestStatus) -> None:
        """End a request for any reason (stop, length, abort) and release its blocks at once."""
        if req.status.finished:
            return
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status is RequestStatus.WAITING_FOR_HOST_KV:
            # Its load keeps the blocks it copies into until the copy is done.
            del self.loading[req.request_id]
        else:
            self.waiting.remove(req)
        req.status = status
        self.kv.free(req)
        self._unpin(req)
        if req.lora is not None:
            self._lora_slots.drop_user(req.lora)
        self._finished.append(req.request_id)
        del self.requests[req.request_id]

    def take_finished(self) -> list[str]:
        """Ids of the requests finished (for any reason) since the last call, so the model
        runner can drop their per-request state at once."""
        finished, self._finished = self._finished, []
        return finished

    def abort_request(self, request_id: str) -> Request | None:
        req = self.requests.get(request_id)
        if req is not None:
            self.finish_request(req, RequestStatus.FINISHED_ABORTED)
        return req
