"""Prompt tokens for token prefix keys and precise prefix scoring, computed by the chat rendering
the engine uses (kvfleet.protocol.chat_template) from a local HF tokenizer directory
(``--tokenizer``, or the engines' own tokenizer written into one: fetched_tokenizer.py); without
one the router keys on characters.

Only the head of a prompt matters to routing, and tokenizing is the router's largest cost per
request (milliseconds for a few thousand tokens, where the rest of routing takes tens of
microseconds): the rendered text is cut to ``max_chars`` characters before it is tokenized
(RouterSettings.tokenized_chars), and the last TAIL_TOKENS tokens of a cut text are dropped,
since a token may straddle the cut; those kept are the ones the whole text begins with. A token
run longer than TAIL_TOKENS at the cut makes a prefix score shorter, never wrong.

Heads repeat: a prompt longer than the cut begins, in the workloads prefix routing is for, with
the shared system prompt or conversation that makes it worth routing. The tokens of the last
CACHED_HEADS cut heads are kept, so a repeated head costs a dictionary lookup instead of a
tokenization.
"""

from __future__ import annotations

import logging
import threading
from array import array
from collections import OrderedDict
from typing import Any

from kvfleet.protocol.block_hash import BLOCK_SIZE
from kvfleet.router.routing_key import PromptTokenizer

logger = logging.getLogger(__name__)

TAIL_TOKENS = BLOCK_SIZE
# About 8 KiB of text and 8 KiB of ids each at the default cut: under 20 MiB in all.
CACHED_HEADS = 1024


class EngineTokenizer:
    """Prompt tokens computed by the engine's code (chat template included), from a local HF
    tokenizer directory."""

    def __init__(self, path: str, max_chars: int | None = None) -> None:
        # Imported here: only a router that tokenizes loads transformers (the operator, which
        # runs from the same image, never does).
        from transformers import AutoTokenizer

        from kvfleet.protocol.chat_template import ChatMessage, conversation_of, render_chat_text

        self._tok = AutoTokenizer.from_pretrained(path)
        self._render = render_chat_text
        self._conversation = conversation_of
        self._message = ChatMessage
        self.max_chars = max_chars
        self._heads: OrderedDict[tuple[str, bool], array[int]] = OrderedDict()
        self._heads_lock = threading.Lock()  # requests are tokenized in worker threads

    def chat(
        self,
        messages: list[Any],
        add_generation_prompt: bool,
        template_kwargs: dict[str, Any] | None,
    ) -> list[int]:
        parsed = [self._message.model_validate(m) for m in messages]
        text = self._render(
            self._tok, self._conversation(parsed), add_generation_prompt, template_kwargs
        )
        # The template writes the special tokens (BOS included) itself, as the engine has it.
        return self._ids(text, special_tokens=False)

    def text(self, prompt: str) -> list[int]:
        return self._ids(prompt, special_tokens=True)

    def _ids(self, text: str, special_tokens: bool) -> list[int]:
        if self.max_chars is None or len(text) <= self.max_chars:
            return self._tok(text, add_special_tokens=special_tokens).input_ids
        key = (text[: self.max_chars], special_tokens)
        with self._heads_lock:
            kept = self._heads.get(key)
            if kept is not None:
                self._heads.move_to_end(key)
                return kept.tolist()
        ids = self._tok(key[0], add_special_tokens=special_tokens).input_ids
        ids = ids[: max(0, len(ids) - TAIL_TOKENS)]
        with self._heads_lock:
            self._heads[key] = array("q", ids)
            if len(self._heads) > CACHED_HEADS:
                self._heads.popitem(last=False)
        return ids


def load_tokenizer(path: str | None, max_chars: int | None = None) -> PromptTokenizer | None:
    """The tokenizer of ``--tokenizer``, tokenizing at most a prompt's first ``max_chars``
    characters; None where none is given, or (with a warning) it cannot be loaded."""
    if path is None:
        return None
    try:
        tokenizer = EngineTokenizer(path, max_chars)
    except (ImportError, OSError, ValueError) as e:
        logger.warning("tokenizer %s cannot be loaded (%s): prefix keys from characters", path, e)
        return None
    logger.info("prefix keys from tokens: tokenizer %s, engine chat template", path)
    return tokenizer
