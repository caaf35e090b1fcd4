"""Prompt tokens for token prefix keys, computed by the chat rendering the engine uses
(kvfleet.protocol.chat_template) from a local HF tokenizer directory (``--tokenizer``); without
one the router keys on characters."""

from __future__ import annotations

import logging
from typing import Any

from kvfleet.router.routing_key import PromptTokenizer

logger = logging.getLogger(__name__)


class EngineTokenizer:
    """Prompt tokens computed by the engine's code (chat template included), from a local HF
    tokenizer directory."""

    def __init__(self, path: str) -> None:
        # Imported here: transformers and jinja2 are needed for this mode only, which the
        # router's image does without.
        from transformers import AutoTokenizer

        from kvfleet.protocol.chat_template import ChatMessage, render_chat

        self._tok = AutoTokenizer.from_pretrained(path)
        self._render = render_chat
        self._message = ChatMessage

    def chat(
        self,
        messages: list[Any],
        add_generation_prompt: bool,
        template_kwargs: dict[str, Any] | None,
    ) -> list[int]:
        parsed = [self._message.model_validate(m) for m in messages]
        return self._render(self._tok, parsed, add_generation_prompt, template_kwargs)

    def text(self, prompt: str) -> list[int]:
        return self._tok(prompt).input_ids


def load_tokenizer(path: str | None) -> PromptTokenizer | None:
    if path is None:
        logger.info("prefix keys from characters (no --tokenizer): about 4 characters a token")
        return None
    try:
        tokenizer = EngineTokenizer(path)
    except (ImportError, OSError, ValueError) as e:
        logger.warning("tokenizer %s cannot be loaded (%s): prefix keys from characters", path, e)
        return None
    logger.info("prefix keys from tokens: tokenizer %s, engine chat template", path)
    return tokenizer
