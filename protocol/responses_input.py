"""The input of an OpenAI Responses request (``/v1/responses``) as the chat messages it stands
for: the engine renders them with the chat path (template, tools, tool messages), the router keys
on them as on a chat request's messages, and both must read the same conversation out of the
same items.

An input is a string (one user message) or a list of items: messages (role user, system,
developer or assistant; content a string or text parts), ``function_call`` items (an earlier
turn's calls, which become the assistant message's ``tool_calls``) and ``function_call_output``
items (their results, which become ``tool`` messages). Anything else a Responses client may send
(images, files, audio, built-in tools' calls, reasoning items, references to stored items) is
refused by name: kvfleet serves text and keeps no state.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, TypeAdapter

# Bounds on what one input may hold, past the body's size and JSON bounds: each item and part
# is Python work to validate and translate before the context check can refuse the text.
MAX_INPUT_ITEMS = 2048
MAX_CONTENT_PARTS = 256

_MESSAGE_ROLES = ("user", "system", "developer", "assistant")
_ITEM_TYPES = ("message", "function_call", "function_call_output")
_PART_TYPES = ("input_text", "output_text")


class _Item(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TextPart(_Item):
    """input_text, or output_text of an earlier response sent back (its annotations and
    logprobs are the earlier response's, and are not read)."""

    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


def _check_parts(parts: Any, where: str) -> None:
    """Refuse a part that is not text by its type, rather than with pydantic's list of every
    alternative it tried."""
    if not isinstance(parts, list):
        return
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _PART_TYPES:
            raise ValueError(
                f"{where}, part {j} has type {kind!r}, which this server does not take: it serves "
                f"text models (supported: {', '.join(_PART_TYPES)})"
            )


Content = Annotated[list[TextPart], Field(max_length=MAX_CONTENT_PARTS)]


class MessageItem(_Item):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | Content
    # An earlier response's output message sent back carries its id and status.
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionCallItem(_Item):
    """A call the model made in an earlier turn."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    arguments: str  # JSON text, checked as a chat message's tool call's
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(_Item):
    """The result of a call, for the model to read."""

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | Content
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        if isinstance(self.output, str):
            return self.output
        return "".join(part.text for part in self.output)


def _item_type(value: Any) -> str | None:
    if isinstance(value, BaseModel):
        return getattr(value, "type", None)
    if isinstance(value, dict):
        return value.get("type", "message")
    return None


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")],
    Discriminator(_item_type),
]


def check_item_types(value: Any) -> Any:
    """Refuse an item this server does not take by its type (a before-validator of ``input``):
    a Responses client may send any of OpenAI's item types, and each deserves its own answer."""
    if not isinstance(value, list):
        return value
    if len(value) > MAX_INPUT_ITEMS:
        raise ValueError(f"at most {MAX_INPUT_ITEMS} input items are allowed, got {len(value)}")
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise ValueError(f"item {i} must be an object")
        kind = item.get("type", "message")
        if kind == "item_reference":
            raise ValueError(
                f"item {i} is an item_reference: this server stores no items (each request "
                "carries its whole conversation)"
            )
        if kind not in _ITEM_TYPES:
            raise ValueError(
                f"item {i} has type {kind!r}, which this server does not take (supported: "
                f"{', '.join(_ITEM_TYPES)})"
            )
        role = item.get("role")
        if kind == "message" and role not in _MESSAGE_ROLES:
            raise ValueError(
                f"item {i} has role {role!r}; a message's role is one of "
                f"{', '.join(_MESSAGE_ROLES)} (a tool's result is a function_call_output item)"
            )
        _check_parts(item.get("content" if kind == "message" else "output"), f"item {i}")
    return value


def _input_shape(value: Any) -> str:
    return "text" if isinstance(value, str) else "items"


# The shape picks the one schema to validate against, so that an error names the item's field
# rather than also saying the input is not a string.
Input = Annotated[
    Annotated[str, Tag("text")] | Annotated[list[InputItem], Field(min_length=1), Tag("items")],
    Discriminator(_input_shape),
]

_INPUT = TypeAdapter(Input)


def parse_input(value: Any) -> Input:
    """A JSON value as an input (for a body read without the request's schema: the router's)."""
    return _INPUT.validate_python(check_item_types(value), strict=True)


def chat_messages(items: Input, instructions: str | None) -> list[dict[str, Any]]:
    """The chat messages (as a chat request's JSON has them) that an input stands for:
    instructions first as a system message, as OpenAI places them; each function_call joined
    to the assistant message just before it (or to a new one), as a chat assistant message
    carries its text and its calls together; each function_call_output a tool message
    answering its call_id."""
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    if isinstance(items, str):
        messages.append({"role": "user", "content": items})
        return messages
    calls_open = False  # the last message is an assistant's that may take more calls
    for item in items:
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": item.text()})
            calls_open = item.role == "assistant"
        elif isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            if not calls_open:
                messages.append({"role": "assistant", "content": None})
                calls_open = True
            messages[-1].setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "tool", "content": item.text(), "tool_call_id": item.call_id})
            calls_open = False
    return messages
