"""Chat messages as the API takes them, and their prompt tokens as the engine computes them: the
engine's server serves them, the router keys requests on them (its ``--tokenizer`` mode), and
both must get the same ids from the same messages.

``tokenizer`` is a Hugging Face tokenizer (anything with ``apply_chat_template``,
``chat_template`` and ``__call__``); nothing here imports transformers.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any, Literal

import jinja2
from pydantic import BaseModel, ConfigDict

from kvfleet.protocol.json_body import RequestRefused

logger = logging.getLogger(__name__)

# For checkpoints without a template of their own: ChatML, which most chat models were tuned on.
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    # Extra keys (tool_calls, refusal, ...) on echoed assistant messages are tolerated.
    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


def _template_kwargs_reserved(tokenizer: Any) -> frozenset[str]:
    """apply_chat_template's own arguments: a client may not set them through
    chat_template_kwargs (they would clash with ours or change what it returns)."""
    params = inspect.signature(tokenizer.apply_chat_template).parameters
    return frozenset(n for n, p in params.items() if p.kind is not p.VAR_KEYWORD)


def conversation_of(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template reads them."""
    conversation = []
    for m in messages:
        entry: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.name:
            entry["name"] = m.name
        conversation.append(entry)
    return conversation


def render_chat_text(
    tokenizer: Any,
    conversation: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    template_kwargs: dict[str, Any] | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """The conversation through the model's chat template (ChatML without one), with the
    request's tools for a template that reads them; a 400 :class:`RequestRefused` when the
    template refuses it."""
    kwargs = template_kwargs or {}
    clash = sorted(set(kwargs) & _template_kwargs_reserved(tokenizer))
    if clash:
        raise RequestRefused(400, f"chat_template_kwargs may not set {', '.join(clash)}",
                             param="chat_template_kwargs")  # fmt: skip
    try:
        return tokenizer.apply_chat_template(
            conversation,
            chat_template=tokenizer.chat_template or DEFAULT_CHAT_TEMPLATE,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            tools=tools,
            **kwargs,
        )
    except jinja2.TemplateError as e:
        # The template's own raise_exception(...) says what the messages break; any other
        # template error (an undefined name, a type clash inside the template) speaks of the
        # template's internals and is only logged.
        if type(e) is jinja2.TemplateError and e.message:
            raise RequestRefused(400, f"the chat template rejected the messages: {e.message}",
                                 param="messages") from None  # fmt: skip
        logger.info("chat template failed: %r", e)
    except Exception as e:  # a template is code: anything may come out of it
        logger.info("chat template failed: %r", e)
    raise RequestRefused(
        400,
        "the chat template could not render these messages (check roles, their order and the "
        "content types the model expects)",
        param="messages",
    )


def chat_text_ids(tokenizer: Any, text: str) -> list[int]:
    # The template writes the special tokens (BOS included) itself.
    return tokenizer(text, add_special_tokens=False).input_ids


def render_chat(
    tokenizer: Any,
    messages: list[ChatMessage],
    add_generation_prompt: bool = True,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """Token ids of the rendered conversation, as the engine's server computes them (it runs
    the same two steps, large inputs off its event loop)."""
    text = render_chat_text(
        tokenizer, conversation_of(messages), add_generation_prompt, template_kwargs
    )
    return chat_text_ids(tokenizer, text)
