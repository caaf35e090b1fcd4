"""The offline API, as vLLM users know it: ``LLM(model=...).generate(prompts, sampling_params)``,
and ``LLM(model=..., runner="pooling").embed(prompts)`` for an embedding model."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any, TypedDict

from tqdm import tqdm

from kvfleet.engine.config import EngineArgs
from kvfleet.engine.engine_core import EngineCore
from kvfleet.engine.lora_request import LoRARequest
from kvfleet.engine.outputs import (
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    RequestOutput,
)
from kvfleet.engine.sampling_params import SamplingParams


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]


PromptType = str | TokensPrompt


class LLM:
    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        if model is None:
            # The built-in default model, as `kvfleet-engine generate` without --model.
            from kvfleet.engine.default_model import default_model_path

            model = str(default_model_path())
        self.engine = EngineCore(EngineArgs(model=model, **engine_args))
        # Offline, nothing is served before the first batch: every graph is captured now.
        self.engine.runner.capture_all_graphs()
        self._ids = itertools.count()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers and give back the engine's memory now rather than
        at interpreter exit; the LLM generates nothing after this."""
        self.engine.close()

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            tokenizer = self.engine.tokenizer
            if tokenizer is None:
                raise TypeError(
                    "a text prompt needs the tokenizer, which skip_tokenizer_init left out: "
                    "pass {'prompt_token_ids': [...]}"
                )
            return prompt, tokenizer(prompt).input_ids
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return None, list(prompt["prompt_token_ids"])
        raise TypeError(f"a prompt is a str or {{'prompt_token_ids': [...]}}, not {prompt!r}")

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; one RequestOutput per prompt, in order. A request the
        engine failed alone (an error in its own sampling or detokenization, logged) comes back
        finished with `error` saying what failed and finish_reason "error" on each choice; the
        others complete as if it had not been there.

        use_tqdm: a "Processed prompts" bar with token rates on stderr; None (the default) shows
        it when stderr is a terminal, True always, False never. lora_request: the LoRA adapter
        every prompt runs with, or one per prompt (None: the base model); the engine needs
        enable_lora."""
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(prompts)
        else:
            loras = list(lora_request)
            if len(loras) != len(prompts):
                raise ValueError(f"{len(prompts)} prompts but {len(loras)} LoRA requests")

        results: dict[str, RequestOutput] = {}
        order = []
        try:
            for prompt, sp, lora in zip(prompts, params, loras, strict=True):
                text, ids = self._tokenize(prompt)
                rid = str(next(self._ids))
                self.engine.add_request(rid, self.engine.admit(ids, sp, prompt=text, lora=lora))
                order.append(rid)
                results[rid] = RequestOutput(
                    rid, ids, [CompletionOutput(index=i) for i in range(sp.n)], prompt=text
                )
            self._run(results, disable=None if use_tqdm is None else not use_tqdm)
        except BaseException:
            for rid in order:
                self.engine.abort_request(rid)
            raise
        return [results[rid] for rid in order]

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        dimensions: int | None = None,
        use_tqdm: bool | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """Each prompt's embedding (an embedding model's, runner="pooling"), in order:
        `outputs.embedding`, truncated to `dimensions` where the model allows it. Raises
        InvalidRequestError (a ValueError) for a prompt the engine cannot embed; a request the
        engine failed alone raises RuntimeError with its error."""
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        results: dict[str, RequestOutput] = {}
        order = []
        try:
            for prompt in prompts:
                text, ids = self._tokenize(prompt)
                request = self.engine.admission.admit_embedding(ids, dimensions, text)
                rid = str(next(self._ids))
                self.engine.add_request(rid, request)
                order.append(rid)
                results[rid] = RequestOutput(rid, ids, [CompletionOutput(index=0)], prompt=text)
            self._run(results, disable=None if use_tqdm is None else not use_tqdm)
        except BaseException:
            for rid in order:
                self.engine.abort_request(rid)
            raise
        embedded = []
        for rid in order:
            out = results[rid]
            if out.embedding is None:
                raise RuntimeError(f"prompt {rid} was not embedded: {out.error}")
            embedded.append(
                EmbeddingRequestOutput(
                    rid, out.prompt_token_ids, EmbeddingOutput(out.embedding), prompt=out.prompt
                )
            )
        return embedded

    def _run(self, results: dict[str, RequestOutput], disable: bool | None) -> None:
        """Step the engine until every request is done, counting finished prompts on a bar."""
        prompt_tokens = generated_tokens = 0
        with tqdm(
            total=len(results), desc="Processed prompts", unit="prompt", disable=disable
        ) as bar:
            while self.engine.has_unfinished_requests():
                finished = 0
                for delta in self.engine.step():
                    out = results[delta.request_id]
                    out.add(delta)
                    if out.finished:
                        finished += 1
                        prompt_tokens += len(out.prompt_token_ids)
                        generated_tokens += sum(len(c.token_ids) for c in out.outputs)
                if finished and not bar.disable:
                    elapsed = bar.format_dict["elapsed"] or 1e-9
                    bar.set_postfix_str(
                        f"input: {prompt_tokens / elapsed:.1f} tok/s, "
                        f"output: {generated_tokens / elapsed:.1f} tok/s",
                        refresh=False,
                    )
                    bar.update(finished)
