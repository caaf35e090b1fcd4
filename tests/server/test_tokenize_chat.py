"""/tokenize's chat form counts a prompt as /v1/chat/completions renders it: with tools (written
into the system message for the default model's ChatML template, which reads none), tool calls and
results in the history, add_generation_prompt and chat_template_kwargs; the tools are checked as
chat checks them, with the same 400s."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvfleet.router.fetched_tokenizer import load_bundle
from kvfleet.router.prompt_tokenizer import EngineTokenizer
from kvfleet.router.routing_key import prompt_tokens
from tests.support.json_schemas import WEATHER_TOOL
from tests.support.net import http_call
from tests.support.servers import DEFAULT_SERVED_NAME

MODEL = DEFAULT_SERVED_NAME
WEATHER = WEATHER_TOOL
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}  # fmt: skip
HISTORY = [
    *QUESTION,
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
]


@pytest.fixture(scope="module")
def url(default_server):
    return default_server.url


def _post(url: str, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    status, _, raw = http_call(url + path, body)
    return status, json.loads(raw)


def _prompt_tokens(url: str, body: dict[str, Any]) -> int:
    status, resp = _post(url, "/v1/chat/completions", {"model": MODEL, "max_tokens": 1, **body})
    assert status == 200, resp
    return resp["usage"]["prompt_tokens"]


def _count(url: str, body: dict[str, Any]) -> int:
    status, resp = _post(url, "/tokenize", {"model": MODEL, **body})
    assert status == 200, resp
    assert resp["count"] == len(resp["tokens"])
    return resp["count"]


@pytest.mark.parametrize(
    "body",
    [
        {"messages": QUESTION, "tools": [WEATHER]},
        {"messages": HISTORY, "tools": [WEATHER]},
        {"messages": HISTORY},
        {"messages": QUESTION, "tools": [WEATHER], "add_generation_prompt": False},
        {"messages": QUESTION, "chat_template_kwargs": {"enable_thinking": False}},
    ],
    ids=["tools", "tools and history", "history alone", "no generation prompt", "kwargs"],
)
def test_the_count_is_chats_prompt_tokens(url: str, body: dict[str, Any]) -> None:
    assert _count(url, body) == _prompt_tokens(url, body)


def test_tools_add_their_tokens(url: str) -> None:
    plain = _count(url, {"messages": QUESTION})
    with_tools = _count(url, {"messages": QUESTION, "tools": [WEATHER]})
    # The tool's description and schema are in the prompt.
    assert with_tools > plain + 20


BAD = [
    ("tool without function", {"tools": [{"type": "function"}]}),
    ("bad function name", {"tools": [{"type": "function", "function": {"name": "a b"}}]}),
    ("parameters not an object schema", {"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "string"}}}]}),
    ("duplicate names", {"tools": [WEATHER, WEATHER]}),
    ("tool message answering nothing",
     {"messages": [*QUESTION, {"role": "tool", "tool_call_id": "call_x", "content": "1"}]}),
    ("arguments not JSON", {"messages": [*QUESTION, {"role": "assistant", "tool_calls": [
        {**CALL, "function": {"name": "f", "arguments": "{oops"}}]}]}),
    ("kwargs setting a template argument", {"chat_template_kwargs": {"tokenize": True}}),
]  # fmt: skip


@pytest.mark.parametrize("body", [c[1] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_tools_are_chats_400s(url: str, body: dict[str, Any]) -> None:
    body = {"model": MODEL, "messages": QUESTION, **body}
    status, tokenize = _post(url, "/tokenize", body)
    chat_status, chat = _post(url, "/v1/chat/completions", {**body, "max_tokens": 1})
    assert status == chat_status == 400, tokenize
    assert tokenize["error"] == chat["error"]


def test_tools_need_messages(url: str) -> None:
    for extra in ({"tools": [WEATHER]}, {"chat_template_kwargs": {}}):
        status, resp = _post(url, "/tokenize", {"model": MODEL, "prompt": "hi", **extra})
        assert status == 400
        assert "tools and chat_template_kwargs go with messages" in resp["error"]["message"]


@pytest.fixture(scope="module")
def router_tokenizer(url: str) -> EngineTokenizer:
    """The engine's tokenizer as a router fetches it (GET /tokenizer)."""
    status, _, raw = http_call(url + "/tokenizer", method="GET")
    assert status == 200
    return load_bundle(raw, None)


def test_a_gguf_models_tokenizer_is_served_as_the_engine_built_it(url, router_tokenizer):
    """The default model is a GGUF file: the engine builds an HF tokenizer from it, and
    GET /tokenizer serves that one, chat template included, for a router to tokenize alike."""
    chat = [{"role": "system", "content": "Be brief."}, *QUESTION]
    status, resp = _post(url, "/tokenize", {"model": MODEL, "messages": chat})
    assert status == 200, resp
    assert router_tokenizer.chat(chat, True, None) == resp["tokens"]


def test_an_agents_request_tokenizes_in_the_router_as_the_engine_prefills_it(
    url: str, router_tokenizer: EngineTokenizer
) -> None:
    """Tools, an assistant's tool_calls and a tool's result: the router's prompt tokens (its
    precise scoring's blocks) are the engine's, the tools written into the system message in
    the format of the engine's parser family, which the bundle names."""
    body = {"messages": [{"role": "system", "content": "Be brief."}, *HISTORY], "tools": [WEATHER]}
    status, resp = _post(url, "/tokenize", {"model": MODEL, **body})
    assert status == 200, resp
    assert prompt_tokens(body, router_tokenizer) == resp["tokens"]
