"""The routing key of a request: which conversation, user or prompt prefix it belongs to.

Pure: the tokenizer comes in as an object (see :class:`PromptTokenizer`), loading it is the
router's business. Keys of different kinds live in different namespaces (``session:``, ``user:``,
``prefix:``) so that a session id can never collide with a prefix hash.

The prefix key follows the engine's prefix cache: the engine hashes whole 16-token blocks of the
prompt as it tokenizes it (chat template applied), so two prompts share cached KV exactly when
they share leading blocks. Hashing the first ``prefix_length`` tokens rounded down to whole blocks
makes "same key" imply "same cached blocks". Without a tokenizer the key is a character prefix,
a cruder stand-in (about 4 characters a token).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from kvfleet.protocol.block_hash import BLOCK_SIZE
from kvfleet.protocol.responses_input import chat_messages, parse_input
from kvfleet.protocol.tool_prompt import responses_tool_as_chat

CHARS_PER_TOKEN = 4

Reason = Literal["session", "user", "prefix", "least_loaded"]
REASONS: tuple[Reason, ...] = ("session", "user", "prefix", "least_loaded")


@dataclass(frozen=True)
class KeyPolicy:
    session_header: str = "x-session-id"
    use_user_field: bool = True
    prefix_affinity: bool = True
    prefix_length: int = 256


@dataclass(frozen=True)
class RoutingKey:
    reason: Reason
    key: str | None


LEAST_LOADED = RoutingKey("least_loaded", None)

# Paths routed least-loaded whatever their headers and body say: an embedding request is one
# prefill of its inputs, nothing follows it that a warm engine would serve better, and a
# client's batch of them is best spread by load. (Session, user and prefix keys would pile one
# client's bulk embedding job onto one engine.)
LEAST_LOADED_PATHS = frozenset({"/v1/embeddings"})


class PromptTokenizer(Protocol):
    """The prompt tokens exactly as the engine computes them. chat's tools: the chat tools
    (JSON) the prompt shows, None for none."""

    def chat(
        self,
        messages: list[Any],
        add_generation_prompt: bool,
        template_kwargs: dict[str, Any] | None,
        tools: list[Any] | None = None,
    ) -> list[int]: ...

    def text(self, prompt: str) -> list[int]: ...


def token_prefix_key(tokens: Sequence[int], prefix_length: int) -> str | None:
    """Hash of the first ``prefix_length`` tokens rounded down to whole blocks; None when not
    even one block is there (nothing the engine could reuse)."""
    n = min(len(tokens), prefix_length) // BLOCK_SIZE * BLOCK_SIZE
    if n == 0:
        return None
    digest = hashlib.blake2b(array("q", tokens[:n]).tobytes(), digest_size=16).hexdigest()
    return f"prefix:{digest}"


def char_prefix_key(text: str, prefix_length: int) -> str | None:
    """The character stand-in for :func:`token_prefix_key`: blocks of 64 characters."""
    block = BLOCK_SIZE * CHARS_PER_TOKEN
    n = min(len(text), prefix_length * CHARS_PER_TOKEN) // block * block
    if n == 0:
        return None
    digest = hashlib.blake2b(text[:n].encode(), digest_size=16).hexdigest()
    return f"prefix:{digest}"


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)
        )
    return ""


def chat_characters(messages: list[Any]) -> str:
    """Messages flattened in order, role before content: a template-free stand-in for the
    rendered conversation that shares a prefix exactly when the conversations do."""
    parts = []
    for m in messages:
        if isinstance(m, dict):
            parts.append(f"{m.get('role', '')}\n{_content_text(m.get('content'))}\n")
    return "".join(parts)


def _first_prompt(prompt: Any) -> str | list[int] | None:
    """The prompt whose prefix decides routing; a batch goes where its first prompt goes."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        head = prompt[0]
        if isinstance(head, int):
            return prompt
        if isinstance(head, str | list):
            return _first_prompt(head)
    return None


def _messages(body: Mapping[str, Any]) -> list[Any] | None:
    """A chat request's messages; a Responses request's input as the chat messages it stands
    for."""
    messages = body.get("messages")
    if "input" in body:
        instructions = body.get("instructions")
        items = parse_input(body["input"])
        messages = chat_messages(items, instructions if isinstance(instructions, str) else None)
    return messages if isinstance(messages, list) and messages else None


def _shown_tools(body: Mapping[str, Any]) -> list[Any] | None:
    """The tools a chat (or Responses) request's prompt shows, as chat tools: every tool_choice
    but none shows them, as the engine renders them; a Responses request's function tools as
    the chat tools they stand for."""
    tools = body.get("tools")
    if not isinstance(tools, list) or not tools or body.get("tool_choice") == "none":
        return None
    if "input" in body:
        return [responses_tool_as_chat(t) if isinstance(t, dict) else t for t in tools]
    return tools


def prompt_tokens(body: Mapping[str, Any], tokenizer: PromptTokenizer) -> list[int] | None:
    """The prompt's tokens as the engine computes them (chat template, tools and tool messages
    applied); a batch's first prompt's; None for a body without a prompt. Raises what the
    template or tokenizer raise, and on what the engine refuses to render."""
    if (messages := _messages(body)) is not None:
        return tokenizer.chat(
            messages,
            bool(body.get("add_generation_prompt", True)),
            body.get("chat_template_kwargs"),
            _shown_tools(body),
        )
    prompt = _first_prompt(body.get("prompt"))
    if isinstance(prompt, list):
        return prompt
    if isinstance(prompt, str):
        return tokenizer.text(prompt)
    return None


def _prefix_key(
    body: Mapping[str, Any],
    prefix_length: int,
    tokenizer: PromptTokenizer | None,
    tokens: Sequence[int] | None,
) -> str | None:
    if tokenizer is not None:
        if tokens is None:
            tokens = prompt_tokens(body, tokenizer)
        return token_prefix_key(tokens, prefix_length) if tokens else None
    if (messages := _messages(body)) is not None:
        return char_prefix_key(chat_characters(messages), prefix_length)
    prompt = _first_prompt(body.get("prompt"))
    if isinstance(prompt, list):
        # Token ids are what the engine caches, with or without a tokenizer here.
        return token_prefix_key(prompt, prefix_length)
    if isinstance(prompt, str):
        return char_prefix_key(prompt, prefix_length)
    return None


def routing_key(
    headers: Mapping[str, str],
    body: Any,
    policy: KeyPolicy,
    tokenizer: PromptTokenizer | None = None,
    tokens: Sequence[int] | None = None,
) -> RoutingKey:
    """The key of a request, in order: session header, ``user`` field, prompt prefix; else
    none (least-loaded). ``body`` is the parsed JSON body (None without one); ``headers`` must
    look names up case-insensitively (aiohttp's do). ``tokens``: the prompt's tokens when the
    caller has them from ``tokenizer`` already (prompt_tokens)."""
    session = headers.get(policy.session_header)
    if session:
        return RoutingKey("session", f"session:{session}")
    if not isinstance(body, dict) or not (policy.use_user_field or policy.prefix_affinity):
        return LEAST_LOADED  # not an object: the engine answers with the proper 400
    user = body.get("user")
    if policy.use_user_field and isinstance(user, str) and user:
        return RoutingKey("user", f"user:{user}")
    if not policy.prefix_affinity:
        return LEAST_LOADED
    try:
        key = _prefix_key(body, policy.prefix_length, tokenizer, tokens)
    except Exception:
        # A request the template or tokenizer rejects is one the engine rejects too, with a
        # proper error; any engine can say so.
        return LEAST_LOADED
    return RoutingKey("prefix", key) if key else LEAST_LOADED
