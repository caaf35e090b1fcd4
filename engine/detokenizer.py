"""Incremental detokenization with stop strings.

Text is decoded over a short sliding window of tokens, so each new token costs the same whatever
the sequence length, and a token that ends mid-way through a UTF-8 character is held back until
the character is complete."""

from __future__ import annotations

from typing import Any

# Tokens decoded before the read offset, so that a tokenizer which drops leading spaces or merges
# across token boundaries renders the new tokens as they appear in context.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        stop: list[str],
        skip_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = stop
        # Text that could still turn out to start a stop string is not handed out yet.
        self._hold = max((len(s) for s in stop), default=1) - 1
        self.tokens = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)
        self.output_text = ""
        self._emitted = 0
        self.stopped_by: str | None = None

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add_token(self, token_id: int) -> str | None:
        """Feed one generated token. Returns the stop string that matched, if any; the text
        is then cut just before it."""
        self.tokens.append(token_id)
        prefix = self._decode(self.tokens[self.prefix_offset : self.read_offset])
        full = self._decode(self.tokens[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            new_text = full[len(prefix) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.tokens)
            # Keep the window short: drop tokens older than the prefix.
            if self.prefix_offset > _CONTEXT_TOKENS:
                drop = self.prefix_offset - _CONTEXT_TOKENS
                del self.tokens[:drop]
                self.prefix_offset -= drop
                self.read_offset -= drop
            return self._append(new_text)
        return None

    def _append(self, new_text: str) -> str | None:
        start = max(0, len(self.output_text) - self._hold)
        self.output_text += new_text
        for stop in self.stop:
            idx = self.output_text.find(stop, start)
            if idx != -1:
                self.output_text = self.output_text[:idx]
                self.stopped_by = stop
                return stop
        return None

    def take_delta(self, finished: bool) -> str:
        """New text since the last call, keeping back a possible stop-string prefix unless the
        request has finished."""
        end = (
            len(self.output_text)
            if finished or not self.stop
            else max(self._emitted, len(self.output_text) - self._hold)
        )
        delta = self.output_text[self._emitted : end]
        self._emitted = end
        return delta
