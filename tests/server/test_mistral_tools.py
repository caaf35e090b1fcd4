"""Mistral's tool-call ids: its chat templates take a call back in the conversation only when its
id is 9 letters and digits, so a server with the mistral parser makes such ids, streamed and whole,
for parsed and forced calls alike, each new within its response and conversation. The round trip
runs through the real default model served with a Mistral-style template that checks the ids as
Mistral's templates do."""

from __future__ import annotations

import json
import re
from itertools import chain, repeat
from typing import Any

import pytest
from openai import BadRequestError, OpenAI

from kvfleet.engine.outputs import CompletionOutput
from kvfleet.engine.server.openai_requests import ChatCompletionRequest
from kvfleet.engine.server.tool_parsers import HERMES, MISTRAL
from kvfleet.engine.server.tools import StreamedChoices, ToolSettings, choice_message, plan_tools
from tests.support.net import http_call
from tests.support.servers import default_model_server, openai_client

MODEL = "smollm2"
MISTRAL_ID = re.compile(r"^[A-Za-z0-9]{9}$")
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 12}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
QUESTION = [{"role": "user", "content": "What time is it in Tokyo?"}]
# A template in Mistral's manner: tools in [AVAILABLE_TOOLS], calls after [TOOL_CALLS], results in
# [TOOL_RESULTS], and any call id but 9 letters and digits refused.
TEMPLATE = (
    "{%- macro check(id) -%}"
    "{%- if id is not string or id | length != 9 or not id.isalnum() -%}"
    "{{ raise_exception('tool call ids must be 9 letters and digits, not ' ~ id) }}"
    "{%- endif -%}{%- endmacro -%}"
    "{%- if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' and m.tool_calls -%}[TOOL_CALLS]["
    "{%- for c in m.tool_calls -%}{{ check(c.id) }}"
    '{"name": {{ c.function.name | tojson }}, "arguments": {{ c.function.arguments | tojson }}, '
    '"id": "{{ c.id }}"}{{ ", " if not loop.last }}'
    "{%- endfor -%}]</s>"
    "{%- elif m.role == 'assistant' -%}{{ m.content }}</s>"
    "{%- elif m.role == 'tool' -%}{{ check(m.tool_call_id) }}"
    '[TOOL_RESULTS]{"call_id": "{{ m.tool_call_id }}", "content": {{ m.content | tojson }}}'
    "[/TOOL_RESULTS]"
    "{%- else -%}[INST] {{ m.content }} [/INST]{%- endif -%}"
    "{%- endfor -%}"
)


@pytest.fixture(scope="module")
def client(smollm2_gguf):
    settings = {"chat_template": TEMPLATE, "tool_call_parser": MISTRAL}
    with default_model_server(smollm2_gguf, MODEL, **settings) as s:
        yield openai_client(s.url, timeout=300)


def _chat(client: OpenAI, **kwargs: Any) -> Any:
    kwargs.setdefault("temperature", 0)
    return client.chat.completions.create(model=MODEL, **kwargs)


def _calls(client: OpenAI, stream: bool, **kwargs: Any) -> tuple[list[dict[str, str]], str]:
    """The calls of a response (assembled from their deltas when streamed) and its finish."""
    if not stream:
        choice = _chat(client, **kwargs).choices[0]
        calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                 for c in choice.message.tool_calls or []]  # fmt: skip
        return calls, choice.finish_reason
    calls: list[dict[str, str]] = []
    finish = ""
    for chunk in _chat(client, stream=True, **kwargs):
        choice = chunk.choices[0]
        for d in choice.delta.tool_calls or []:
            if d.id is not None:
                calls.append({"id": d.id, "name": d.function.name, "arguments": ""})
            else:
                calls[d.index]["arguments"] += d.function.arguments
        finish = choice.finish_reason or finish
    return calls, finish


def _history(calls: list[dict[str, str]]) -> list[dict[str, Any]]:
    """The question, the assistant's calls and a result for each."""
    made = [
        {"id": c["id"], "type": "function",
         "function": {"name": c["name"], "arguments": c["arguments"]}}
        for c in calls
    ]  # fmt: skip
    results = [{"role": "tool", "tool_call_id": c["id"], "content": "09:30"} for c in calls]
    return [*QUESTION, {"role": "assistant", "content": None, "tool_calls": made}, *results]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}]
)
def test_the_round_trip_through_a_mistral_template(client: OpenAI, stream, tool_choice) -> None:
    calls, finish = _calls(client, stream, messages=QUESTION, tools=[TIME],
                           tool_choice=tool_choice, max_tokens=80)  # fmt: skip
    assert finish == "tool_calls" and calls
    assert all(MISTRAL_ID.match(c["id"]) for c in calls), calls
    assert [c["name"] for c in calls] == ["get_time"] * len(calls)
    json.loads(calls[0]["arguments"])
    # The template takes the calls and their results back; the model answers.
    answer = _chat(client, messages=_history(calls), tools=[TIME], tool_choice="none",
                   max_tokens=8)  # fmt: skip
    assert answer.choices[0].message.content


def test_ids_made_elsewhere_reach_the_template_as_their_last_nine_characters(
    client: OpenAI,
) -> None:
    """An OpenAI-style id (a client that called another provider first) is shortened for the
    Mistral template, in the call and in its result alike, so the conversation goes on."""
    calls = [{"id": "call_0123456789abcdef", "name": "get_time", "arguments": '{"zone": "JST"}'}]
    answer = _chat(client, messages=_history(calls), tools=[TIME], tool_choice="none",
                   max_tokens=8)  # fmt: skip
    assert answer.choices[0].message.content


def test_the_template_refuses_an_id_still_not_nine_letters_and_digits(client: OpenAI) -> None:
    """What the round trip guards against: an id the template cannot take, even shortened, is a
    400 quoting the template."""
    calls = [{"id": "call_0123-4567-89ab", "name": "get_time", "arguments": '{"zone": "JST"}'}]
    with pytest.raises(BadRequestError, match="9 letters and digits"):
        _chat(client, messages=_history(calls), tools=[TIME], max_tokens=4)


def test_the_choices_of_a_response_get_distinct_ids(client: OpenAI) -> None:
    resp = _chat(client, messages=QUESTION, tools=[TIME], tool_choice="required", n=3,
                 temperature=1.0, seed=7, max_tokens=80)  # fmt: skip
    ids = [c.id for choice in resp.choices for c in choice.message.tool_calls or []]
    assert len(ids) >= 3 and len(set(ids)) == len(ids)
    assert all(MISTRAL_ID.match(i) for i in ids)


def test_tokenize_counts_the_tools_as_the_template_renders_them(client: OpenAI) -> None:
    """/tokenize's chat form with tools: the template's own rendering, the count chat reports."""
    body = {"model": MODEL, "messages": QUESTION, "tools": [TIME]}
    status, _, raw = http_call(str(client.base_url).removesuffix("/v1/") + "/tokenize", body)
    assert status == 200, raw
    count = json.loads(raw)["count"]
    usage = _chat(client, messages=QUESTION, tools=[TIME], max_tokens=1).usage
    assert count == usage.prompt_tokens
    plain = _chat(client, messages=QUESTION, max_tokens=1).usage.prompt_tokens
    assert count > plain + 20  # [AVAILABLE_TOOLS] and the schema


# --------------------------------------------------------------------------------------------
# The ids on their own
# --------------------------------------------------------------------------------------------

MODEL_CALLS = (
    'Let me check.[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "JST"}}, '
    '{"name": "get_time", "arguments": {"zone": "CET"}}]'
)


def _plan(family: str, messages: list[dict[str, Any]] = QUESTION, **body: Any):
    req = ChatCompletionRequest.model_validate({"messages": messages, "tools": [TIME], **body})
    return plan_tools(req, ToolSettings(family))


def test_parsed_calls_get_mistral_ids_streamed_and_whole() -> None:
    whole, finish = choice_message(_plan(MISTRAL), MODEL_CALLS, "stop")
    assert finish == "tool_calls" and whole.content == "Let me check."
    ids = [c.id for c in whole.tool_calls or []]
    assert len(set(ids)) == 2 and all(MISTRAL_ID.match(i) for i in ids)
    streamed = StreamedChoices(_plan(MISTRAL))
    deltas = [streamed.delta(CompletionOutput(0, ch))[0] for ch in MODEL_CALLS]
    headers = [c for d in deltas for c in d.tool_calls or [] if c.id is not None]
    assert [c.index for c in headers] == [0, 1]
    assert all(c.id and MISTRAL_ID.match(c.id) for c in headers)
    # Other families keep OpenAI's ids.
    hermes = '<tool_call>{"name": "get_time", "arguments": {"zone": "JST"}}</tool_call>'
    message, _ = choice_message(_plan(HERMES), hermes, "stop")
    assert message.tool_calls and message.tool_calls[0].id.startswith("call_")


def test_forced_calls_get_the_server_familys_ids() -> None:
    for body, text in (
        ({"tool_choice": "required"}, '[{"name": "get_time", "arguments": {"zone": "JST"}}]'),
        ({"tool_choice": {"type": "function", "function": {"name": "get_time"}}},
         '{"zone": "JST"}'),
    ):  # fmt: skip
        message, _ = choice_message(_plan(MISTRAL, **body), text, "stop")
        assert message.tool_calls and MISTRAL_ID.match(message.tool_calls[0].id), message


def test_an_id_is_new_within_its_response_and_conversation(monkeypatch) -> None:
    """Random ids could repeat (1 in 62^9); a repeat is drawn again. Here the draws repeat on
    purpose: A..A and A..A (the conversation's id), B..B, B..B (the first call's), C..C."""
    draws = chain(*(repeat(ch, 9) for ch in "AABBC"))
    monkeypatch.setattr("kvfleet.engine.server.tool_parsers.secrets.choice", lambda _: next(draws))
    earlier = [{"id": "AAAAAAAAA", "name": "get_time", "arguments": "{}"}]
    plan = _plan(MISTRAL, _history(earlier))
    message, _ = choice_message(plan, MODEL_CALLS, "stop")
    assert [c.id for c in message.tool_calls or []] == ["BBBBBBBBB", "CCCCCCCCC"]
