"""A model call's span with the OpenTelemetry GenAI semantic conventions (the gen_ai.* names,
development status, as of semantic-conventions 1.37 and its GenAI repository), so that trace
back ends that understand them show the model, token counts and time to first token; an
embeddings call's span with the model, the input tokens and the vectors' format and width."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

# gen_ai.operation.name values for the OpenAI endpoints.
CHAT = "chat"
TEXT_COMPLETION = "text_completion"
EMBEDDINGS = "embeddings"


class GenAISpan:
    """Records one model request on its span: the request's model and settings at the start
    and, for a generation, the first token when it comes and the response's id, usage and
    finish reasons at the end; for embeddings, the input tokens and the vectors' width. The
    span is the request's SERVER span; it is renamed as the conventions name an inference
    span, "{operation} {model}"."""

    def __init__(self, span: Any, operation: str, model: str) -> None:
        self.span = span
        self._started = time.monotonic()
        self._first_token: float | None = None
        span.update_name(f"{operation} {model}")
        span.set_attributes({"gen_ai.operation.name": operation, "gen_ai.request.model": model})

    def request(
        self, *, max_tokens: int | None, temperature: float | None, top_p: float | None, n: int
    ) -> None:
        settings = {
            "gen_ai.request.max_tokens": max_tokens,
            "gen_ai.request.temperature": temperature,
            "gen_ai.request.top_p": top_p,
            "gen_ai.request.choice.count": n if n != 1 else None,
        }
        self.span.set_attributes({k: v for k, v in settings.items() if v is not None})

    def first_token(self) -> None:
        """Called for every output: only the first one counts."""
        if self._first_token is not None:
            return
        self._first_token = time.monotonic()
        ttft = self._first_token - self._started
        self.span.set_attribute("gen_ai.response.time_to_first_chunk", ttft)
        self.span.add_event("gen_ai.first_token", {"gen_ai.response.time_to_first_chunk": ttft})

    def response(
        self,
        *,
        response_id: str,
        model: str,
        input_tokens: int,
        output_tokens: int,
        cached_input_tokens: int,
        finish_reasons: Iterable[str],
    ) -> None:
        self.span.set_attributes(
            {
                "gen_ai.response.id": response_id,
                "gen_ai.response.model": model,
                "gen_ai.usage.input_tokens": input_tokens,
                "gen_ai.usage.output_tokens": output_tokens,
                "gen_ai.usage.cache_read.input_tokens": cached_input_tokens,
                "gen_ai.response.finish_reasons": list(finish_reasons),
            }
        )

    def embeddings_request(self, *, encoding_format: str) -> None:
        # A list in the conventions: a request to some providers names several formats.
        self.span.set_attribute("gen_ai.request.encoding_formats", [encoding_format])

    def embeddings_response(self, *, model: str, input_tokens: int, dimensions: int) -> None:
        """The embeddings returned: their width (the request's dimensions, or the model's own
        width) and the input tokens embedded."""
        self.span.set_attributes(
            {
                "gen_ai.response.model": model,
                "gen_ai.usage.input_tokens": input_tokens,
                "gen_ai.embeddings.dimension.count": dimensions,
            }
        )
