"""From sampled tokens to what front ends stream: incremental detokenization, stop strings, the
fan-in of a request's n children, logprobs (and their running sum) and the finish reason.

The scheduler has already applied the token-level stops (EOS, stop token ids, length) when a
step's tokens arrive here; stop strings are found here, in text. The processor never touches the
scheduler: it reports which requests must end (stopped by a stop string, or failed) and the
engine core ends them there."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from kvfleet.engine.detokenizer import IncrementalDetokenizer
from kvfleet.engine.model_runner import StepResult
from kvfleet.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvfleet.engine.request import EngineRequest, InvalidRequestError, Request, RequestStatus
from kvfleet.engine.sampler import Logprobs

logger = logging.getLogger(__name__)


@dataclass
class _Parent:
    """A user request; with n > 1 it runs as n child requests that share the prompt."""

    request_id: str
    request: EngineRequest
    children: list[Request]
    detokenizers: list[IncrementalDetokenizer] | None
    cumulative_logprobs: list[float]
    num_unfinished: int
    # Filled position by position as the prompt's chunks run (any child's: they score the same
    # tokens), handed out once, with the first token.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_logprobs_sent: bool = False


@dataclass
class ProcessedStep:
    # One delta per user request that changed in this step.
    outputs: dict[str, RequestOutput] = field(default_factory=dict)
    # Requests the scheduler must end now: stopped by a stop string, or failed with their parent.
    to_finish: list[tuple[Request, RequestStatus]] = field(default_factory=list)


class OutputProcessor:
    def __init__(self, tokenizer: Any | None) -> None:
        self.tokenizer = tokenizer
        self._parents: dict[str, _Parent] = {}
        self._child_of: dict[str, tuple[_Parent, int]] = {}
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0

    @property
    def num_requests(self) -> int:
        return len(self._parents)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._parents

    def add_request(self, request_id: str, request: EngineRequest, children: list[Request]) -> None:
        detokenizers = None
        if self.tokenizer is not None:
            sp = request.params
            detokenizers = [
                IncrementalDetokenizer(
                    self.tokenizer, request.prompt_token_ids, sp.stop, sp.skip_special_tokens
                )
                for _ in children
            ]
        parent = _Parent(
            request_id, request, children, detokenizers, [0.0] * len(children), len(children)
        )
        if request.params.prompt_logprobs is not None:
            unscored: list[dict[int, float] | None] = [None] * len(request.prompt_token_ids)
            parent.prompt_logprobs = unscored
        self._parents[request_id] = parent
        for i, child in enumerate(children):
            self._child_of[child.request_id] = (parent, i)

    def abort_request(self, request_id: str) -> list[Request]:
        """Forget a request; its children (none if it was not here), for the scheduler to end."""
        parent = self._parents.get(request_id)
        if parent is None:
            return []
        self._forget(parent)
        return parent.children

    def _forget(self, parent: _Parent) -> None:
        del self._parents[parent.request_id]
        for child in parent.children:
            del self._child_of[child.request_id]

    def process(self, result: StepResult) -> ProcessedStep:
        """A step's deltas from its tokens, which the scheduler has appended already. A failure
        in one request's sampling or detokenization fails that request alone."""
        step = ProcessedStep()
        reqs = result.reqs
        for rid, (start, scored) in result.prompt_logprobs.items():
            entry = self._child_of.get(rid)
            if entry is None:
                continue
            parent = entry[0]
            buf = parent.prompt_logprobs
            if buf is None:
                continue
            prompt = parent.request.prompt_token_ids
            for pos, (chosen, top) in enumerate(scored, start):
                buf[pos] = {prompt[pos]: chosen, **dict(top)}
        for rid, embedding in result.embeddings.items():
            self._embedded(rid, embedding, step)
        for i, error in result.failed.items():
            self._fail(reqs[i], "sampling", error, step)
        self.generation_tokens_total += len(reqs) - len(result.failed)
        finished: list[_Parent] = []
        for i, (req, token, logprobs) in enumerate(
            zip(reqs, result.token_ids, result.logprobs, strict=True)
        ):
            entry = self._child_of.get(req.request_id)
            if entry is None or i in result.failed:
                continue  # failed with its parent (this step or before)
            parent, index = entry
            try:
                if self._emit(parent, index, req, token, logprobs, step):
                    finished.append(parent)
            except Exception as e:
                self._fail(req, "detokenization", e, step)
        for parent in finished:
            if parent.request_id not in self._parents:
                continue  # a later child of the same step failed it
            step.outputs[parent.request_id].finished = True
            self._forget(parent)
        return step

    def _emit(
        self,
        parent: _Parent,
        index: int,
        req: Request,
        token: int,
        logprobs: Logprobs | None,
        step: ProcessedStep,
    ) -> bool:
        """Detokenize one child's new token, look for stop strings, add it to its parent's
        delta. True when this token finished the parent's last unfinished child."""
        finish_reason, stop_reason = req.finish_reason, req.stop_reason
        text = ""
        if parent.detokenizers is not None:
            detok = parent.detokenizers[index]
            stop = detok.add_token(token)
            if stop is not None:
                # A stop string wins over a token-level stop or the length limit in the same token.
                finish_reason, stop_reason = "stop", stop
                step.to_finish.append((req, RequestStatus.FINISHED_STOPPED))
            text = detok.take_delta(finish_reason is not None)
        completion = CompletionOutput(index, text, [token])
        if finish_reason is not None:
            completion.finish_reason = finish_reason
            completion.stop_reason = stop_reason
        if logprobs is not None:
            chosen, top = logprobs
            parent.cumulative_logprobs[index] += chosen
            completion.logprobs = [{token: chosen, **dict(top)}]
            completion.cumulative_logprob = parent.cumulative_logprobs[index]
        first = parent.children[0]
        delta = step.outputs.get(parent.request_id)
        if delta is None:
            delta = step.outputs[parent.request_id] = RequestOutput(
                parent.request_id,
                parent.request.prompt_token_ids,
                [],
                num_cached_tokens=max(first.num_cached_tokens, 0),
                prompt=parent.request.prompt,
            )
        if parent.prompt_logprobs is not None and not parent.prompt_logprobs_sent:
            # This child's prompt has run in full, so every position is scored.
            delta.prompt_logprobs = parent.prompt_logprobs
            parent.prompt_logprobs_sent = True
        first_token = req.num_output_tokens == 1
        if first_token:
            self.prompt_tokens_total += req.num_prompt_tokens
        if first_token or finish_reason is not None:
            # Latency metrics need the timestamps only at the first token and at the end.
            delta.metrics = RequestMetrics(
                first.arrival_time, first.first_scheduled_time, first.first_token_time
            )
        delta.outputs.append(completion)
        if finish_reason is None:
            return False
        parent.num_unfinished -= 1
        return not parent.num_unfinished

    def _embedded(self, request_id: str, embedding: list[float], step: ProcessedStep) -> None:
        """An embedding request's one output: its vector, and the request ends (stopped)."""
        entry = self._child_of.get(request_id)
        if entry is None:
            return  # aborted since its step was launched
        parent, index = entry
        req = parent.children[index]
        self.prompt_tokens_total += req.num_prompt_tokens
        step.to_finish.append((req, RequestStatus.FINISHED_STOPPED))
        self._forget(parent)
        step.outputs[parent.request_id] = RequestOutput(
            parent.request_id,
            parent.request.prompt_token_ids,
            [CompletionOutput(index, finish_reason="stop")],
            finished=True,
            num_cached_tokens=max(req.num_cached_tokens, 0),
            prompt=parent.request.prompt,
            metrics=RequestMetrics(req.arrival_time, req.first_scheduled_time),
            embedding=embedding,
        )

    def fail(self, failures: list[tuple[Request, Exception]], stage: str) -> ProcessedStep:
        """Fail the user requests of these sequences, each with its error, outside a step."""
        step = ProcessedStep()
        for req, error in failures:
            self._fail(req, stage, error, step)
        return step

    def _fail(self, req: Request, stage: str, error: Exception, step: ProcessedStep) -> None:
        """Fail the user request `req` belongs to (all its n children): its delta this step
        becomes the failure, and every child is to be ended."""
        entry = self._child_of.get(req.request_id)
        if entry is None:
            return  # already failed through a sibling
        parent = entry[0]
        message = f"{stage} failed: {str(error) or type(error).__name__}"
        own = error.param if isinstance(error, InvalidRequestError) else None
        if own is None:
            logger.error("request %s: %s", parent.request_id, message, exc_info=error)
        else:  # the request's own doing, not the engine's: no traceback
            logger.warning("request %s: %s", parent.request_id, message)
        step.to_finish.extend((child, RequestStatus.FINISHED_ERROR) for child in parent.children)
        self._forget(parent)
        step.outputs[parent.request_id] = RequestOutput(
            parent.request_id,
            parent.request.prompt_token_ids,
            [CompletionOutput(i, finish_reason="error") for i in range(len(parent.children))],
            finished=True,
            prompt=parent.request.prompt,
            error=message,
            error_param=own,
        )
