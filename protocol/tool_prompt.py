"""Tools in the prompt: how a chat request's tools, its assistant messages' ``tool_calls`` and its
``tool`` messages are written into the conversation a chat template renders. The engine renders
its prompts with it, the router its prompts' tokens (precise prefix scoring), and both must get
the same ids from the same request.

- A chat template that reads ``tools`` gets them (and assistant ``tool_calls``, arguments parsed,
  and ``tool`` messages' ``tool_call_id``) as Hugging Face templates expect.
- A template without tool support (plain ChatML, as SmolLM2's) gets them written into the system
  message in the format of the server's tool-call parser family, assistant calls written back in
  that format, and tool results as user messages, so that the model is asked for exactly what
  the parser reads.

Which tools a request's prompt shows (none for ``tool_choice`` ``none``), the checks on the tools
themselves and everything about the output (forced calls, parsing) are the engine's
(kvfleet.engine.server.tools). Nothing here imports transformers or aiohttp; a message this
cannot render is a :class:`RequestRefused` (400) naming its parameter.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvfleet.protocol.chat_template import ChatMessage, conversation_of
from kvfleet.protocol.json_body import JsonLimits, RequestRefused, decode_json_text

# The tool-call parser families (vLLM's --tool-call-parser names): how a model writes its calls.
HERMES = "hermes"
LLAMA3_JSON = "llama3_json"
MISTRAL = "mistral"
TOOL_CALL_PARSERS = (HERMES, LLAMA3_JSON, MISTRAL)


def parser_for_template(template: str | None) -> str:
    """The family a chat template's special tokens point to; ChatML (and no template) is Hermes,
    as Qwen's and Hermes' templates are ChatML with ``<tool_call>`` tags."""
    text = template or ""
    if "<|python_tag|>" in text or "<|start_header_id|>" in text:
        return LLAMA3_JSON
    if "[TOOL_CALLS]" in text or "[INST]" in text:
        return MISTRAL
    return HERMES


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class FunctionDefinition(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    # A JSON schema of the arguments, an object; checked further in kvfleet.engine.server.tools.
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


def responses_tool_as_chat(tool: Mapping[str, Any]) -> dict[str, Any]:
    """A Responses request's function tool (``{type, name, description, parameters, strict}``)
    as the chat request's tool it stands for (``{type, function: {...}}``), in JSON."""
    return {"type": tool.get("type"), "function": {k: v for k, v in tool.items() if k != "type"}}


@dataclass(frozen=True)
class ToolPrompt:
    """What a request's tools and tool messages put into its prompt: the tools it shows (None:
    none), and the calls of its assistant messages by message index, each {id, name,
    arguments}, the arguments parsed once (when checked) for the template."""

    tools: list[dict[str, Any]] | None
    history: dict[int, list[dict[str, Any]]] = field(
        default_factory=dict, compare=False, repr=False
    )
    # Characters of JSON the prompt may render besides the messages' content: the history's
    # arguments and the tools (what decides whether rendering leaves the engine's event loop).
    chars: int = field(default=0, compare=False, repr=False)

    def call_ids(self) -> set[str]:
        return {c["id"] for calls in self.history.values() for c in calls}


def tool_prompt(
    tools: list[ChatTool] | None, messages: list[ChatMessage], limits: JsonLimits
) -> ToolPrompt:
    """The prompt's part of a request's tools (``tools``: those it shows) and tool messages,
    the messages checked as :func:`check_tool_messages` does; arguments parsed under
    ``limits``."""
    history = check_tool_messages(messages, limits)
    chars = sum(
        len(c["function"]["arguments"])
        for m in messages
        for c in (m.model_extra or {}).get("tool_calls") or ()
    )
    if not tools:
        return ToolPrompt(None, history, chars)
    shown = [t.model_dump(exclude_none=True) for t in tools]
    return ToolPrompt(shown, history, chars + len(json.dumps(shown)))


def check_tool_messages(
    messages: list[ChatMessage], limits: JsonLimits
) -> dict[int, list[dict[str, Any]]]:
    """Assistant tool_calls are well formed; each tool message answers a call made before it.
    Returns the calls made, by message index, each {id, name, arguments (parsed)}."""
    history: dict[int, list[dict[str, Any]]] = {}
    made: set[str] = set()
    for i, m in enumerate(messages):
        extra = m.model_extra or {}
        calls = extra.get("tool_calls")
        if calls is not None:
            if m.role != "assistant":
                raise RequestRefused(400, f"messages[{i}]: only assistant messages carry "
                                     "tool_calls", param=f"messages.{i}.tool_calls")  # fmt: skip
            history[i] = _tool_calls(calls, i, limits)
            made.update(c["id"] for c in history[i])
        if m.role != "tool":
            continue
        call_id = extra.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise RequestRefused(400, f"messages[{i}]: a tool message needs its tool_call_id",
                                 param=f"messages.{i}.tool_call_id")  # fmt: skip
        if call_id not in made:
            raise RequestRefused(
                400,
                f"messages[{i}]: tool_call_id {call_id!r} answers no tool call of an earlier "
                "assistant message",
                param=f"messages.{i}.tool_call_id",
            )
    return history


def _tool_calls(calls: Any, i: int, limits: JsonLimits) -> list[dict[str, Any]]:
    """An assistant message's tool_calls checked, each as {id, name, arguments (parsed under
    the request body's bounds: a client's text, nested and sized as a body may be)}."""
    param = f"messages.{i}.tool_calls"
    if not isinstance(calls, list):
        raise RequestRefused(400, f"messages[{i}].tool_calls must be a list", param=param)
    parsed = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not (
            isinstance(fn, dict)
            and isinstance(call.get("id"), str)
            and call.get("type", "function") == "function"
            and isinstance(fn.get("name"), str)
            and isinstance(fn.get("arguments"), str)
        ):
            raise RequestRefused(
                400,
                f"messages[{i}].tool_calls[{j}] must be {{id, type: function, function: "
                "{name, arguments (a JSON string)}}",
                param=f"{param}.{j}",
            )
        what = f"messages[{i}].tool_calls[{j}].function.arguments"
        try:
            arguments = decode_json_text(fn["arguments"], limits, what)
        except RequestRefused as e:
            raise RequestRefused(
                e.status, e.message, e.code, param=f"{param}.{j}.function.arguments"
            ) from None
        parsed.append({"id": call["id"], "name": fn["name"], "arguments": arguments})
    return parsed


def template_reads_tools(template: str | None) -> bool:
    return template is not None and "tools" in template


def chat_inputs(
    messages: list[ChatMessage], prompt: ToolPrompt, native: bool, family: str
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """What the chat template renders: the conversation and its ``tools`` argument. native:
    the template reads tools (template_reads_tools); family: the server's parser family."""
    conversation = conversation_with_tools(messages, prompt, native, family)
    return conversation, prompt.tools if native else None


def conversation_with_tools(
    messages: list[ChatMessage], prompt: ToolPrompt, native: bool, family: str
) -> list[dict[str, Any]]:
    """The messages as the chat template reads them. native: the template reads tools,
    tool_calls and tool messages itself; otherwise they are written as text (see the module)."""
    conversation = conversation_of(messages)
    names: dict[str, str] = {}
    for i, (m, entry) in enumerate(zip(messages, conversation, strict=True)):
        extra = m.model_extra or {}
        calls = prompt.history.get(i, [])
        names.update((c["id"], c["name"]) for c in calls)
        if native:
            if calls:
                entry["tool_calls"] = [
                    {"id": _template_id(c["id"], family), "type": "function",
                     "function": {"name": c["name"], "arguments": c["arguments"]}}
                    for c in calls
                ]  # fmt: skip
            if m.role == "tool":
                entry["tool_call_id"] = _template_id(extra["tool_call_id"], family)
            continue
        if calls:
            text = render_calls(family, calls)
            entry["content"] = f"{entry['content']}\n{text}" if entry["content"] else text
        if m.role == "tool":
            call_id = extra["tool_call_id"]
            entry["role"] = "user"
            entry["content"] = (
                f"Result of {names.get(call_id, 'the function')} (call {call_id}):\n"
                f"{entry['content']}"
            )
            entry.pop("name", None)
    if not native and prompt.tools:
        instructions = tools_instructions(prompt.tools, family)
        if conversation[0]["role"] in ("system", "developer"):
            conversation[0]["content"] = f"{conversation[0]['content']}\n\n{instructions}"
        else:
            conversation.insert(0, {"role": "system", "content": instructions})
    return conversation


def _template_id(call_id: str, family: str) -> str:
    """A call's id as the family's template takes it. Mistral's templates take exactly 9
    letters and digits, and clients send back ids made elsewhere (OpenAI's `call_` + 24): their
    last 9 characters, as vLLM shortens them, keep each call paired with its result."""
    return call_id[-9:] if family == MISTRAL else call_id


def render_calls(family: str, calls: list[dict[str, Any]]) -> str:
    """Calls written as the family's models write them (and its parser reads them)."""
    if family == LLAMA3_JSON:
        return "; ".join(
            json.dumps({"name": c["name"], "parameters": c["arguments"]}) for c in calls
        )
    items = [{"name": c["name"], "arguments": c["arguments"]} for c in calls]
    if family == MISTRAL:
        return "[TOOL_CALLS]" + json.dumps(items)
    assert family == HERMES
    return "\n".join(f"<tool_call>\n{json.dumps(item)}\n</tool_call>" for item in items)


def tools_instructions(tools: list[dict[str, Any]], family: str) -> str:
    """The tools as a system message tells a model whose template knows none."""
    listing = "\n".join(json.dumps(t["function"]) for t in tools)
    example = render_calls(family, [{"name": "<function name>", "arguments": {"<arg>": "<value>"}}])
    return (
        "You have access to the following functions, each given as a JSON object with its name, "
        "what it does and the JSON schema of its arguments:\n"
        f"{listing}\n\n"
        "To call one or more of them, reply with only this, once per call:\n"
        f"{example}\n"
        "Otherwise, answer normally."
    )
