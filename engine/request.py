"""A request as admitted (EngineRequest: checked and resolved once, by admission.py; immutable)
and its mutable state as the scheduler and runner see it (Request)."""

from __future__ import annotations

import enum
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvfleet.engine.lora_request import LoRARequest
from kvfleet.engine.pooling import PoolingParams
from kvfleet.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    # Annotations only: the grammar sandbox's worker imports this module without torch.
    import torch

    from kvfleet.engine.structured_output import CompiledGrammar, GrammarMatcher


class InvalidRequestError(ValueError):
    """A request the engine can never run, the request parameter that says why, and the
    OpenAI error code of the refusal when it has one (context_length_exceeded)."""

    def __init__(self, message: str, param: str, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """A request admission (Admission.admit) has checked against the engine's limits: the engine
    queues it as it is, without checking again. The caller names it with a request id when it
    submits it."""

    prompt_token_ids: list[int]
    # As the client asked: max_tokens None means "up to the context length".
    params: SamplingParams
    # The tokens each sequence may generate, resolved within the context: where it stops.
    max_tokens: int
    prompt: str | None = None
    # time.monotonic() at admission, where latency metrics start.
    arrival_time: float = field(default_factory=time.monotonic)
    # The structured_outputs constraint, compiled, or still compiling (the server queues the
    # request meanwhile); each sequence gets its own matcher of it.
    grammar: CompiledGrammar | Future[CompiledGrammar] | None = None
    # The LoRA adapter it runs with; None: the base model.
    lora: LoRARequest | None = None
    # An embedding request (a pooling engine's): its prompt runs and is pooled, nothing is
    # sampled; max_tokens is 0 and params are the defaults.
    pooling: PoolingParams | None = None


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    # Its prefix's KV blocks are being copied back from the host tier; it waits again after.
    WAITING_FOR_HOST_KV = enum.auto()
    RUNNING = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    # The engine failed this request alone (an error in its sampling or detokenization).
    FINISHED_ERROR = enum.auto()

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: frozenset[int],
        max_tokens: int,
        arrival_time: float | None = None,
        grammar: CompiledGrammar | Future[CompiledGrammar] | None = None,
        lora: LoRARequest | None = None,
        pooling: PoolingParams | None = None,
    ) -> None:
        self.request_id = request_id
        self.lora = lora
        # Its adapter's GPU slot while the scheduler holds it one (running), else -1.
        self.lora_slot = -1
        # Scheduling steps that passed it over for want of its adapter's slot since it last
        # started: the scheduler's bound on an adapter's wait (Scheduler.starved_lora).
        self.lora_waited_steps = 0
        self.pooling = pooling
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        # Admission's resolution (EngineRequest.max_tokens): within the context already.
        self.max_tokens = max_tokens

        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        # Logprobs per output token: (chosen token logprob, [(token id, logprob) top-N]).
        self.logprobs: list[tuple[float, list[tuple[int, float]]]] = []
        self.num_computed_tokens = 0
        # Tokens sampled on the device that the host has not read yet (async scheduling): the
        # scheduler plans past them, the runner feeds them from the device.
        self.num_pending = 0
        self.num_cached_tokens = -1  # prefix-cache hit on first scheduling; -1 until then
        self.num_preemptions = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        # Hashes of the full blocks of all_token_ids, chained; extended as tokens arrive.
        self.block_hashes: list[bytes] = []
        self.generator: torch.Generator | None = None
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        # Where this sequence is in its structured_outputs grammar: advanced by the sampler once
        # per sampled token, kept across preemption like the output tokens it has seen.
        self.grammar: GrammarMatcher | None = None
        # The grammar still compiling, until grammar_ready() finds it done.
        self.pending_grammar: Future[CompiledGrammar] | None = None
        if isinstance(grammar, Future):
            self.pending_grammar = grammar
        elif grammar is not None:
            self.grammar = grammar.matcher()

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def finish_reason(self) -> str | None:
        return self.status.finish_reason

    def samples_after(self, num_new: int) -> bool:
        """Whether computing num_new more tokens reaches the end of those it has (known or in
        flight), so that the step samples its next one."""
        return self.num_computed_tokens + num_new == self.num_tokens + self.num_pending

    def grammar_ready(self) -> bool:
        """Whether the request may sample: False while its grammar compiles. Raises the
        compile's error (a GrammarError) when it failed."""
        pending = self.pending_grammar
        if pending is None:
            return True
        if not pending.done():
            return False
        self.grammar = pending.result().matcher()
        self.pending_grammar = None
        return True

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, prompt={self.num_prompt_tokens}, "
            f"out={self.num_output_tokens}, computed={self.num_computed_tokens}, "
            f"{self.status.name})"
        )
