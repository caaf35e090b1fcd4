"""An answer streamed and the same answer whole come out of the same engine outputs: a client
that joins the stream's events gets the whole response (several prompts, n > 1, logprobs, echo,
prompt logprobs, tool calls, usage). And the response models' JSON leaves out exactly the fields
OpenAI's shape has no key for."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Callable
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from kvfleet.engine.async_engine import RequestFailedError
from kvfleet.engine.outputs import CompletionOutput, RequestOutput
from kvfleet.engine.server.answers import Answer, respond
from kvfleet.engine.server.chat import ChatAnswer
from kvfleet.engine.server.completions import CompletionAnswer
from kvfleet.engine.server.openai_requests import ChatCompletionRequest, CompletionRequest
from kvfleet.engine.server.openai_responses import (
    AssistantMessage,
    ChatDelta,
    ChatRoleChoice,
    DeltaFunction,
    DeltaToolCall,
    TopLogprob,
)
from kvfleet.engine.server.responses import ResponsesAnswer
from kvfleet.engine.server.responses_request import ResponsesRequest
from kvfleet.engine.server.tool_parsers import HERMES
from kvfleet.engine.server.tools import ToolSettings, plan_tools

PROMPTS = [[5, 6, 7], [8, 9]]
CALL = '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>'
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}},
    },
}


class _Context:
    """What an answer reads of the serving context: token texts, and the parse thread (here
    the caller's own)."""

    def token_text(self, token_id: int) -> str:
        return f"<{token_id}>"

    async def parse_off_loop(self, size: int, threshold: int, fn: Callable, *args: Any) -> Any:
        return fn(*args)


def _pieces(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


def _steps(
    texts: dict[tuple[int, int], list[str]], prompt_logprobs: bool = False
) -> list[tuple[int, RequestOutput]]:
    """Engine outputs, step by step: each choice (prompt, index) still going gets its next
    piece of text ("" is a token whose text is held back) with its token's logprobs; its last
    piece finishes it. The prompt's logprobs come with its first step."""
    steps = []
    token = 100
    for k in range(max(len(p) for p in texts.values())):
        for prompt in sorted({p for p, _ in texts}):
            outputs = []
            for (p, index), pieces in sorted(texts.items()):
                if p != prompt or k >= len(pieces):
                    continue
                token += 1
                last = k == len(pieces) - 1
                outputs.append(
                    CompletionOutput(
                        index=index, text=pieces[k], token_ids=[token],
                        logprobs=[{token: -0.5, token + 1: -1.5}],
                        finish_reason="stop" if last else None, stop_reason=2 if last else None,
                    )
                )  # fmt: skip
            ids = PROMPTS[prompt]
            scored = [None] + [{t: -1.0, 3: -2.0} for t in ids[1:]] if k == 0 else None
            output = RequestOutput("r", ids, outputs, num_cached_tokens=k)
            output.prompt_logprobs = scored if prompt_logprobs else None
            steps.append((prompt, output))
    return steps


async def _answered(
    answer: Answer[Any, Any], steps: list[tuple[int, RequestOutput]], fails: bool = False
) -> Any:
    """The answer as a client gets it over HTTP: the JSON body, or the stream's events.
    fails: the engine fails the request after the steps."""

    async def outputs() -> AsyncGenerator[tuple[int, RequestOutput], None]:
        for step in steps:
            yield step
        if fails:
            raise RequestFailedError("detokenization failed")

    async def handler(request: web.Request) -> web.StreamResponse:
        return await respond(request, answer, outputs())

    app = web.Application()
    app.router.add_post("/", handler)
    async with TestClient(TestServer(app)) as client:
        resp = await client.post("/")
        if not answer.stream:
            return await resp.json()
        text = await resp.text()
    events = [line.removeprefix("data: ") for line in text.split("\n\n") if line]
    if answer.ends_with_done:
        assert events.pop() == "[DONE]"
    assert "[DONE]" not in events
    return [json.loads(e) for e in events]


def _joined_completion(events: list[dict[str, Any]]) -> dict[str, Any]:
    """A streamed completion as a client joins its events."""
    choices: dict[int, dict[str, Any]] = {}
    for event in events:
        for chunk in event["choices"]:
            choice = choices.get(chunk["index"])
            if choice is None:
                choices[chunk["index"]] = json.loads(json.dumps(chunk))
                continue
            choice["text"] += chunk["text"]
            for key, values in chunk["logprobs"].items():
                choice["logprobs"][key] += values
            choice["finish_reason"] = chunk["finish_reason"]
            choice["stop_reason"] = chunk["stop_reason"]
    return {
        **{k: v for k, v in events[0].items() if k not in ("choices", "usage")},
        "choices": [choices[i] for i in sorted(choices)],
        "usage": events[-1]["usage"],
    }


@pytest.mark.asyncio
async def test_a_streamed_completion_joins_into_the_whole_one() -> None:
    texts = {
        (0, 0): ["Hel", "", "lo", " there"],
        (0, 1): ["Bye"],
        (1, 0): ["", "x"],
        (1, 1): ["y", "z", "", "!"],
    }
    body = {"prompt": [PROMPTS[0], PROMPTS[1]], "n": 2, "logprobs": 1, "echo": True,
            "prompt_logprobs": 1}  # fmt: skip

    def answer(stream: bool) -> CompletionAnswer:
        options = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
        req = CompletionRequest.model_validate({**body, **options})
        echoes = ["ECHO0", "ECHO1"]
        return CompletionAnswer(_Context(), req, "cmpl-1", "m", PROMPTS, echoes)  # type: ignore[arg-type]

    steps = _steps(texts, prompt_logprobs=True)
    whole = await _answered(answer(False), steps)
    events = await _answered(answer(True), steps)
    assert _joined_completion(events) == {**whole, "created": events[0]["created"]}
    assert [c["text"] for c in whole["choices"]] == ["ECHO0Hello there", "ECHO0Bye", "ECHO1x",
                                                    "ECHO1yz!"]  # fmt: skip
    first = whole["choices"][0]
    # The echoed prompt's tokens lead the logprobs, its first token unscored.
    assert first["logprobs"]["tokens"][:3] == ["<5>", "<6>", "<7>"]
    assert first["logprobs"]["token_logprobs"][0] is None
    assert len(first["logprobs"]["tokens"]) == 3 + 4
    assert first["prompt_logprobs"][1] == {
        "6": {"logprob": -1.0, "decoded_token": "<6>"},
        "3": {"logprob": -2.0, "decoded_token": "<3>"},
    }
    assert whole["usage"] == {
        "prompt_tokens": 5, "completion_tokens": 11, "total_tokens": 16,
        "prompt_tokens_details": {"cached_tokens": 3 + 3},
    }  # fmt: skip


def _joined_chat(events: list[dict[str, Any]]) -> dict[str, Any]:
    """A streamed chat completion as a client joins its events, tool calls assembled from
    their deltas."""
    choices: dict[int, dict[str, Any]] = {}
    for event in events:
        for chunk in event["choices"]:
            choice = choices.setdefault(
                chunk["index"],
                {"index": chunk["index"], "content": "", "tool_calls": [], "logprobs": []},
            )
            delta = chunk["delta"]
            choice["content"] += delta.get("content", "")
            for call in delta.get("tool_calls", []):
                if "id" in call:
                    assert call["index"] == len(choice["tool_calls"])
                    choice["tool_calls"].append({"id": call["id"], **call["function"]})
                else:
                    choice["tool_calls"][call["index"]]["arguments"] += call["function"][
                        "arguments"
                    ]
            if chunk["logprobs"] is not None:
                choice["logprobs"] += chunk["logprobs"]["content"]
            choice["finish_reason"] = chunk["finish_reason"]
            choice["stop_reason"] = chunk.get("stop_reason")
    return {"choices": [choices[i] for i in sorted(choices)], "usage": events[-1]["usage"]}


@pytest.mark.asyncio
async def test_a_streamed_chat_completion_joins_into_the_whole_one() -> None:
    """Choice 0 calls a tool after some content (the call's text in 3-character pieces), choice
    1 answers in text, a piece of it held back."""
    texts = {(0, 0): _pieces("Checking." + CALL, 3), (0, 1): ["It is", "", " noon."]}
    body = {"messages": [{"role": "user", "content": "time?"}], "tools": [TIME], "n": 2,
            "logprobs": True, "top_logprobs": 1}  # fmt: skip

    def answer(stream: bool) -> ChatAnswer:
        options = {"include_usage": True, "continuous_usage_stats": True}
        req = ChatCompletionRequest.model_validate(
            {**body, "stream": stream, "stream_options": options if stream else None}
        )
        plan = plan_tools(req, ToolSettings(HERMES))
        return ChatAnswer(_Context(), req, plan, "chatcmpl-1", "m", PROMPTS[0])  # type: ignore[arg-type]

    steps = _steps(texts)
    whole = await _answered(answer(False), steps)
    events = await _answered(answer(True), steps)
    assert [c["delta"] for c in events[0]["choices"]] == [{"role": "assistant", "content": ""}] * 2
    joined = _joined_chat(events)
    assert joined["usage"] == whole["usage"] == events[-2]["usage"]
    assert whole["usage"]["completion_tokens"] == len(texts[0, 0]) + 3
    calls = []
    for streamed, choice in zip(joined["choices"], whole["choices"], strict=True):
        message = choice["message"]
        assert streamed["content"] == (message["content"] or "")
        assert streamed["logprobs"] == choice["logprobs"]["content"]
        assert len(streamed["logprobs"]) == len(texts[0, choice["index"]])
        assert (streamed["finish_reason"], streamed["stop_reason"]) == (
            choice["finish_reason"], choice["stop_reason"],
        )  # fmt: skip
        whole_calls = [{"id": c["id"], **c["function"]} for c in message.get("tool_calls", [])]
        # Each answer gives its calls ids of its own.
        assert [{**c, "id": None} for c in streamed["tool_calls"]] == [
            {**c, "id": None} for c in whole_calls
        ]
        calls += whole_calls
    assert whole["choices"][0]["message"]["content"] == "Checking."
    assert whole["choices"][0]["finish_reason"] == "tool_calls"
    assert calls == [{"id": calls[0]["id"], "name": "get_time", "arguments": '{"zone": "UTC"}'}]
    assert whole["choices"][1]["message"] == {"role": "assistant", "content": "It is noon."}


def test_omitted_fields_leave_the_json_and_every_other_none_is_null() -> None:
    def shape(model: Any) -> Any:
        return json.loads(model.model_dump_json())

    assert shape(ChatDelta()) == {}
    assert shape(DeltaToolCall(index=1, function=DeltaFunction(arguments="x"))) == {
        "index": 1, "function": {"arguments": "x"},
    }  # fmt: skip
    assert shape(ChatRoleChoice(index=0, delta=ChatDelta(role="assistant", content=""))) == {
        "index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
        "finish_reason": None,
    }  # fmt: skip
    assert shape(AssistantMessage(content=None)) == {"role": "assistant", "content": None}
    # As Python's json writes it; pydantic's default would be null.
    assert (
        '"logprob":-Infinity'
        in TopLogprob(token="a", logprob=float("-inf"), bytes=[97]).model_dump_json()
    )


def _responses_answer(stream: bool) -> ResponsesAnswer:
    tool = {"type": "function", **TIME["function"]}
    req = ResponsesRequest.model_validate({"input": "time?", "tools": [tool], "stream": stream})
    chat = req.chat_request()
    plan = plan_tools(chat, ToolSettings(HERMES))
    return ResponsesAnswer(_Context(), req, chat, plan, "resp_1", "m", PROMPTS[0])  # type: ignore[arg-type]


def _without_ids(item: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in item.items() if k not in ("id", "call_id")}


@pytest.mark.asyncio
async def test_a_streamed_response_ends_with_the_whole_one() -> None:
    """Text, then a tool call (in 3-character pieces): a message item, then a function_call
    item, each opened, extended and closed by its events."""
    steps = _steps({(0, 0): _pieces("Checking." + CALL, 3)})
    whole = await _answered(_responses_answer(False), steps)
    events = await _answered(_responses_answer(True), steps)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"].removeprefix("response.") for e in events]
    text_deltas = kinds.count("output_text.delta")
    argument_deltas = kinds.count("function_call_arguments.delta")
    assert kinds == [
        "created", "in_progress",
        "output_item.added", "content_part.added", *["output_text.delta"] * text_deltas,
        "output_text.done", "content_part.done", "output_item.done",
        "output_item.added", *["function_call_arguments.delta"] * argument_deltas,
        "function_call_arguments.done", "output_item.done",
        "completed",
    ]  # fmt: skip
    assert text_deltas >= 2 and argument_deltas >= 1
    final = events[-1]["response"]
    assert [_without_ids(i) for i in final["output"]] == [_without_ids(i) for i in whole["output"]]
    assert final["usage"] == whole["usage"] and whole["status"] == "completed"
    message, call = whole["output"]
    assert message["content"][0]["text"] == "Checking."
    assert (call["name"], call["arguments"]) == ("get_time", '{"zone": "UTC"}')
    # The items' ids as their events name them.
    streamed_message, streamed_call = final["output"]
    assert {e["item_id"] for e in events if "item_id" in e} == {
        streamed_message["id"], streamed_call["id"],
    }  # fmt: skip


@pytest.mark.asyncio
async def test_a_failed_stream_ends_with_response_failed() -> None:
    steps = _steps({(0, 0): ["It is", " noon"]})[:1]
    events = await _answered(_responses_answer(True), steps, fails=True)
    last = events[-1]
    assert last["type"] == "response.failed"
    assert last["response"]["status"] == "failed"
    assert last["response"]["error"] == {
        "code": "request_failed",
        "message": "detokenization failed",
    }
