"""The offline API, as vLLM users know it: ``LLM(model=...).generate(prompts, sampling_params)``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any, TypedDict

from kvfleet.engine.config import EngineArgs
from kvfleet.engine.engine_core import EngineCore
from kvfleet.engine.outputs import CompletionOutput, RequestOutput
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
        self._ids = itertools.count()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers now rather than at interpreter exit."""
        self.engine.shutdown()

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.engine.tokenizer(prompt).input_ids
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return None, list(prompt["prompt_token_ids"])
        raise TypeError(f"a prompt is a str or {{'prompt_token_ids': [...]}}, not {prompt!r}")

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; one RequestOutput per prompt, in order. A request the
        engine failed alone (an error in its own sampling or detokenization, logged) comes back
        finished with `error` saying what failed and finish_reason "error" on each choice; the
        others complete as if it had not been there."""
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

        results: dict[str, RequestOutput] = {}
        order = []
        try:
            for prompt, sp in zip(prompts, params, strict=True):
                text, ids = self._tokenize(prompt)
                rid = str(next(self._ids))
                self.engine.add_request(rid, self.engine.admit(ids, sp, prompt=text))
                order.append(rid)
                results[rid] = RequestOutput(
                    rid, ids, [CompletionOutput(index=i) for i in range(sp.n)], prompt=text
                )
            while self.engine.has_unfinished_requests():
                for delta in self.engine.step():
                    results[delta.request_id].add(delta)
        except BaseException:
            for rid in order:
                self.engine.abort_request(rid)
            raise
        return [results[rid] for rid in order]
