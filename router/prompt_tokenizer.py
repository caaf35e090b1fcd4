"""Prompt tokens for token prefix keys and precise prefix scoring, computed by the chat rendering
the engine uses (kvfleet.protocol.chat_template, with the request's tools, tool calls and tool
messages written in as kvfleet.protocol.tool_prompt writes them) from a local HF tokenizer
directory (``--tokenizer``, or the engines' own tokenizer written into one: fetched_tokenizer.py);
without one the router keys on characters.

The tools of a template that does not read them are written in the format of the engines'
tool-call parser family: the one the engines' tokenizer bundle names, else ``--tool-call-parser``,
else the one the template points to (as an engine started without ``--tool-call-parser`` picks).

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
from kvfleet.protocol.chat_template import DEFAULT_CHAT_TEMPLATE, ChatMessage, render_chat_text
from kvfleet.protocol.json_body import JsonLimits
from kvfleet.protocol.tool_prompt import (
    ChatTool,
    chat_inputs,
    parser_for_template,
    template_reads_tools,
    tool_prompt,
)
from kvfleet.router.routing_key import PromptTokenizer

logger = logging.getLogger(__name__)

TAIL_TOKENS = BLOCK_SIZE
# About 8 KiB of text and 8 KiB of ids each at the default cut: under 20 MiB in all.
CACHED_HEADS = 1024
# The bounds the arguments of a conversation's tool calls (JSON in a string) are parsed under:
# a body's (a deeper text is one the engine refuses, wherever it is routed).
ARGUMENT_LIMITS = JsonLimits()


class EngineTokenizer:
    """Prompt tokens computed by the engine's code (chat template and tools included), from a
    local HF tokenizer directory; tool_call_parser: the engines' parser family (None: the one
    the template points to)."""

    def __init__(
        self, path: str, max_chars: int | None = None, tool_call_parser: str | None = None
    ) -> None:
        # Imported here: only a router that tokenizes loads transformers (the operator, which
        # runs from the same image, never does).
        from transformers import AutoTokenizer

        self._tok = AutoTokenizer.from_pretrained(path)
        template = self._tok.chat_template
        self.tool_call_parser = tool_call_parser or parser_for_template(template)
        self._native = template_reads_tools(template or DEFAULT_CHAT_TEMPLATE)
        self.max_chars = max_chars
        self._heads: OrderedDict[tuple[str, bool], array[int]] = OrderedDict()
        self._heads_lock = threading.Lock()  # requests are tokenized in worker threads

    def chat(
        self,
        messages: list[Any],
        add_generation_prompt: bool,
        template_kwargs: dict[str, Any] | None,
        tools: list[Any] | None = None,
    ) -> list[int]:
        parsed = [ChatMessage.model_validate(m) for m in messages]
        chat_tools = [ChatTool.model_validate(t) for t in tools or ()]
        prompt = tool_prompt(chat_tools, parsed, ARGUMENT_LIMITS)
        conversation, template_tools = chat_inputs(
            parsed, prompt, self._native, self.tool_call_parser
        )
        text = render_chat_text(
            self._tok, conversation, add_generation_prompt, template_kwargs, template_tools
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


def load_tokenizer(
    path: str | None, max_chars: int | None = None, tool_call_parser: str | None = None
) -> PromptTokenizer | None:
    """The tokenizer of ``--tokenizer``, tokenizing at most a prompt's first ``max_chars``
    characters; None where none is given, or (with a warning) it cannot be loaded."""
    if path is None:
        return None
    try:
        tokenizer = EngineTokenizer(path, max_chars, tool_call_parser)
    except (ImportError, OSError, ValueError) as e:
        logger.warning("tokenizer %s cannot be loaded (%s): prefix keys from characters", path, e)
        return None
    logger.info("prefix keys from tokens: tokenizer %s, engine chat template", path)
    return tokenizer
