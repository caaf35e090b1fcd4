"""The Responses API (POST /v1/responses) through the official openai SDK and LangChain's
Responses client, against the real default model, greedy: one implementation under two
surfaces, so a Responses request answers what the chat request it stands for answers (text,
tool calls, usage); its stream is the SDK's event sequence and ends with the whole text; a
function tool round trip; text.format through responses.parse; what is not served is a 400 (or
404) that names it; the router keys a Responses request as the chat request it stands for."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest
from langchain_core.messages import HumanMessage, ToolMessage
from langchain_openai import ChatOpenAI
from openai import OpenAI
from pydantic import BaseModel

from kvfleet.router.proxy import Router, RouterSettings, build_runner
from tests.support.json_schemas import WEATHER_TOOL
from tests.support.net import http_call
from tests.support.servers import (
    DEFAULT_SERVED_NAME,
    assert_engine_idle,
    metric,
    openai_client,
    runner_in_thread,
)

MODEL = DEFAULT_SERVED_NAME
INSTRUCTIONS = "You are a helpful assistant. Answer briefly."
QUESTION = "What is the capital of France?"
# The chat tool as the Responses API takes it: the function's fields beside "type".
WEATHER = {"type": "function", **WEATHER_TOOL["function"]}
FORCED = {"type": "function", "name": "get_weather"}


@pytest.fixture(scope="module")
def server(default_server):
    return default_server


@pytest.fixture
def client(server) -> OpenAI:
    return openai_client(server.url, timeout=300)


@pytest.fixture(scope="module")
def answer(server) -> Any:
    """The response to the instructions and the question, whole, which several tests compare
    their own ways of asking with."""
    return _create(
        openai_client(server.url, timeout=300), instructions=INSTRUCTIONS, input=QUESTION
    )


def _create(client: OpenAI, **kwargs: Any) -> Any:
    kwargs.setdefault("max_output_tokens", 16)
    return client.responses.create(model=MODEL, temperature=0, **kwargs)


def _body(error: openai.APIStatusError) -> dict[str, Any]:
    """An error's JSON as the SDK hands it on (the inside of its "error")."""
    assert isinstance(error.body, dict), error.body
    return error.body


def _streamed(client: OpenAI, **kwargs: Any) -> list[Any]:
    return list(_create(client, stream=True, **kwargs))


def test_a_response_is_the_chat_completion_it_stands_for(client: OpenAI, answer: Any) -> None:
    resp = answer
    chat = client.chat.completions.create(
        model=MODEL,
        temperature=0,
        max_completion_tokens=16,
        messages=[
            {"role": "system", "content": INSTRUCTIONS},
            {"role": "user", "content": QUESTION},
        ],
    )
    assert resp.id.startswith("resp_") and resp.object == "response"
    assert resp.model == MODEL and resp.store is False and resp.instructions == INSTRUCTIONS
    assert resp.output_text and resp.output_text == chat.choices[0].message.content
    [item] = resp.output
    assert item.type == "message" and item.id.startswith("msg_") and item.role == "assistant"
    assert item.content[0].annotations == []
    assert resp.usage is not None and chat.usage is not None
    assert resp.usage.input_tokens == chat.usage.prompt_tokens
    assert resp.usage.output_tokens == chat.usage.completion_tokens
    assert resp.usage.total_tokens == resp.usage.input_tokens + resp.usage.output_tokens
    finished = chat.choices[0].finish_reason
    assert resp.status == ("incomplete" if finished == "length" else "completed")


def test_max_output_tokens_cuts_it_incomplete(client: OpenAI) -> None:
    resp = _create(client, input="Tell me a long story about a dragon.", max_output_tokens=5)
    assert resp.status == "incomplete"
    assert resp.incomplete_details is not None
    assert resp.incomplete_details.reason == "max_output_tokens"
    assert resp.usage is not None and resp.usage.output_tokens == 5
    events = _streamed(client, input="Tell me a long story about a dragon.", max_output_tokens=5)
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.output_text == resp.output_text


def test_a_stream_is_the_sdk_event_sequence_ending_with_the_whole_text(
    client: OpenAI, answer: Any
) -> None:
    kwargs: dict[str, Any] = {"instructions": INSTRUCTIONS, "input": QUESTION}
    whole = answer
    events = _streamed(client, metadata={"k": "v"}, **kwargs)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    types = [e.type for e in events]
    deltas = types.count("response.output_text.delta")
    assert deltas >= 2
    assert types == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * deltas,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed" if whole.status == "completed" else "response.incomplete",
    ]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text
    assert events[5 + deltas - 1].text == text  # output_text.done
    final = events[-1].response
    assert final.output_text == text and final.usage is not None
    # Of the prompt, the cache holds what the earlier requests left there.
    assert (final.usage.input_tokens, final.usage.output_tokens) == (
        whole.usage.input_tokens,
        whole.usage.output_tokens,
    )
    assert final.usage.input_tokens_details.cached_tokens > 0
    assert final.metadata == {"k": "v"}
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    # The SDK's own accumulating helper reads the same stream to the same response.
    with client.responses.stream(model=MODEL, temperature=0, max_output_tokens=16, **kwargs) as s:
        assert s.get_final_response().output_text == text


def test_a_function_tool_round_trip(client: OpenAI) -> None:
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    resp = _create(client, input=question, tools=[WEATHER], tool_choice=FORCED)
    [call] = resp.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.id.startswith("fc_") and call.call_id and call.status == "completed"
    arguments = json.loads(call.arguments)
    assert set(arguments) == {"city", "unit"} and len(arguments["city"]) <= 20
    # Streamed: the same call, its arguments in deltas.
    events = _streamed(client, input=question, tools=[WEATHER], tool_choice=FORCED)
    types = [e.type for e in events]
    assert types[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert types[-3:] == [
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert pieces and "".join(pieces) == call.arguments
    assert events[-3].arguments == call.arguments and events[-3].name == "get_weather"
    assert events[-1].response.output[0].arguments == call.arguments
    # The call and its result sent back: the model answers from the result.
    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp": 21}'}
    reply = _create(
        client, input=[*question, *resp.output, result], tools=[WEATHER], max_output_tokens=4
    )
    assert reply.output_text
    # A result that answers no call is the client's error, named.
    orphan = {**result, "call_id": "call_unknown"}
    with pytest.raises(openai.BadRequestError) as e:
        _create(client, input=[*question, orphan], tools=[WEATHER])
    error = _body(e.value)
    assert error["param"] == "input" and "call_unknown" in error["message"]


class City(BaseModel):
    name: str
    country: str


def test_parse_with_a_pydantic_text_format(client: OpenAI) -> None:
    resp = client.responses.parse(
        model=MODEL,
        temperature=0,
        max_output_tokens=48,
        input="Give a famous city and its country as JSON.",
        text_format=City,
    )
    assert isinstance(resp.output_parsed, City)
    assert resp.text is not None and resp.text.format is not None
    assert resp.text.format.type == "json_schema"


@pytest.mark.parametrize(
    ("body", "param", "named"),
    [
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input",
            "input_image",
        ),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input", "reasoning"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input", "item_reference"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools", "web_search"),
        ({"input": "hi", "reasoning": {"effort": "high"}}, "reasoning", "reasoning parser"),
        ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id", "resp_1"),
        ({"input": "hi", "text": {"format": {"type": "json_schema"}}}, "text.format", "name"),
        ({"input": "hi", "tool_choice": "required"}, "tool_choice", "tools"),
        ({"input": "x" * 10_000_000}, "input", "context length"),
    ],
)
def test_what_is_not_served_is_a_400_naming_it(
    server, body: dict[str, Any], param: str, named: str
) -> None:
    status, _, raw = http_call(server.url + "/v1/responses", {"model": MODEL, **body})
    assert status == 400, raw[:300]
    error = json.loads(raw)["error"]
    assert error["param"] == param and named in error["message"], error


def test_stored_responses_are_not_found(client: OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.retrieve("resp_123")
    assert "stores no responses" in _body(e.value)["message"]
    with pytest.raises(openai.NotFoundError):
        client.responses.delete("resp_123")


def test_langchain_responses_client(server) -> None:
    llm = ChatOpenAI(
        model=MODEL, base_url=server.url + "/v1", api_key="unused",  # type: ignore[arg-type]
        temperature=0, max_tokens=24, use_responses_api=True, max_retries=0,  # type: ignore[call-arg]
    )  # fmt: skip
    forced = llm.bind_tools([WEATHER], tool_choice="get_weather")
    question = HumanMessage("What is the weather in Paris?")
    called = forced.invoke([question])
    [call] = called.tool_calls
    assert call["name"] == "get_weather" and set(call["args"]) == {"city", "unit"}
    result = ToolMessage('{"temp": 21}', tool_call_id=call["id"])
    final = llm.bind_tools([WEATHER]).invoke([question, called, result])
    assert final.text


def test_through_the_router(server, answer: Any) -> None:
    router = Router(RouterSettings(hold_timeout=5.0), None)
    router.set_endpoints([server.url.removeprefix("http://")])
    with runner_in_thread(build_runner(router)) as front:
        routed = openai_client(front.url, timeout=300)
        events = _streamed(routed, instructions=INSTRUCTIONS, input=QUESTION)
        assert events[-1].type in ("response.completed", "response.incomplete")
        assert events[-1].response.output_text == answer.output_text
        # The stream ends with its last event, no [DONE].
        raw = httpx.post(
            front.url + "/v1/responses",
            json={"model": MODEL, "input": "Hi", "max_output_tokens": 2, "stream": True},
            timeout=300,
        ).text
        assert raw.rstrip().endswith("}") and "[DONE]" not in raw


def test_engine_metrics_count_it_and_a_hang_up_aborts_it(server, client: OpenAI) -> None:
    before = metric(server, "vllm:prompt_tokens_total")
    resp = _create(client, input=QUESTION, max_output_tokens=2)
    assert resp.usage is not None
    assert metric(server, "vllm:prompt_tokens_total") - before == resp.usage.input_tokens
    body = {"model": MODEL, "input": "Count to a thousand.", "max_output_tokens": 4000,
            "stream": True, "temperature": 0}  # fmt: skip
    with httpx.stream("POST", server.url + "/v1/responses", json=body, timeout=300) as r:
        lines = r.iter_lines()
        while "output_text.delta" not in next(lines):
            pass
    # The client hung up mid-stream: its request is aborted, its KV blocks freed.
    assert_engine_idle(server)
