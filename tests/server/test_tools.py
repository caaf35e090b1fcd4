"""Tool calling: tools, tool_choice and tool messages through the official openai SDK against the
real default model (SmolLM2-135M-Instruct, whose ChatML template knows no tools: the server's
fallback writes them into the system message), directly and through the router; the prompt and
the parsing of outputs on their own; bad inputs are 400s naming the parameter."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import llguidance
import llguidance.hf
import pytest
from openai import OpenAI
from transformers import AutoTokenizer

from kvfleet.engine.grammar import grammar_spec
from kvfleet.engine.outputs import CompletionOutput
from kvfleet.engine.server.app import ServerSettings
from kvfleet.engine.server.openai_requests import ChatCompletionRequest
from kvfleet.engine.server.tool_parsers import HERMES, LLAMA3_JSON, MISTRAL
from kvfleet.engine.server.tools import (
    StreamedChoices,
    ToolPlan,
    ToolSettings,
    choice_message,
    plan_tools,
    required_schema,
)
from kvfleet.protocol.chat_template import render_chat_text
from kvfleet.protocol.tool_prompt import ToolPrompt, conversation_with_tools
from kvfleet.router.proxy import Router, RouterSettings, build_runner
from tests.support.json_schemas import WEATHER_TOOL
from tests.support.net import http_call
from tests.support.servers import DEFAULT_SERVED_NAME, openai_client, runner_in_thread
from tests.support.tiny_model import tiny_model_path

MODEL = DEFAULT_SERVED_NAME
WEATHER = WEATHER_TOOL
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 20}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(default_server):
    return default_server


@pytest.fixture
def client(server) -> OpenAI:
    return openai_client(server.url, timeout=300)


def _chat(client: OpenAI, **kwargs: Any) -> Any:
    kwargs.setdefault("max_tokens", 48)
    return client.chat.completions.create(model=MODEL, temperature=0, **kwargs)


def _streamed_message(client: OpenAI, **kwargs: Any) -> tuple[str, list[dict], str, list]:
    """Content, calls (assembled from their deltas as the SDK's users do), finish reason, and
    the raw tool-call deltas of a streamed response."""
    content, calls, finish, deltas = "", [], None, []
    for chunk in _chat(client, stream=True, **kwargs):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or []:
            deltas.append(d)
            if d.id is not None:
                assert d.index == len(calls) and d.type == "function"
                assert d.function.arguments == ""
                calls.append({"id": d.id, "name": d.function.name, "arguments": ""})
            else:
                assert d.function.name is None
                calls[d.index]["arguments"] += d.function.arguments
        finish = choice.finish_reason or finish
    return content, calls, finish, deltas


def _without_ids(client: OpenAI, kwargs: dict[str, Any]) -> tuple:
    """A streamed response's content, calls (ids aside: each response makes its own) and
    finish reason."""
    content, calls, finish, _ = _streamed_message(client, **kwargs)
    return content, [(c["name"], c["arguments"]) for c in calls], finish


def _round_trip_messages(
    call_id: str,
    name: str = "get_weather",
    arguments: str = '{"city": "Paris", "unit": "celsius"}',
) -> list[dict[str, Any]]:
    """The question, the assistant's call, and the tool's result."""
    call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
    return [
        *QUESTION,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call_id, "content": '{"temperature": 21}'},
    ]


# --------------------------------------------------------------------------------------------
# The real model through the SDK
# --------------------------------------------------------------------------------------------


def test_auto_parses_what_the_model_decides_streamed_as_whole(client: OpenAI) -> None:
    resp = _chat(client, messages=QUESTION, tools=TOOLS, max_tokens=24)
    message = resp.choices[0].message
    if message.tool_calls:  # what the model decides is its own; either way it is well formed
        assert resp.choices[0].finish_reason == "tool_calls"
        json.loads(message.tool_calls[0].function.arguments)
    else:
        assert message.content and "<tool_call>" not in message.content
    # After a call in the history, SmolLM2 calls again in the format it was shown: the parser
    # reads the real model's output, and the stream carries the same calls as the whole.
    whole = _chat(client, messages=_round_trip_messages("call_abc"), tools=TOOLS)
    content, calls, finish, _ = _streamed_message(
        client, messages=_round_trip_messages("call_abc"), tools=TOOLS
    )
    choice = whole.choices[0]
    assert finish == choice.finish_reason
    assert calls == [
        {"id": calls[i]["id"], "name": c.function.name, "arguments": c.function.arguments}
        for i, c in enumerate(choice.message.tool_calls or [])
    ]
    assert content == (choice.message.content or "")
    for call in calls:
        assert call["name"] in ("get_weather", "get_time")
        json.loads(call["arguments"])


def test_a_tool_result_is_answered(client: OpenAI) -> None:
    """The round trip: the call, the tool's result, and an answer (tool_choice none, as an
    agent asks for the final answer; the round trip with forced calls is below)."""
    for stream in (False, True):
        kwargs = {"messages": _round_trip_messages("call_abc"), "tools": TOOLS,
                  "tool_choice": "none", "max_tokens": 12}  # fmt: skip
        if stream:
            content, calls, _, _ = _streamed_message(client, **kwargs)
        else:
            message = _chat(client, **kwargs).choices[0].message
            content, calls = message.content, message.tool_calls
        assert content and not calls


def test_none_never_calls(client: OpenAI) -> None:
    resp = _chat(client, messages=QUESTION, tools=TOOLS, tool_choice="none", max_tokens=12)
    assert resp.choices[0].message.tool_calls is None
    assert resp.choices[0].message.content
    assert resp.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("stream", [False, True])
def test_required_makes_a_valid_call_and_the_round_trip_answers(client: OpenAI, stream) -> None:
    kwargs = {"messages": QUESTION, "tools": TOOLS, "tool_choice": "required", "max_tokens": 80}
    if stream:
        _, calls, finish, deltas = _streamed_message(client, **kwargs)
        assert len(deltas) > 2  # arguments arrive in pieces
    else:
        resp = _chat(client, **kwargs)
        finish = resp.choices[0].finish_reason
        calls = [
            {"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
            for c in resp.choices[0].message.tool_calls
        ]
    assert finish == "tool_calls" and calls
    for call in calls:
        assert call["id"].startswith("call_")
        tool = next(t for t in TOOLS if t["function"]["name"] == call["name"])
        jsonschema.validate(json.loads(call["arguments"]), tool["function"]["parameters"])
    history = _round_trip_messages(calls[0]["id"], calls[0]["name"], calls[0]["arguments"])
    answer = _chat(client, messages=history, tools=TOOLS, tool_choice="none", max_tokens=12)
    assert answer.choices[0].message.content


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_function_is_called(client: OpenAI, stream) -> None:
    kwargs = {
        "messages": QUESTION,
        "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "get_time"}},
        "max_tokens": 60,
    }
    if stream:
        _, calls, finish, _ = _streamed_message(client, **kwargs)
    else:
        resp = _chat(client, **kwargs)
        finish = resp.choices[0].finish_reason
        calls = [{"name": c.function.name, "arguments": c.function.arguments}
                 for c in resp.choices[0].message.tool_calls]  # fmt: skip
    assert finish == "tool_calls" and [c["name"] for c in calls] == ["get_time"]
    jsonschema.validate(json.loads(calls[0]["arguments"]), TIME["function"]["parameters"])


def test_logit_bias_cannot_break_a_forced_call(client: OpenAI, server) -> None:
    """The grammar's mask wins over a +100 bias: the biased token is banned where the schema
    forbids it, and the call stays valid."""
    status, _, raw = http_call(
        server.url + "/tokenize", {"prompt": " Paris", "add_special_tokens": False}
    )
    assert status == 200
    token = json.loads(raw)["tokens"][0]
    resp = _chat(
        client,
        messages=QUESTION,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        logit_bias={str(token): 100},
        max_tokens=60,
    )
    (call,) = resp.choices[0].message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), TIME["function"]["parameters"])


def test_tools_through_the_router(server) -> None:
    router = Router(RouterSettings(hold_timeout=5.0), None)
    router.set_endpoints([server.url.removeprefix("http://")])
    body = {
        "model": MODEL,
        "messages": _round_trip_messages("call_1"),
        "tools": TOOLS,
        "temperature": 0,
        "max_tokens": 16,
    }
    direct = openai_client(server.url, timeout=300)
    with runner_in_thread(build_runner(router)) as front:
        status, _, raw = http_call(front.url + "/v1/chat/completions", body)
        assert status == 200, raw[:500]
        assert json.loads(raw)["choices"][0]["message"]["content"]
        # auto, streamed: the calls SmolLM2 repeats arrive through the router as directly
        routed = openai_client(front.url, timeout=300)
        kwargs = {"messages": _round_trip_messages("call_1"), "tools": TOOLS}
        assert _without_ids(routed, kwargs) == _without_ids(direct, kwargs)
        bad = {**body, "tool_choice": {"type": "function", "function": {"name": "nope"}}}
        status, _, raw = http_call(front.url + "/v1/chat/completions", bad)
    assert status == 400 and json.loads(raw)["error"]["param"] == "tool_choice"


# --------------------------------------------------------------------------------------------
# Bad inputs
# --------------------------------------------------------------------------------------------

_CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
BAD = [
    ("tool message answering nothing",
     {"messages": [*QUESTION, {"role": "tool", "tool_call_id": "call_x", "content": "1"}]},
     "messages.1.tool_call_id"),
    ("tool message without its id",
     {"messages": [*QUESTION, {"role": "assistant", "tool_calls": [_CALL]},
                   {"role": "tool", "content": "1"}]}, "messages.2.tool_call_id"),
    ("tool_calls on a user message",
     {"messages": [{"role": "user", "content": "x", "tool_calls": [_CALL]}]},
     "messages.0.tool_calls"),
    ("arguments not JSON",
     {"messages": [*QUESTION, {"role": "assistant", "tool_calls": [
         {**_CALL, "function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages.1.tool_calls.0.function.arguments"),
    ("unknown named function", {"tools": TOOLS, "tool_choice": {
        "type": "function", "function": {"name": "get_stock"}}}, "tool_choice"),
    ("required without tools", {"tool_choice": "required"}, "tool_choice"),
    ("unknown tool_choice", {"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ("tool without function", {"tools": [{"type": "function"}]}, "tools.0.function"),
    ("bad function name", {"tools": [{"type": "function", "function": {"name": "a b"}}]},
     "tools.0.function.name"),
    ("parameters not an object schema", {"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "string"}}}]}, "tools.0.function.parameters"),
    ("parameters not a schema", {"tools": [{"type": "function", "function": {
        "name": "f", "parameters": "x"}}]}, "tools.0.function.parameters"),
    ("duplicate names", {"tools": [WEATHER, WEATHER]}, "tools.1.function.name"),
    ("required with response_format", {"tools": TOOLS, "tool_choice": "required",
                                       "response_format": {"type": "json_object"}}, None),
]  # fmt: skip


@pytest.mark.parametrize(("body", "param"), [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_tool_inputs_are_400s_naming_the_param(server, body, param) -> None:
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 2, **body}
    status, _, raw = http_call(server.url + "/v1/chat/completions", body)
    assert status == 400, raw[:300]
    error = json.loads(raw)["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    if param is not None:
        assert error["param"] == param, error


def _forced_tool(parameters: dict[str, Any]) -> dict[str, Any]:
    tool = {"type": "function", "function": {"name": "f", "parameters": parameters}}
    return {"tools": [tool], "tool_choice": "required"}


def test_a_forced_call_with_a_huge_schema_is_a_400(server) -> None:
    props = {f"field_{i}": {"type": "string", "description": "x" * 200} for i in range(400)}
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 2,
            **_forced_tool({"type": "object", "properties": props})}  # fmt: skip
    status, _, raw = http_call(server.url + "/v1/chat/completions", body)
    assert status == 400 and json.loads(raw)["error"]["param"] == "tool_choice", raw[:300]


def test_a_forced_call_whose_schema_cannot_compile_is_a_400(server) -> None:
    body = {
        "model": MODEL,
        "messages": QUESTION,
        "max_tokens": 2,
        **_forced_tool({"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}),
    }
    status, _, raw = http_call(server.url + "/v1/chat/completions", body)
    assert status == 400 and json.loads(raw)["error"]["param"] == "tool_choice", raw[:300]
    ok, _, _ = http_call(server.url + "/v1/chat/completions", {**body, "tool_choice": "none"})
    assert ok == 200


# --------------------------------------------------------------------------------------------
# Planning, rendering and parsing on their own
# --------------------------------------------------------------------------------------------


def _plan(**body: Any) -> ToolPlan:
    req = ChatCompletionRequest.model_validate({"messages": QUESTION, **body})
    return plan_tools(req, ToolSettings(HERMES))


def test_required_schema_accepts_calls_of_the_tools_only() -> None:
    req = ChatCompletionRequest.model_validate({"messages": QUESTION, "tools": TOOLS})
    schema = required_schema(req.tools or [], parallel=True)
    good = [{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}},
            {"name": "get_time", "arguments": {"zone": "UTC"}}]  # fmt: skip
    jsonschema.validate(good, schema)
    for bad in ([], [{"name": "get_time", "arguments": {"city": "Oslo", "unit": "celsius"}}],
                [{"name": "rm", "arguments": {}}], [{"name": "get_time"}]):  # fmt: skip
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    single = required_schema(req.tools or [], parallel=False)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(good, single)
    jsonschema.validate(good[:1], single)


CITY = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "$defs": {"city": {"type": "string", "maxLength": 10}},
            "properties": {"city": {"$ref": "#/$defs/city"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
# The same definition name, another schema: each tool's refs mean its own.
CODE = {
    "type": "function",
    "function": {
        "name": "get_code",
        "parameters": {
            "type": "object",
            "$defs": {"city": {"type": "integer"}},
            "properties": {"c": {"$ref": "#/$defs/city"}},
            "required": ["c"],
            "additionalProperties": False,
        },
    },
}
# "#" is the tool's own parameters: a tree of labels.
TREE = {"type": "function", "function": {"name": "tree", "parameters": {
    "type": "object", "properties": {"label": {"type": "string", "maxLength": 5},
    "kids": {"type": "array", "maxItems": 2, "items": {"$ref": "#"}}},
    "required": ["label"], "additionalProperties": False}}}  # fmt: skip


@pytest.mark.parametrize(
    ("text", "accepted"),
    [
        ('[{"name": "get_weather", "arguments": {"city": "Oslo"}}]', True),
        ('[{"name": "get_code", "arguments": {"c": 47}}]', True),
        ('[{"name": "get_code", "arguments": {"c": "Oslo"}}]', False),
        ('[{"name": "get_weather", "arguments": {"city": 47}}]', False),
        ('[{"name": "tree", "arguments": {"label": "a", "kids": [{"label": "b"}]}}]', True),
        # "#" read as the whole constraint (an array of calls) would take this one
        ('[{"name": "tree", "arguments": {"label": "a", "kids": [[{"name": "tree", '
         '"arguments": {"label": "b"}}]]}}]', False),
    ],
)  # fmt: skip
def test_required_resolves_each_tools_refs_against_its_own_parameters(text, accepted) -> None:
    """tool_choice required compiles one grammar of all the tools; a tool's "$ref"s (its
    "$defs", "#") mean what they mean when it is called by name. Checked by the grammar
    library itself, on the constraint a request gets."""
    plan = _plan(tools=[CITY, CODE, TREE], tool_choice="required")
    assert plan.structured is not None
    tok = llguidance.hf.from_tokenizer(AutoTokenizer.from_pretrained(tiny_model_path()))
    matcher = llguidance.LLMatcher(tok, grammar_spec(plan.structured)[1])
    assert not matcher.is_error(), matcher.get_error()
    ok = matcher.consume_tokens(tok.tokenize_str(text)) and matcher.is_accepting()
    assert ok == accepted
    calls = json.loads(text)
    tool = next(t for t in (CITY, CODE, TREE) if t["function"]["name"] == calls[0]["name"])
    valid = jsonschema.Draft202012Validator(tool["function"]["parameters"]).is_valid(
        calls[0]["arguments"]
    )
    assert valid == accepted  # the schema's own meaning, by a JSON Schema validator


def test_plans_per_tool_choice() -> None:
    assert _plan(tools=TOOLS).parse_mode == HERMES and _plan(tools=TOOLS).structured is None
    assert _plan(tools=TOOLS, tool_choice="none") == ToolPlan(ToolPrompt(None))
    named = _plan(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert (named.parse_mode, named.function_name) == ("named", "get_time")
    assert named.structured.json == TIME["function"]["parameters"]
    required = _plan(tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert required.parse_mode == "array" and required.structured.json["maxItems"] == 1


def test_chat_template_flag_takes_a_file_or_inline_text(tmp_path) -> None:
    path = tmp_path / "t.jinja"
    path.write_text(NATIVE)
    assert ServerSettings(chat_template=str(path)).chat_template == NATIVE
    assert ServerSettings(chat_template=NATIVE).chat_template == NATIVE
    with pytest.raises(ValueError, match="neither a readable file nor an inline"):
        ServerSettings(chat_template=str(tmp_path / "missing.jinja"))


def test_auto_off_is_a_400() -> None:
    req = ChatCompletionRequest.model_validate({"messages": QUESTION, "tools": TOOLS})
    with pytest.raises(Exception, match="enable-auto-tool-choice"):
        plan_tools(req, ToolSettings(HERMES, enable_auto_tool_choice=False))


@pytest.mark.parametrize("family", [HERMES, LLAMA3_JSON, MISTRAL])
def test_fallback_prompt_asks_for_what_the_parser_reads(family: str) -> None:
    req = ChatCompletionRequest.model_validate(
        {"messages": _round_trip_messages("call_9"), "tools": TOOLS}
    )
    plan = plan_tools(req, ToolSettings(family))
    conv = conversation_with_tools(req.messages, plan.prompt, native=False, family=family)
    assert conv[0]["role"] == "system" and '"name": "get_time"' in conv[0]["content"]
    assert [e["role"] for e in conv] == ["system", "user", "assistant", "user"]
    assert "call_9" in conv[3]["content"] and '{"temperature": 21}' in conv[3]["content"]
    # the assistant's earlier call, as the model is asked to write calls, parses back
    echoed = choice_message(plan, conv[2]["content"], "stop")
    assert echoed[0].tool_calls and echoed[0].tool_calls[0].function.name == "get_weather"
    assert echoed[1] == "tool_calls"


NATIVE = (
    "{% for t in tools or [] %}TOOL {{ t.function.name }}\n{% endfor %}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
    "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }} {{ c.function.arguments.city }}"
    "{% endfor %}{% if m.tool_call_id %}RESULT {{ m.tool_call_id }}{% endif %}\n{% endfor %}"
)


def test_a_template_that_reads_tools_gets_them() -> None:
    req = ChatCompletionRequest.model_validate(
        {"messages": _round_trip_messages("call_9"), "tools": TOOLS}
    )
    plan = plan_tools(req, ToolSettings(HERMES))
    conv = conversation_with_tools(req.messages, plan.prompt, native=True, family=HERMES)

    class Tokenizer:
        chat_template = NATIVE

        def apply_chat_template(self, conversation, chat_template, add_generation_prompt,
                                tokenize, tools=None):  # fmt: skip
            import jinja2

            return jinja2.Template(chat_template).render(messages=conversation, tools=tools)

    text = render_chat_text(Tokenizer(), conv, tools=plan.prompt.tools)
    assert "TOOL get_weather\nTOOL get_time\n" in text
    assert "CALL get_weather Paris" in text and "<tool>" in text and "RESULT call_9" in text


def test_parallel_tool_calls_false_keeps_the_first_call() -> None:
    plan = _plan(tools=TOOLS, parallel_tool_calls=False)
    text = "".join(
        f'<tool_call>{{"name": "get_time", "arguments": {{"zone": "{z}"}}}}</tool_call>'
        for z in ("UTC", "CET")
    )
    whole, finish = choice_message(plan, text, "stop")
    assert finish == "tool_calls"
    assert [json.loads(c.function.arguments) for c in whole.tool_calls or []] == [{"zone": "UTC"}]
    streamed = StreamedChoices(plan)
    deltas = [streamed.delta(CompletionOutput(0, ch))[0] for ch in text]
    assert {c.index for d in deltas for c in d.tool_calls or []} == {0}


def test_streamed_choices_send_openai_tool_call_deltas() -> None:
    plan = _plan(tools=TOOLS)
    text = 'Checking.<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>'
    streamed = StreamedChoices(plan)
    pieces = [text[i : i + 3] for i in range(0, len(text), 3)]
    deltas = []
    for k, piece in enumerate(pieces):
        last = k == len(pieces) - 1
        deltas.append(streamed.delta(CompletionOutput(0, piece, finish_reason="stop" if last
                                                      else None)))  # fmt: skip
    content = "".join(d.content or "" for d, _ in deltas)
    calls = [c.model_dump(exclude_none=True) for d, _ in deltas for c in d.tool_calls or []]
    assert content == "Checking." and deltas[-1][1] == "tool_calls"
    assert calls[0]["id"].startswith("call_") and calls[0]["type"] == "function"
    assert calls[0]["function"] == {"name": "get_time", "arguments": ""}
    assert all(set(c) == {"index", "function"} for c in calls[1:])
    assert json.loads("".join(c["function"]["arguments"] for c in calls[1:])) == {"zone": "UTC"}
    whole, finish = choice_message(plan, text, "stop")
    assert whole.content == "Checking." and finish == "tool_calls" and whole.tool_calls
    assert json.loads(whole.tool_calls[0].function.arguments) == {"zone": "UTC"}


@pytest.mark.parametrize("parallel", [True, False])
def test_a_forced_call_cut_by_max_tokens_keeps_the_calls_it_completed(parallel) -> None:
    """tool_choice required cut inside its second call: the first is a call (finish_reason
    length says the output was cut), the unfinished one is dropped, nothing becomes content."""
    plan = _plan(tools=TOOLS, tool_choice="required", parallel_tool_calls=parallel)
    first = '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}'
    text = f'[{first}, {{"name": "get_time", "argum'
    message, finish = choice_message(plan, text, "length")
    assert finish == "length" and message.content is None
    calls = message.tool_calls or []
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo", "unit": "celsius"})
    ]
    # Cut before any call was whole: nothing to return as a call, the text stays content.
    message, finish = choice_message(plan, text[:20], "length")
    assert finish == "length" and message.tool_calls is None and message.content == text[:20]
