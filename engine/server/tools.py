"""Tool calling for chat completions: what a request's tools, tool_choice and tool messages mean
for its prompt, its sampling and the parsing of its output.

- The prompt: a chat template that reads ``tools`` gets them (and assistant ``tool_calls`` and
  ``tool`` messages) as Hugging Face templates expect. A template without tool support (plain
  ChatML, as SmolLM2's) gets them written into the system message in the format of the parser
  family, assistant calls written back in that format, and tool results as user messages, so the
  model is asked for exactly what the parser reads.
- ``tool_choice`` ``auto``: the output is parsed by the family's parser. ``required`` and a named
  function: a JSON schema (an array of 1+ calls, or that function's arguments) constrains the
  output by grammar, as vLLM does, and the JSON is read back into calls. ``none``: the tools are
  left out of the prompt and nothing is parsed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any

from aiohttp import web
from pydantic import ValidationError

from kvfleet.engine.outputs import CompletionOutput
from kvfleet.engine.sampling_params import SamplingParams, StructuredOutputsParams
from kvfleet.engine.schema_keywords import keyword_problem, rebase_refs
from kvfleet.engine.server.errors import bad_request
from kvfleet.engine.server.openai_requests import ChatCompletionRequest, ChatTool, NamedToolChoice
from kvfleet.engine.server.openai_responses import (
    AssistantMessage,
    ChatDelta,
    DeltaFunction,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from kvfleet.engine.server.tool_parsers import (
    HERMES,
    LLAMA3_JSON,
    MISTRAL,
    ToolCallDelta,
    ToolCallParser,
)
from kvfleet.engine.server.validation import JSON_LIMITS
from kvfleet.protocol.chat_template import ChatMessage, conversation_of
from kvfleet.protocol.json_body import RequestRefused, decode_json_text


@dataclass(frozen=True)
class ToolSettings:
    """The server's tool-calling settings (--tool-call-parser, --enable-auto-tool-choice)."""

    parser: str
    enable_auto_tool_choice: bool = True


TOOL_SETTINGS = web.AppKey("tool_settings", ToolSettings)


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools change: the tools its prompt shows (None: none), how its output
    is parsed (None: not at all) and the grammar that constrains it."""

    tools: list[dict[str, Any]] | None
    parse_mode: str | None = None
    function_name: str | None = None
    # The grammar of a forced call (required, or a named function).
    structured: StructuredOutputsParams | None = None
    # parallel_tool_calls false: calls past the first are dropped (with auto; the grammar of
    # required allows one only).
    single_call: bool = False
    # The server's parser family, whose ids the calls get (Mistral's differ), also when the
    # grammar of a forced call makes them.
    family: str | None = None
    # The ids of the conversation's calls and of this response's: a new call's id is none of
    # them (one plan per request, so the choices of a response share it).
    call_ids: set[str] = field(default_factory=set, compare=False, repr=False)
    # The conversation's calls by message index, each {id, name, arguments}, the arguments
    # parsed once (when checked) for the template.
    history: dict[int, list[dict[str, Any]]] = field(
        default_factory=dict, compare=False, repr=False
    )
    # Characters of JSON the prompt may render besides the messages' content: the history's
    # arguments and the tools (what decides whether rendering leaves the event loop).
    chars: int = field(default=0, compare=False, repr=False)

    def parser(self) -> ToolCallParser | None:
        if self.parse_mode is None:
            return None
        return ToolCallParser(self.parse_mode, self.function_name, self.family, self.call_ids)

    def sampling(self, params: SamplingParams) -> SamplingParams:
        """params with the grammar of required / a named function; a Mistral model's
        [TOOL_CALLS] is a special token the parser must see."""
        update: dict[str, Any] = {}
        if self.structured is not None:
            update["structured_outputs"] = self.structured
        elif self.parse_mode == MISTRAL:
            update["skip_special_tokens"] = False
        return params.model_copy(update=update) if update else params


def plan_prompt(tools: list[ChatTool], messages: list[ChatMessage]) -> ToolPlan:
    """Check tools and tool messages (400s naming the parameter) and plan the prompt alone: the
    tools shown as every tool_choice but none shows them (what /tokenize counts)."""
    history = check_tool_messages(messages)
    made = {c["id"] for calls in history.values() for c in calls}
    chars = sum(
        len(c["function"]["arguments"])
        for m in messages
        for c in (m.model_extra or {}).get("tool_calls") or ()
    )
    if not tools:
        return ToolPlan(None, call_ids=made, history=history, chars=chars)
    names = [t.function.name for t in tools]
    for i, tool in enumerate(tools):
        if names.index(tool.function.name) != i:
            raise bad_request(
                f"tools[{i}]: the function name {tool.function.name!r} is used twice",
                param=f"tools.{i}.function.name",
            )
        _check_parameters(tool, i)
    shown = [t.model_dump(exclude_none=True) for t in tools]
    chars += len(json.dumps(shown))
    return ToolPlan(shown, call_ids=made, history=history, chars=chars)


def plan_tools(req: ChatCompletionRequest, settings: ToolSettings) -> ToolPlan:
    """Check the request's tools, tool_choice and tool messages (400s naming the parameter)
    and plan them."""
    tools = req.tools or []
    plan = plan_prompt(tools, req.messages)
    choice = req.tool_choice
    if not tools:
        if choice not in (None, "none"):
            raise bad_request("tool_choice needs tools", param="tool_choice")
        return plan
    if choice == "none":
        return replace(plan, tools=None)
    if choice in (None, "auto"):
        if not settings.enable_auto_tool_choice:
            raise bad_request(
                'tool_choice "auto" is off on this server (started with '
                "--no-enable-auto-tool-choice): use required, a named function or none",
                param="tool_choice",
            )
        return replace(plan, parse_mode=settings.parser, family=settings.parser,
                       single_call=not req.parallel_tool_calls)  # fmt: skip
    if _structured(req):
        raise bad_request(
            "response_format (or structured_outputs) and a tool_choice that forces a call "
            "cannot both constrain the output",
            param="tool_choice",
        )
    names = [t.function.name for t in tools]
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if name not in names:
            raise bad_request(
                f"tool_choice names the function {name!r}, which is not among the tools "
                f"({', '.join(names)})",
                param="tool_choice",
            )
        i = names.index(name)
        _check_keywords(tools[i], i)
        schema = _arguments_schema(tools[i])
        return replace(plan, parse_mode="named", function_name=name, structured=_forced(schema),
                       family=settings.parser)  # fmt: skip
    for i, tool in enumerate(tools):
        _check_keywords(tool, i)
    schema = required_schema(tools, req.parallel_tool_calls)
    return replace(plan, parse_mode="array", structured=_forced(schema), family=settings.parser)


def _forced(schema: dict[str, Any]) -> StructuredOutputsParams:
    """The structured-outputs constraint of a forced call; a 400 on the tools when the schema
    is beyond what structured outputs take (their size bound)."""
    try:
        return StructuredOutputsParams(json=schema)
    except ValidationError as e:
        reason = e.errors()[0]["msg"].removeprefix("Value error, ")
        raise bad_request(
            f"the tools' parameters cannot constrain a forced call: {reason}", param="tool_choice"
        ) from None


def _structured(req: ChatCompletionRequest) -> bool:
    return req.constraint[0] is not None


def _check_parameters(tool: ChatTool, i: int) -> None:
    params = tool.function.parameters
    if params is None:
        return
    kind = params.get("type")
    if kind is not None and kind != "object":
        raise bad_request(
            f"tools[{i}].function.parameters must be a JSON schema of an object (type "
            f'"object"), not of {json.dumps(kind)}',
            param=f"tools.{i}.function.parameters",
        )
    props = params.get("properties", {})
    if not isinstance(props, dict) or not all(isinstance(p, dict | bool) for p in props.values()):
        raise bad_request(
            f"tools[{i}].function.parameters.properties must map names to JSON schemas",
            param=f"tools.{i}.function.parameters",
        )


def _check_keywords(tool: ChatTool, i: int) -> None:
    """A forced call's grammar follows the tool's parameters: each keyword must be one the
    grammar follows, with a value JSON Schema allows (kvfleet.engine.schema_keywords)."""
    problem = keyword_problem(_arguments_schema(tool))
    if problem is not None:
        raise bad_request(
            f"tools[{i}].function.parameters: {problem}", param=f"tools.{i}.function.parameters"
        )


def _arguments_schema(tool: ChatTool) -> dict[str, Any]:
    return tool.function.parameters or {"type": "object"}


def required_schema(tools: list[ChatTool], parallel: bool) -> dict[str, Any]:
    """tool_choice required as a JSON schema: an array of at least one call (at most one
    without parallel_tool_calls), each the name of one tool with arguments of its schema.
    Each tool's parameters are a definition of their own, named by the tool, their references
    rebased onto it: a tool's "#/$defs/city" (or "#") means its own, as when it is called by
    name, never the wrapper's or another tool's."""
    defs = {
        t.function.name: rebase_refs(_arguments_schema(t), f"#/$defs/{t.function.name}")
        for t in tools
    }
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [t.function.name]},
                "arguments": {"$ref": f"#/$defs/{t.function.name}"},
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": {"anyOf": calls},
        "$defs": defs,
    }
    if not parallel:
        schema["maxItems"] = 1
    return schema


def check_tool_messages(messages: list[ChatMessage]) -> dict[int, list[dict[str, Any]]]:
    """Assistant tool_calls are well formed; each tool message answers a call made before it.
    Returns the calls made, by message index, each {id, name, arguments (parsed)}."""
    history: dict[int, list[dict[str, Any]]] = {}
    made: set[str] = set()
    for i, m in enumerate(messages):
        extra = m.model_extra or {}
        calls = extra.get("tool_calls")
        if calls is not None:
            if m.role != "assistant":
                raise bad_request(f"messages[{i}]: only assistant messages carry tool_calls",
                                  param=f"messages.{i}.tool_calls")  # fmt: skip
            history[i] = _tool_calls(calls, i)
            made.update(c["id"] for c in history[i])
        if m.role != "tool":
            continue
        call_id = extra.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise bad_request(f"messages[{i}]: a tool message needs its tool_call_id",
                              param=f"messages.{i}.tool_call_id")  # fmt: skip
        if call_id not in made:
            raise bad_request(
                f"messages[{i}]: tool_call_id {call_id!r} answers no tool call of an earlier "
                "assistant message",
                param=f"messages.{i}.tool_call_id",
            )
    return history


def _tool_calls(calls: Any, i: int) -> list[dict[str, Any]]:
    """An assistant message's tool_calls checked, each as {id, name, arguments (parsed under
    the request body's bounds: a client's text, nested and sized as a body may be)}."""
    param = f"messages.{i}.tool_calls"
    if not isinstance(calls, list):
        raise bad_request(f"messages[{i}].tool_calls must be a list", param=param)
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
            raise bad_request(
                f"messages[{i}].tool_calls[{j}] must be {{id, type: function, function: "
                "{name, arguments (a JSON string)}}",
                param=f"{param}.{j}",
            )
        what = f"messages[{i}].tool_calls[{j}].function.arguments"
        try:
            arguments = decode_json_text(fn["arguments"], JSON_LIMITS, what)
        except RequestRefused as e:
            raise bad_request(e.message, param=f"{param}.{j}.function.arguments") from None
        parsed.append({"id": call["id"], "name": fn["name"], "arguments": arguments})
    return parsed


def template_reads_tools(template: str | None) -> bool:
    return template is not None and "tools" in template


def conversation_with_tools(
    messages: list[ChatMessage], plan: ToolPlan, native: bool, family: str
) -> list[dict[str, Any]]:
    """The messages as the chat template reads them. native: the template reads tools,
    tool_calls and tool messages itself; otherwise they are written as text (see the module)."""
    conversation = conversation_of(messages)
    names: dict[str, str] = {}
    for i, (m, entry) in enumerate(zip(messages, conversation, strict=True)):
        extra = m.model_extra or {}
        calls = plan.history.get(i, [])
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
    if not native and plan.tools:
        instructions = tools_instructions(plan.tools, family)
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


def _finish_reason(finish: str | None, called: bool) -> str | None:
    return "tool_calls" if called and finish == "stop" else finish


def choice_message(
    plan: ToolPlan, text: str, finish_reason: str | None
) -> tuple[AssistantMessage, str | None]:
    """A whole choice's message and finish reason, its tool calls parsed out of its text."""
    message = AssistantMessage(content=text)
    parser = plan.parser()
    if parser is None:
        return message, finish_reason
    result = parser.parse(text, truncated=finish_reason == "length")
    if not result.calls:
        return message, finish_reason
    calls = result.calls[:1] if plan.single_call else result.calls
    message = AssistantMessage(
        content=result.content or None,
        tool_calls=[
            ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments))
            for c in calls
        ],
    )
    return message, _finish_reason(finish_reason, True)


class StreamedChoices:
    """The deltas of a streamed response's choices, tool calls parsed out of each choice's
    text as it comes (one parser per choice)."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.parsers: dict[int, ToolCallParser] = {}

    def delta(self, choice: CompletionOutput) -> tuple[ChatDelta, str | None]:
        finish = choice.finish_reason
        parser = self.parsers.get(choice.index)
        if parser is None:
            parser = self.plan.parser()
            if parser is None:
                return ChatDelta(content=choice.text or None), finish
            self.parsers[choice.index] = parser
        content, calls = parser.feed(choice.text)
        if finish is not None:
            content += parser.finish()
        if self.plan.single_call:
            calls = [call for call in calls if call.index == 0]
        delta = ChatDelta(
            content=content or None, tool_calls=[_delta_call(call) for call in calls] or None
        )
        return delta, _finish_reason(finish, parser.called)


def _delta_call(call: ToolCallDelta) -> DeltaToolCall:
    """A piece of a call as OpenAI streams it: id, type and name with the first."""
    if call.id is None:
        return DeltaToolCall(index=call.index, function=DeltaFunction(arguments=call.arguments))
    return DeltaToolCall(
        index=call.index,
        id=call.id,
        type="function",
        function=DeltaFunction(name=call.name, arguments=call.arguments),
    )
