"""Next-token choice for a batch of requests: penalties, logit bias, temperature, top-k / top-p /
min-p, greedy or seeded random sampling, and logprobs of the raw model distribution.

`Sampler.sample` only queues work on the device and returns, so that the host prepares the next
step meanwhile; `SampledBatch.read` waits for the results. A request whose own part fails (its
penalty state, generator, banned tokens, grammar mask) samples as a neutral greedy row whose token
is void, so that it cannot fail the batch; an error in the batched ops belongs to no request and
propagates."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvfleet.engine.request import Request
from kvfleet.engine.structured_output import GrammarMasks, apply_bitmask

# A sampled token's logprob and the top N (token id, logprob) of its distribution.
Logprobs = tuple[float, list[tuple[int, float]]]


def to_device(
    values: Sequence[int | float | bool], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A small host list on the device without waiting for the device: from pinned memory,
    asynchronously (a plain torch.tensor(..., device=cuda) synchronizes the stream)."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def to_host(t: torch.Tensor) -> torch.Tensor:
    """A copy of a device tensor on the host, queued behind the work that computes it: read it
    only once the event recorded after it has completed."""
    if t.device.type != "cuda":
        return t
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)


class PenaltyState:
    """Token counts a request's penalties need, kept on the device and updated one token per
    step rather than rebuilt from the whole history."""

    def __init__(self, prompt_token_ids: list[int], vocab_size: int, device: torch.device):
        self.output_counts = torch.zeros(vocab_size, dtype=torch.int32, device=device)
        self.seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        ids = to_device(prompt_token_ids, torch.long, device)
        self.seen[ids.clamp(0, vocab_size - 1)] = True

    def add(self, token_id: int) -> None:
        self.output_counts[token_id] += 1
        self.seen[token_id] = True


@dataclass
class _Row:
    """What the batched ops need from one request, prepared and checked on its own."""

    greedy: bool = True
    temperature: float = 1.0
    top_k: int = 0  # the vocabulary size when unrestricted
    top_p: float = 1.0
    min_p: float = 0.0
    logprobs: int | None = None
    generator: torch.Generator | None = None


@dataclass
class SampledBatch:
    """A batch whose tokens are chosen on the device (the next step's input ids there) and on
    their way to the host."""

    token_ids: torch.Tensor  # on the device, one per row
    tokens_host: torch.Tensor
    rows: list[_Row]
    # Row -> the error that failed that request's own part; its token is void.
    failed: dict[int, Exception]
    # On their way to the host: each row's chosen-token logprob, and the batch's top values and
    # ids (as wide as the widest request asked for).
    logprobs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # Recorded after the copies to the host; None on the CPU, where they are done at once.
    ready: torch.cuda.Event | None = None

    def read(self) -> tuple[list[int], list[Logprobs | None]]:
        """Wait for the copies to the host: each row's token, and its logprobs where its
        request asked for them."""
        if self.ready is not None:
            self.ready.synchronize()
        tokens = self.tokens_host.tolist()
        logprobs: list[Logprobs | None] = [None] * len(tokens)
        if self.logprobs is not None:
            picked, top_vals, top_ids = (t.tolist() for t in self.logprobs)
            for i, row in enumerate(self.rows):
                if row.logprobs is not None:
                    n = row.logprobs
                    top = list(zip(top_ids[i][:n], top_vals[i][:n], strict=True))
                    logprobs[i] = (picked[i], top)
        return tokens, logprobs


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device, seed: int) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self._penalties: dict[str, PenaltyState] = {}

    def forget(self, request_id: str) -> None:
        self._penalties.pop(request_id, None)

    def _penalty_state(self, req: Request) -> PenaltyState:
        state = self._penalties.get(req.request_id)
        if state is None:
            state = PenaltyState(req.prompt_token_ids, self.vocab_size, self.device)
            for t in req.output_token_ids:  # tokens produced before a preemption
                state.add(t)
            self._penalties[req.request_id] = state
        return state

    def record(self, req: Request, token_id: int) -> None:
        state = self._penalties.get(req.request_id)
        if state is not None:
            state.add(token_id)

    def sample(
        self, logits: torch.Tensor, reqs: list[Request], grammar: GrammarMasks | None = None
    ) -> SampledBatch:
        """Queue the batch's sampling on the logits' device; nothing here waits for the device.
        `grammar`: the batch's structured-output bitmask, applied after penalties and bans
        (logprobs stay those of the raw distribution). Advancing each request past its token
        (grammar matcher, penalty counts: record) is the caller's, once the token is read."""
        logits = logits.float()
        failed: dict[int, Exception] = {}
        rows: list[_Row] = []
        for i, req in enumerate(reqs):
            try:
                rows.append(self._prepare(req, logits[i]))
            except Exception as e:
                failed[i] = e
                rows.append(_Row())
        raw_logprobs = None
        if any(r.logprobs is not None for r in rows):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        for i, req in enumerate(reqs):
            if i in failed:
                continue
            try:
                self._apply_penalties_and_bans(logits[i], req)
            except Exception as e:
                failed[i] = e
                rows[i] = _Row()
        if grammar is not None:
            for i, error in grammar.failed.items():
                failed.setdefault(i, error)
                rows[i] = _Row()
        for i in failed:
            # A half-penalized row may hold NaNs; the batched ops must not see them.
            logits[i] = 0.0
        self._apply_logit_bias(logits, reqs, failed)
        if grammar is not None:
            # From StructuredOutputs.masks' pinned buffer, so the copy does not stall the host.
            # That buffer is rewritten only after this batch is read, which waits for
            # everything queued here first.
            apply_bitmask(logits, grammar.bitmask.to(logits.device, non_blocking=True))
        chosen = self._choose(logits, rows)
        batch = SampledBatch(chosen, to_host(chosen), rows, failed)
        if raw_logprobs is not None:
            picked = raw_logprobs.gather(1, chosen.unsqueeze(1)).squeeze(1)
            top_vals, top_ids = raw_logprobs.topk(max(max(r.logprobs or 0 for r in rows), 1), -1)
            batch.logprobs = (to_host(picked), to_host(top_vals), to_host(top_ids))
        if logits.is_cuda:
            batch.ready = torch.cuda.Event()
            batch.ready.record()
        return batch

    def _prepare(self, req: Request, row: torch.Tensor) -> _Row:
        """This request's part of the batch, checked so the batched ops cannot fail on it."""
        sp = req.sampling_params
        vocab = row.shape[-1]
        prepared = _Row(
            greedy=sp.greedy,
            temperature=max(float(sp.temperature), 1e-5),
            top_k=sp.top_k if 0 < sp.top_k < vocab else vocab,
            top_p=float(sp.top_p),
            min_p=float(sp.min_p),
            logprobs=None if sp.logprobs is None else min(sp.logprobs, vocab),
        )
        if sp.seed is not None and not sp.greedy:
            if req.generator is None:
                req.generator = torch.Generator(device=row.device).manual_seed(sp.seed)
            prepared.generator = req.generator
        if sp.uses_penalties:
            self._penalty_state(req)
        return prepared

    def _apply_penalties_and_bans(self, row: torch.Tensor, req: Request) -> None:
        """Penalize and ban in place one request's row of logits."""
        sp = req.sampling_params
        if sp.uses_penalties:
            state = self._penalty_state(req)
            if sp.repetition_penalty != 1.0:
                # As in HF/vLLM: positive logits shrink, negative ones grow more negative.
                # A where, not boolean indexing, which waits for the device to count the tokens.
                p = sp.repetition_penalty
                penalized = torch.where(row > 0, row / p, row * p)
                row.copy_(torch.where(state.seen, penalized, row))
            counts = state.output_counts.to(row.dtype)
            row -= sp.frequency_penalty * counts + sp.presence_penalty * (counts > 0).float()
        if req.num_output_tokens < sp.min_tokens:
            banned = list(sp.stop_token_ids)
            if not sp.ignore_eos:
                banned.extend(req.eos_token_ids)
            banned = [t for t in banned if 0 <= t < row.shape[0]]
            if banned:
                row.index_fill_(0, to_device(banned, torch.long, row.device), float("-inf"))

    @staticmethod
    def _apply_logit_bias(
        logits: torch.Tensor, reqs: list[Request], failed: dict[int, Exception]
    ) -> None:
        """Every request's logit_bias added in one scatter for the whole batch. Its ids were
        checked against the vocabulary at admission, so no request can fail the op; failed rows
        are left out (their token is discarded anyway)."""
        rows: list[int] = []
        cols: list[int] = []
        biases: list[float] = []
        for i, req in enumerate(reqs):
            bias = req.sampling_params.logit_bias
            if bias and i not in failed:
                rows.extend([i] * len(bias))
                cols.extend(bias)
                biases.extend(bias.values())
        if rows:
            dev = logits.device
            index = (to_device(rows, torch.long, dev), to_device(cols, torch.long, dev))
            values = to_device(biases, logits.dtype, dev)
            logits.index_put_(index, values, accumulate=True)

    def _choose(self, logits: torch.Tensor, rows: list[_Row]) -> torch.Tensor:
        """Each row's token, on the device."""
        flags = [r.greedy for r in rows]
        chosen = logits.argmax(dim=-1)
        if not all(flags):
            greedy = to_device(flags, torch.bool, logits.device)
            probs = self._filtered_probs(logits, rows)
            # Exponential-race sampling: argmax(p / E) with E ~ Exp(1) draws from p, and lets
            # seeded requests draw their noise from their own generator, independent of batch.
            noise = torch.empty_like(probs).exponential_(generator=self.generator)
            for i, row in enumerate(rows):
                if row.generator is not None:
                    noise[i].exponential_(generator=row.generator)
            sampled = (probs / noise).argmax(dim=-1)
            chosen = torch.where(greedy, chosen, sampled)
        return chosen

    def _filtered_probs(self, logits: torch.Tensor, rows: list[_Row]) -> torch.Tensor:
        dev = logits.device
        temps = to_device([r.temperature for r in rows], torch.float32, dev).unsqueeze(1)
        logits = logits / temps
        vocab = logits.shape[-1]
        # Which filters run is decided from the rows on the host, not from device tensors.
        if any(r.top_k < vocab or r.top_p < 1.0 for r in rows):
            top_k = to_device([r.top_k for r in rows], torch.long, dev)
            top_p = to_device([r.top_p for r in rows], torch.float32, dev)
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            ranks = torch.arange(vocab, device=dev).unsqueeze(0)
            drop = ranks >= top_k.unsqueeze(1)
            sorted_probs = sorted_logits.softmax(dim=-1)
            # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
            drop |= (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p.unsqueeze(1)
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
            logits = torch.empty_like(logits).scatter_(-1, order, sorted_logits)
        probs = logits.softmax(dim=-1)
        if any(r.min_p > 0 for r in rows):
            min_p = to_device([r.min_p for r in rows], torch.float32, dev)
            threshold = min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < threshold, 0.0)
        return probs
