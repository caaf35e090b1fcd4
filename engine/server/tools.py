"""Tool calling for chat completions: what a request's tools, tool_choice and tool messages mean
for its prompt, its sampling and the parsing of its output.

- The prompt: the tools it shows (every tool_choice but ``none`` shows them), checked here, and
  written into the conversation by kvfleet.protocol.tool_prompt (which the router renders its
  prompts' tokens with too).
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
from kvfleet.engine.server.openai_requests import ChatCompletionRequest, NamedToolChoice
from kvfleet.engine.server.openai_responses import (
    AssistantMessage,
    ChatDelta,
    DeltaFunction,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from kvfleet.engine.server.tool_parsers import MISTRAL, ToolCallDelta, ToolCallParser
from kvfleet.engine.server.validation import JSON_LIMITS, refused
from kvfleet.protocol.chat_template import ChatMessage
from kvfleet.protocol.json_body import RequestRefused
from kvfleet.protocol.tool_prompt import ChatTool, ToolPrompt, tool_prompt


@dataclass(frozen=True)
class ToolSettings:
    """The server's tool-calling settings (--tool-call-parser, --enable-auto-tool-choice)."""

    parser: str
    enable_auto_tool_choice: bool = True


TOOL_SETTINGS = web.AppKey("tool_settings", ToolSettings)


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools change: its prompt (the tools it shows, the calls of its
    history), how its output is parsed (None: not at all) and the grammar that constrains it."""

    prompt: ToolPrompt
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
    try:
        prompt = tool_prompt(tools, messages, JSON_LIMITS)
    except RequestRefused as e:
        raise refused(e) from None
    names = [t.function.name for t in tools]
    for i, tool in enumerate(tools):
        if names.index(tool.function.name) != i:
            raise bad_request(
                f"tools[{i}]: the function name {tool.function.name!r} is used twice",
                param=f"tools.{i}.function.name",
            )
        _check_parameters(tool, i)
    return ToolPlan(prompt, call_ids=prompt.call_ids())


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
        return replace(plan, prompt=replace(plan.prompt, tools=None))
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
