"""What every OpenAI endpoint shares: the engine, the tokenizer, the served names, admission
control, and running a request's prompts through the engine."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from aiohttp import web
from pydantic import ValidationError

from kvfleet.engine.async_engine import AsyncEngine, EngineDeadError
from kvfleet.engine.outputs import CompletionOutput, RequestOutput
from kvfleet.engine.sampling_params import SamplingParams
from kvfleet.engine.server.errors import APIError, bad_request
from kvfleet.engine.server.streaming import merge_streams
from kvfleet.engine.server.validation import check_model, resolve_max_tokens, validation_error

logger = logging.getLogger(__name__)


@dataclass
class ServingContext:
    engine: AsyncEngine
    served_model_names: list[str]
    max_waiting_requests: int | None = None
    draining: bool = field(default=False)

    @property
    def tokenizer(self) -> Any:
        return self.engine.core.tokenizer

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    @property
    def max_model_len(self) -> int:
        return self.engine.core.model_config.max_model_len

    def admit(self, requested_model: str | None) -> None:
        """Reject before any work: unknown model, dead engine, or a full waiting queue."""
        check_model(requested_model, self.served_model_names)
        if not self.engine.is_alive():
            raise APIError(503, "the engine is not running", "service_unavailable",
                           headers={"Retry-After": "5"})  # fmt: skip
        limit = self.max_waiting_requests
        if limit is not None and self.engine.core.scheduler.num_waiting >= limit:
            raise APIError(
                429,
                f"too many requests waiting ({limit}); retry shortly",
                "rate_limit_error",
                code="queue_full",
                headers={"Retry-After": "1"},
            )

    def tokenize(self, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise bad_request("this server runs without a tokenizer: send token ids")
            return self.tokenizer(prompt, add_special_tokens=add_special_tokens).input_ids
        return list(prompt)

    def token_text(self, token_id: int) -> str:
        return _decode_one(self.tokenizer, token_id)

    def prepare(
        self, prompts: list[list[int]], requested_max_tokens: int | None, make_params: Any
    ) -> list[SamplingParams]:
        """Per-prompt sampling params with the completion budget fitted to the context, checked
        against the engine's limits so that every error is raised before a byte is streamed."""
        params = []
        for ids in prompts:
            if not ids:
                raise bad_request("the prompt is empty", param="prompt")
            max_tokens = resolve_max_tokens(len(ids), requested_max_tokens, self.max_model_len)
            try:
                sp = make_params(max_tokens)
            except ValidationError as e:
                raise validation_error(e) from None
            try:
                self.engine.core.validate_request(ids, sp)
            except ValueError as e:
                raise bad_request(str(e), param="prompt") from None
            params.append(sp)
        return params

    def run(
        self,
        request_id: str,
        prompts: list[list[int]],
        params: list[SamplingParams],
        texts: list[str | None] | None = None,
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        streams = [
            self.engine.generate(f"{request_id}-{i}", ids, sp, prompt=(texts[i] if texts else None))
            for i, (ids, sp) in enumerate(zip(prompts, params, strict=True))
        ]
        return merge_streams(streams)

    async def collect(
        self,
        outputs: AsyncIterator[tuple[int, RequestOutput]],
        prompts: list[list[int]],
        params: list[SamplingParams],
    ) -> list[RequestOutput]:
        """Accumulate whole results, for non-streaming responses."""
        results = [
            RequestOutput("", ids, [CompletionOutput(index=j) for j in range(sp.n)])
            for ids, sp in zip(prompts, params, strict=True)
        ]
        try:
            async with aclosing(outputs) as it:
                async for i, delta in it:
                    results[i].add(delta)
        except EngineDeadError as e:
            raise APIError(503, str(e), "service_unavailable") from None
        return results


@lru_cache(maxsize=65536)
def _decode_one(tokenizer: Any, token_id: int) -> str:
    return tokenizer.decode([token_id])


SERVING = web.AppKey("serving", ServingContext)
