"""POST /v1/completions."""

from __future__ import annotations

from aiohttp import web

from kvfleet.engine.outputs import CompletionOutput, RequestOutput
from kvfleet.engine.server.answers import Answer, Logprobs, respond, vllm_prompt_logprobs
from kvfleet.engine.server.openai_requests import CompletionRequest
from kvfleet.engine.server.openai_responses import (
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    Usage,
    random_id,
)
from kvfleet.engine.server.serving import SERVING, ServingContext, traced
from kvfleet.engine.server.validation import invalid_as_400, parse_body
from kvfleet.telemetry.genai import TEXT_COMPLETION


class _LogprobsBuilder:
    """OpenAI's legacy completions logprobs: tokens, token_logprobs, top_logprobs, text_offset,
    the offsets running on across a choice's chunks."""

    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx
        self.offset = 0

    def build(self, token_ids: list[int], logprobs: Logprobs) -> CompletionLogprobs:
        out = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
        for token, entry in zip(token_ids, logprobs, strict=True):
            text = self.ctx.token_text(token)
            out.tokens.append(text)
            # An echoed prompt's first token: nothing predicts it, null as in OpenAI's API.
            out.token_logprobs.append(None if entry is None else entry[token])
            # As vLLM does: the top-N plus the sampled token, so up to N + 1 entries.
            out.top_logprobs.append(
                None
                if entry is None
                else {self.ctx.token_text(top): logprob for top, logprob in entry.items()}
            )
            out.text_offset.append(self.offset)
            self.offset += len(text)
        return out


def _nothing_to_send(choice: CompletionOutput) -> bool:
    """A token that completed no character (text held back) and carries no logprobs or finish:
    a chunk for it would be empty noise."""
    return not choice.text and choice.finish_reason is None and choice.logprobs is None


class _ChoiceFold:
    """A whole choice out of its chunks: their texts and logprobs joined."""

    def __init__(self) -> None:
        self.first: CompletionChoice | None = None
        self.texts: list[str] = []
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None

    def add(self, chunk: CompletionChoice) -> None:
        if self.first is None:
            self.first = chunk
        elif chunk.logprobs is not None and self.first.logprobs is not None:
            whole, more = self.first.logprobs, chunk.logprobs
            whole.tokens += more.tokens
            whole.token_logprobs += more.token_logprobs
            whole.top_logprobs += more.top_logprobs
            whole.text_offset += more.text_offset
        self.texts.append(chunk.text)
        self.finish_reason = chunk.finish_reason
        self.stop_reason = chunk.stop_reason

    def choice(self) -> CompletionChoice:
        assert self.first is not None
        return self.first.model_copy(
            update={
                "text": "".join(self.texts),
                "finish_reason": self.finish_reason,
                "stop_reason": self.stop_reason,
            }
        )


class CompletionAnswer(Answer[CompletionChoice, _ChoiceFold]):
    """Choice i of prompt p is choice p * n + i. A choice's first chunk carries the echoed
    prompt (with its logprobs when asked: they come with the first token) and the prompt's
    logprobs; max_tokens 0 scores the prompt alone, the token the engine generated dropped."""

    def __init__(
        self,
        ctx: ServingContext,
        req: CompletionRequest,
        request_id: str,
        model: str,
        prompts: list[list[int]],
        echoes: list[str],
    ) -> None:
        self.scoring_only = req.max_tokens == 0
        super().__init__(
            request_id, model, prompts, stream=req.stream,
            include_usage=bool(req.stream_options and req.stream_options.include_usage),
            counts_completion=not self.scoring_only,
        )  # fmt: skip
        self.ctx = ctx
        self.req = req
        self.echoes = echoes
        self.builders: dict[int, _LogprobsBuilder] = {}  # per choice index: its offsets
        self.scored: dict[int, RequestOutput] = {}  # per prompt: the output with its logprobs

    def choices(self, prompt_index: int, output: RequestOutput) -> list[CompletionChoice]:
        # The prompt's logprobs come once, with its first choice's first token.
        if output.prompt_logprobs is not None:
            self.scored[prompt_index] = output
        scored = self.scored.get(prompt_index, output)
        chunks = []
        for choice in output.outputs:
            index = prompt_index * self.req.n + choice.index
            builder = self.builders.get(index)
            first = builder is None
            if builder is None:
                builder = self.builders[index] = _LogprobsBuilder(self.ctx)
            elif _nothing_to_send(choice):
                continue
            echo = self.echoes[prompt_index] if first else None
            chunks.append(self._chunk(index, echo, scored, choice, builder))
        return chunks

    def _chunk(
        self,
        index: int,
        echo: str | None,
        prompt: RequestOutput,
        choice: CompletionOutput,
        builder: _LogprobsBuilder,
    ) -> CompletionChoice:
        """`echo`: the prompt's text, which a choice's first chunk carries; None in later ones."""
        req = self.req
        text = "" if self.scoring_only else choice.text
        tokens: list[int] = []
        logprobs: Logprobs = []
        if echo is not None:
            text = echo + text
            if req.echo and req.logprobs is not None and prompt.prompt_logprobs is not None:
                tokens, logprobs = list(prompt.prompt_token_ids), list(prompt.prompt_logprobs)
        if not self.scoring_only and choice.logprobs is not None:
            tokens += choice.token_ids
            logprobs += choice.logprobs
        prompt_logprobs = None
        if req.prompt_logprobs is not None and echo is not None and prompt.prompt_logprobs:
            prompt_logprobs = vllm_prompt_logprobs(self.ctx, prompt.prompt_logprobs)
        return CompletionChoice(
            index=index,
            text=text,
            logprobs=builder.build(tokens, logprobs) if req.logprobs is not None else None,
            finish_reason="length" if self.scoring_only else choice.finish_reason,
            stop_reason=None if self.scoring_only else choice.stop_reason,
            prompt_logprobs=prompt_logprobs,
        )

    def event(self, choices: list[CompletionChoice], usage: Usage | None) -> Completion:
        return self._completion(choices, usage)

    def new_fold(self) -> _ChoiceFold:
        return _ChoiceFold()

    async def whole(self, folds: list[_ChoiceFold]) -> Completion:
        return self._completion([fold.choice() for fold in folds], self.tally.usage())

    def _completion(self, choices: list[CompletionChoice], usage: Usage | None) -> Completion:
        return Completion(
            id=self.request_id, created=self.created, model=self.model, choices=choices,
            usage=usage,
        )  # fmt: skip


async def create_completion(request: web.Request) -> web.StreamResponse:
    ctx: ServingContext = request.app[SERVING]
    req = await parse_body(request, CompletionRequest)
    raw_prompts = req.prompts()
    num_sequences = len(raw_prompts) * req.n
    lora = ctx.check_can_queue(req.model, num_sequences)
    for p in raw_prompts:
        if isinstance(p, str):
            ctx.check_prompt_chars(len(p), "prompt")
    prompts = [await ctx.tokenize(p) for p in raw_prompts]
    texts = [p if isinstance(p, str) else None for p in raw_prompts]
    # max_tokens 0 (echo only) still runs one step: the prompt's last position samples.
    scoring_only = req.max_tokens == 0
    with invalid_as_400():
        params = req.sampling_params(1 if scoring_only else req.max_tokens)
    admitted = ctx.admit_prompts(
        prompts,
        params,
        texts,
        prompt_param="prompt",
        constraint_param=req.constraint[1],
        lora=lora,
    )
    echoes = [
        (t if t is not None else await ctx.decode(ids)) if req.echo else ""
        for t, ids in zip(texts, prompts, strict=True)
    ]
    request_id = random_id("cmpl")
    model = req.model or ctx.model_name
    outputs = await ctx.run(request_id, admitted)
    outputs = traced(request, TEXT_COMPLETION, request_id, model, admitted.requests, outputs)
    answer = CompletionAnswer(ctx, req, request_id, model, prompts, echoes)
    return await respond(request, answer, outputs)
