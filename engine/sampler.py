"""Next-token choice for a batch of requests: penalties, temperature, top-k / top-p / min-p,
greedy or seeded random sampling, and logprobs of the raw model distribution."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvfleet.engine.request import Request


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # Per request: (logprob of the chosen token, top-N (token id, logprob)), or None when the
    # request did not ask for logprobs.
    logprobs: list[tuple[float, list[tuple[int, float]]] | None]


class PenaltyState:
    """Token counts a request's penalties need, kept on the device and updated one token per
    step rather than rebuilt from the whole history."""

    def __init__(self, prompt_token_ids: list[int], vocab_size: int, device: torch.device):
        self.output_counts = torch.zeros(vocab_size, dtype=torch.int32, device=device)
        self.seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        ids = torch.tensor(prompt_token_ids, dtype=torch.long, device=device)
        self.seen[ids.clamp(0, vocab_size - 1)] = True

    def add(self, token_id: int) -> None:
        self.output_counts[token_id] += 1
        self.seen[token_id] = True


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

    def __call__(self, logits: torch.Tensor, reqs: list[Request]) -> SamplerOutput:
        logits = logits.float()
        raw_logprobs = None
        if any(r.sampling_params.logprobs is not None for r in reqs):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        logits = self._apply_penalties_and_bans(logits, reqs)
        token_ids = self._choose(logits, reqs)
        for req, tok in zip(reqs, token_ids, strict=True):
            self.record(req, tok)
        return SamplerOutput(token_ids, self._logprobs(raw_logprobs, token_ids, reqs))

    def _apply_penalties_and_bans(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        for i, req in enumerate(reqs):
            sp = req.sampling_params
            row = logits[i]
            if sp.uses_penalties:
                state = self._penalty_state(req)
                if sp.repetition_penalty != 1.0:
                    # As in HF/vLLM: positive logits shrink, negative ones grow more negative.
                    rep = row[state.seen]
                    row[state.seen] = torch.where(
                        rep > 0, rep / sp.repetition_penalty, rep * sp.repetition_penalty
                    )
                counts = state.output_counts.to(row.dtype)
                row -= sp.frequency_penalty * counts + sp.presence_penalty * (counts > 0).float()
            if req.num_output_tokens < sp.min_tokens:
                banned = list(sp.stop_token_ids)
                if not sp.ignore_eos:
                    banned.extend(req.eos_token_ids)
                banned = [t for t in banned if 0 <= t < row.shape[0]]
                if banned:
                    row[banned] = float("-inf")
        return logits

    def _choose(self, logits: torch.Tensor, reqs: list[Request]) -> list[int]:
        flags = [r.sampling_params.greedy for r in reqs]
        chosen = logits.argmax(dim=-1)
        if not all(flags):
            greedy = torch.tensor(flags, device=logits.device)
            probs = self._filtered_probs(logits, reqs)
            # Exponential-race sampling: argmax(p / E) with E ~ Exp(1) draws from p, and lets
            # seeded requests draw their noise from their own generator, independent of batch.
            noise = torch.empty_like(probs).exponential_(generator=self.generator)
            for i, req in enumerate(reqs):
                if req.sampling_params.seed is not None and not req.sampling_params.greedy:
                    if req.generator is None:
                        req.generator = torch.Generator(device=logits.device).manual_seed(
                            req.sampling_params.seed
                        )
                    noise[i].exponential_(generator=req.generator)
            sampled = (probs / noise).argmax(dim=-1)
            chosen = torch.where(greedy, chosen, sampled)
        return chosen.tolist()

    def _filtered_probs(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        dev = logits.device
        temps = torch.tensor(
            [max(r.sampling_params.temperature, 1e-5) for r in reqs], device=dev
        ).unsqueeze(1)
        logits = logits / temps
        vocab = logits.shape[-1]
        top_k = torch.tensor(
            [r.sampling_params.top_k if r.sampling_params.top_k > 0 else vocab for r in reqs],
            device=dev,
        )
        top_p = torch.tensor([r.sampling_params.top_p for r in reqs], device=dev)
        min_p = torch.tensor([r.sampling_params.min_p for r in reqs], device=dev)
        if bool((top_k < vocab).any()) or bool((top_p < 1.0).any()):
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            ranks = torch.arange(vocab, device=dev).unsqueeze(0)
            drop = ranks >= top_k.clamp(max=vocab).unsqueeze(1)
            sorted_probs = sorted_logits.softmax(dim=-1)
            # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
            drop |= (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p.unsqueeze(1)
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
            logits = torch.empty_like(logits).scatter_(-1, order, sorted_logits)
        probs = logits.softmax(dim=-1)
        if bool((min_p > 0).any()):
            threshold = min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < threshold, 0.0)
        return probs

    @staticmethod
    def _logprobs(
        raw: torch.Tensor | None, token_ids: list[int], reqs: list[Request]
    ) -> list[tuple[float, list[tuple[int, float]]] | None]:
        if raw is None:
            return [None] * len(reqs)
        out: list[tuple[float, list[tuple[int, float]]] | None] = []
        chosen = raw.gather(1, torch.tensor(token_ids, device=raw.device).unsqueeze(1)).squeeze(1)
        max_n = max(r.sampling_params.logprobs or 0 for r in reqs)
        top_vals, top_ids = raw.topk(max(max_n, 1), dim=-1)
        chosen_l, top_vals_l, top_ids_l = chosen.tolist(), top_vals.tolist(), top_ids.tolist()
        for i, req in enumerate(reqs):
            n = req.sampling_params.logprobs
            if n is None:
                out.append(None)
                continue
            top = list(zip(top_ids_l[i][:n], top_vals_l[i][:n], strict=True))
            out.append((chosen_l[i], top))
        return out
