"""The engine's HTTP edge under hostile input (issue 15): parameters at and past their bounds,
malformed JSON, invalid Unicode, odd headers, oversized requests, slow clients, the shutdown
deadline, and the CLI's API key and flag parsing. Every bad request gets a 4xx with OpenAI error
JSON, and the engine stays healthy and serving."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import signal
import socket
import threading
import time
import urllib.error
import urllib.request
from http.client import HTTPResponse

import aiohttp
import pytest
import torch

from kvfleet.engine.async_engine import EngineDeadError, RequestAbortedError, RequestFailedError
from kvfleet.engine.cli import build_parser, server_settings_from
from kvfleet.engine.cli import main as cli_main
from kvfleet.engine.config import EngineArgs
from kvfleet.engine.outputs import CompletionOutput, RequestOutput
from kvfleet.engine.server.settings import API_KEY_ENV, ServerSettings
from kvfleet.engine.server.tools import StreamedChoices
from kvfleet.engine.server.validation import MAX_JSON_ITEMS
from kvfleet.router.fetched_tokenizer import load_bundle
from tests.support.net import free_port, http_call
from tests.support.servers import EngineProcess, engine_server, sse_data_lines

API_KEY = "hostile-key"
MODEL = "tiny"
COMP = "/v1/completions"
CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]
BODY_LIMIT = 16 << 20
HEADER_TIMEOUT = 1.0
BODY_TIMEOUT = 1.0
MAX_WAITING = 64


@pytest.fixture(scope="module")
def server(model_dirs):
    settings = ServerSettings(
        host="127.0.0.1",
        port=0,
        served_model_name=[MODEL],
        api_key=API_KEY,
        max_request_body_bytes=BODY_LIMIT,
        max_waiting_requests=MAX_WAITING,
        header_timeout=HEADER_TIMEOUT,
        body_timeout=BODY_TIMEOUT,
    )
    with engine_server(EngineArgs(model=str(model_dirs["llama"]), dtype="float32"), settings) as s:
        yield s


def http(
    url: str,
    body: bytes | dict | None = None,
    method: str | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, dict, bytes]:
    return http_call(url, body, method, headers, API_KEY)


def assert_openai_error(status: int, raw: bytes, expected: int | tuple[int, ...]) -> dict:
    assert status in (expected if isinstance(expected, tuple) else (expected,)), raw[:500]
    error = json.loads(raw)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and "Traceback" not in error["message"]
    assert 'File "' not in error["message"] and "kvfleet" not in error["message"]
    return error


def assert_still_serving(server) -> None:
    status, _, raw = http(server.url + "/health", method="GET")
    assert status == 200, raw
    status, _, raw = http(server.url + COMP, {"prompt": "fine", "max_tokens": 2})
    assert status == 200 and json.loads(raw)["usage"]["completion_tokens"] == 2, raw
    core = server.srv.engine.core
    deadline = time.monotonic() + 10
    while core.kv_cache_manager.num_free_blocks != core.kv_cache_manager.pool.num_usable_blocks:
        assert time.monotonic() < deadline, "KV blocks leaked"
        time.sleep(0.05)


# -- parameters past their bounds ----------------------------------------------------------

BAD_PARAMS = [
    # (name, path, body, the parameter the error names)
    ("seed 2**64", COMP, {"prompt": "hi", "max_tokens": 4, "seed": 2**64}, "seed"),
    ("seed 2**63", COMP, {"prompt": "hi", "max_tokens": 4, "seed": 2**63}, "seed"),
    ("n 2 seed 2**64-1", COMP, {"prompt": "hi", "max_tokens": 4, "n": 2, "seed": 2**64 - 1},
     "seed"),
    ("chat seed -2**63-1", CHAT, {"messages": MSG, "max_tokens": 4, "seed": -(2**63) - 1},
     "seed"),
    ("top_k 2**63", COMP, {"prompt": "hi", "max_tokens": 4, "top_k": 2**63}, "top_k"),
    ("top_k above vocab", COMP, {"prompt": "hi", "max_tokens": 4, "top_k": 513}, "top_k"),
    ("stop token outside vocab", COMP, {"prompt": "hi", "stop_token_ids": [512]},
     "stop_token_ids"),
    ("token id 2**40", COMP, {"prompt": [5, 2**40]}, "prompt"),
    ("string for int", COMP, {"prompt": "hi", "max_tokens": "16"}, "max_tokens"),
    ("string for bool", COMP, {"prompt": "hi", "echo": "yes"}, "echo"),
    ("true string for bool", CHAT, {"messages": MSG, "stream": "true"}, "stream"),
    ("string for float", COMP, {"prompt": "hi", "temperature": "1"}, "temperature"),
    ("bool for int", COMP, {"prompt": "hi", "n": True}, "n"),
    ("n 129", COMP, {"prompt": "hi", "n": 129}, "n"),
    ("best_of 1000", COMP, {"prompt": "hi", "best_of": 1000}, "best_of"),
    ("repetition penalty huge", CHAT, {"messages": MSG, "repetition_penalty": 1e308},
     "repetition_penalty"),
    ("min_tokens above max_tokens", CHAT, {"messages": MSG, "max_tokens": 2, "min_tokens": 3},
     None),
    ("65 prompts", COMP, {"prompt": ["a"] * 65, "max_tokens": 1}, None),
    ("17 stop strings", COMP, {"prompt": "hi", "stop": [str(i) for i in range(17)]}, None),
    ("stop string too long", COMP, {"prompt": "hi", "stop": "s" * 2000}, "stop"),
    ("template kwargs clash", CHAT, {"messages": MSG, "chat_template_kwargs": {"tokenize": True}},
     "chat_template_kwargs"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("path", "body", "param"), [c[1:] for c in BAD_PARAMS], ids=[c[0] for c in BAD_PARAMS]
)
def test_out_of_bounds_parameters_are_400_and_the_engine_lives(server, path, body, param):
    status, _, raw = http(server.url + path, body)
    error = assert_openai_error(status, raw, 400)
    if param is not None:
        assert error["param"] is not None and error["param"].split(".")[0] == param, error
    assert_still_serving(server)


def test_bounds_still_accept_their_edges(server):
    """The largest legal values are served, not refused."""
    edges = [
        {"prompt": "hi", "max_tokens": 2, "seed": 2**63 - 1, "n": 2},
        {"prompt": "hi", "max_tokens": 2, "seed": -(2**63), "top_k": 512},
        {"prompt": "hi", "max_tokens": 2, "temperature": 2, "presence_penalty": -2},
        {"prompt": [[5, 6]] * 64, "max_tokens": 1},
    ]
    for body in edges:
        status, _, raw = http(server.url + COMP, body)
        assert status == 200, raw


# -- malformed bodies and headers ----------------------------------------------------------

SURROGATE = b'"a\\ud800b"'
MALFORMED = [
    # (name, path, raw body, extra headers, expected status)
    ("lone surrogate in prompt", COMP, b'{"prompt": ' + SURROGATE + b"}", None, 400),
    ("lone surrogate in chat", CHAT,
     b'{"messages": [{"role": "user", "content": ' + SURROGATE + b"}]}", None, 400),
    ("lone surrogate in tokenize", "/tokenize", b'{"prompt": ' + SURROGATE + b"}", None, 400),
    ("lone surrogate in a key", COMP, b'{"prompt": "x", ' + SURROGATE + b": 1}", None, 400),
    ("invalid utf-8", COMP, b'{"prompt": "\xff\xfe"}', None, 400),
    ("nested 100000 deep", COMP, b"[" * 100_000 + b"]" * 100_000, None, 400),
    ("nested in a field", COMP, b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", None, 400),
    ("5000-digit integer", COMP, b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", None,
     400),
    ("5000-digit token id", COMP, b'{"prompt": [' + b"7" * 5000 + b"]}", None, 400),
    ("NaN", COMP, b'{"prompt": "x", "temperature": NaN}', None, 400),
    ("Infinity", COMP, b'{"prompt": "x", "temperature": 1e999}', None, 400),
    ("gzip label on a plain body", COMP, b'{"prompt": "x"}', {"Content-Encoding": "gzip"},
     (400, 415)),
    ("deflate label on detokenize", "/detokenize", b'{"tokens": [5]}',
     {"Content-Encoding": "deflate"}, (400, 415)),
    ("too many values", "/detokenize", b'{"tokens": [' + b"5," * 1_100_000 + b"5]}", None, 400),
]  # fmt: skip


@pytest.mark.parametrize(
    ("path", "body", "headers", "expected"),
    [c[1:] for c in MALFORMED],
    ids=[c[0] for c in MALFORMED],
)
def test_malformed_bodies_are_4xx_json(server, path, body, headers, expected):
    status, _, raw = http(server.url + path, body, headers=headers)
    assert_openai_error(status, raw, expected)
    assert_still_serving(server)


def _raw_request(port: int, head: bytes, body: bytes = b"") -> tuple[int, dict, bytes]:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(head + b"\r\n" + body)
        resp = HTTPResponse(sock)
        resp.begin()
        return resp.status, dict(resp.getheaders()), resp.read()


def _head(path: str, authorization: bytes, body: bytes) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n".encode()
        + b"Authorization: "
        + authorization
        + b"\r\n"
    )


PROTOCOL_ERRORS = [
    # (name, what is sent, status, code)
    ("a path over the request line's limit",
     b"GET /v1/models/" + b"m" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 400, "line_too_long"),
    ("a broken method", b"GE T /health HTTP/1.1\r\nHost: x\r\n\r\n", 400, "malformed_request"),
    ("a header without a colon", b"GET /health HTTP/1.1\r\nHost x\r\n\r\n", 400,
     "malformed_request"),
    ("a NUL in a header", b"GET /health HTTP/1.1\r\nX-A: a\x00b\r\n\r\n", 400,
     "malformed_request"),
    ("two Content-Lengths", b"POST /v1/completions HTTP/1.1\r\nContent-Length: 2\r\n"
     b"Content-Length: 3\r\n\r\n{}", 400, "malformed_request"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("request_bytes", "status", "code"),
    [c[1:] for c in PROTOCOL_ERRORS],
    ids=[c[0] for c in PROTOCOL_ERRORS],
)
def test_requests_aiohttp_cannot_parse_get_openai_json(server, request_bytes, status, code):
    with socket.create_connection(("127.0.0.1", server.srv.port), timeout=10) as sock:
        sock.sendall(request_bytes)
        resp = HTTPResponse(sock)
        resp.begin()
        raw = resp.read()
    assert resp.getheader("Content-Type", "").startswith("application/json"), raw[:200]
    assert assert_openai_error(resp.status, raw, status)["code"] == code
    assert_still_serving(server)


def test_a_body_declared_over_the_limit_is_413_at_once(server):
    """A Content-Length past the body limit is refused before any of the body is read; the
    client that declared 10^18 bytes does not wait for the body timeout."""
    head = (
        f"POST {COMP} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {10**18}\r\n\r\n"
    ).encode()
    with socket.create_connection(
        ("127.0.0.1", server.srv.port), timeout=BODY_TIMEOUT + 10
    ) as sock:
        t = time.monotonic()
        sock.sendall(head + b'{"prompt": ')
        resp = HTTPResponse(sock)
        resp.begin()
        raw = resp.read()
        assert time.monotonic() - t < BODY_TIMEOUT / 2
    error = assert_openai_error(resp.status, raw, 413)
    assert error["code"] == "body_too_large" and error["param"] == "Content-Length"
    assert resp.getheader("Connection") == "close"
    assert_still_serving(server)


def test_api_key_headers(server):
    port = server.srv.port
    body = b'{"prompt": "x", "max_tokens": 1}'
    # Not UTF-8: a wrong key, not a server error.
    status, headers, raw = _raw_request(port, _head(COMP, b"Bearer \xff\xfe", body), body)
    assert assert_openai_error(status, raw, 401)["code"] == "invalid_api_key"
    assert headers["WWW-Authenticate"] == "Bearer"
    for scheme in (b"bearer", b"BEARER", b"Bearer"):
        status, _, raw = _raw_request(
            port, _head(COMP, scheme + b" " + API_KEY.encode(), body), body
        )
        assert status == 200, (scheme, raw)
    for wrong in (b"Basic " + API_KEY.encode(), API_KEY.encode(), b"Bearer", b""):
        status, headers, raw = _raw_request(port, _head(COMP, wrong, body), body)
        assert_openai_error(status, raw, 401)
        assert headers["WWW-Authenticate"] == "Bearer"
    assert_still_serving(server)


def test_the_tokenizer_bundle_is_the_engines_and_behind_the_key(server, model_dirs):
    """GET /tokenizer: 401 without the key; with it, a bundle that a router loads and that
    tokenizes a chat prompt to the ids the engine's /tokenize gives (its chat template included),
    the same bytes on each call, 304 for its ETag."""
    status, _, raw = http_call(server.url + "/tokenizer", method="GET")
    assert assert_openai_error(status, raw, 401)["code"] == "invalid_api_key"
    status, headers, raw = http(server.url + "/tokenizer", method="GET")
    assert status == 200 and headers["Content-Type"].startswith("application/json")
    assert "tokenizer.json" in json.loads(raw)["files"]
    assert str(model_dirs["llama"]) not in raw.decode()
    tokenizer = load_bundle(raw, None)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi, héllo!"}]
    status, _, tokenized = http(server.url + "/tokenize", {"model": MODEL, "messages": msgs})
    assert status == 200
    assert tokenizer.chat(msgs, True, None) == json.loads(tokenized)["tokens"]
    assert tokenizer.text("plain text") == server.srv.engine.tokenizer("plain text").input_ids
    assert http(server.url + "/tokenizer", method="GET")[2] == raw
    # A router asking whether it is still the same gets no body.
    etag = {"If-None-Match": headers["ETag"]}
    assert http(server.url + "/tokenizer", method="GET", headers=etag)[0] == 304


def test_models_do_not_show_the_model_path(server, model_dirs):
    status, _, raw = http(server.url + "/v1/models", method="GET")
    assert status == 200
    assert str(model_dirs["llama"]) not in raw.decode()
    assert json.loads(raw)["data"][0]["root"] == MODEL


def test_chat_template_errors_are_clean(server):
    tokenizer = server.srv.engine.core.tokenizer
    saved = tokenizer.chat_template
    try:
        tokenizer.chat_template = "{{ raise_exception('Conversation roles must alternate') }}"
        status, _, raw = http(server.url + CHAT, {"messages": MSG, "max_tokens": 2})
        error = assert_openai_error(status, raw, 400)
        assert "Conversation roles must alternate" in error["message"]
        # A template that breaks on its own internals says nothing of them.
        tokenizer.chat_template = "{{ messages[0]['content'].frobnicate() }}"
        for path in (CHAT, "/tokenize"):
            status, _, raw = http(server.url + path, {"messages": MSG})
            error = assert_openai_error(status, raw, 400)
            assert "frobnicate" not in error["message"] and "object" not in error["message"]
    finally:
        tokenizer.chat_template = saved
    assert_still_serving(server)


# -- JSON inside strings (issue 35) --------------------------------------------------------

# Valid JSON, a thousand levels deep: json.loads on it recurses past Python's limit.
DEEP_TEXT = '{"a": ' * 1000 + "1" + "}" * 1000


def _with_arguments(arguments: str) -> list[dict]:
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    return [*MSG, {"role": "assistant", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "1"}]  # fmt: skip


ARGUMENTS = "messages.1.tool_calls.0.function.arguments"
NESTED_TEXTS = [
    # (name, path, body, the parameter the error names)
    ("schema text", CHAT, {"messages": MSG, "structured_outputs": {"json": DEEP_TEXT}},
     "structured_outputs.json"),
    ("schema text on completions", COMP,
     {"prompt": "hi", "structured_outputs": {"json": DEEP_TEXT}}, "structured_outputs.json"),
    ("structural tag text", CHAT,
     {"messages": MSG, "structured_outputs": {"structural_tag": DEEP_TEXT}},
     "structured_outputs.structural_tag"),
    ("tool call arguments", CHAT, {"messages": _with_arguments(DEEP_TEXT)}, ARGUMENTS),
    ("tool call arguments on /tokenize", "/tokenize",
     {"messages": _with_arguments(DEEP_TEXT)}, ARGUMENTS),
    ("tool call arguments with tools", CHAT,
     {"messages": _with_arguments(DEEP_TEXT),
      "tools": [{"type": "function", "function": {"name": "f"}}]}, ARGUMENTS),
    ("a lone surrogate escaped in the arguments", CHAT,
     {"messages": _with_arguments('{"a": "\\ud800"}')}, ARGUMENTS),
    ("too many values in the arguments", CHAT,
     {"messages": _with_arguments("[" + "0," * (MAX_JSON_ITEMS + 1) + "0]")}, ARGUMENTS),
]  # fmt: skip


@pytest.mark.parametrize(
    ("path", "body", "param"), [c[1:] for c in NESTED_TEXTS], ids=[c[0] for c in NESTED_TEXTS]
)
def test_json_inside_strings_is_bounded_as_a_body_is(server, path, body, param):
    """A JSON text a request holds in a string is parsed under the body's bounds: a 400 naming
    the field, never a RecursionError's 500."""
    status, _, raw = http(server.url + path, body)
    error = assert_openai_error(status, raw, 400)
    assert error["param"] == param, error
    assert_still_serving(server)


def test_a_huge_schema_text_is_refused_by_its_length(server):
    text = json.dumps({"type": "object", "description": "x" * (15 << 20)})
    t = time.monotonic()
    status, _, raw = http(
        server.url + CHAT, {"messages": MSG, "structured_outputs": {"json": text}}
    )
    error = assert_openai_error(status, raw, 400)
    assert error["param"] == "structured_outputs.json" and "characters" in error["message"]
    assert time.monotonic() - t < 5


def _model_writes(monkeypatch, server, text: str) -> None:
    """The engine's next request generates `text` (in pieces of 7 characters), whatever it is
    asked: what a model may write, without waiting for one to write it."""

    async def generate(request_id, request, ready=None):
        pieces = [text[i : i + 7] for i in range(0, len(text), 7)]
        for k, piece in enumerate(pieces):
            last = k == len(pieces) - 1
            choice = CompletionOutput(0, piece, [5], finish_reason="stop" if last else None)
            yield RequestOutput(request_id, request.prompt_token_ids, [choice], finished=last)

    monkeypatch.setattr(server.srv.engine, "generate", generate)


DEEP_CALL = (
    '<tool_call>{"name": "f", "arguments": {"a": ' + "[" * 1000 + "]" * 1000 + "}}</tool_call>"
)
TOOLS_F = [{"type": "function", "function": {"name": "f"}}]


def test_a_call_the_model_nests_too_deep_stays_content(server, monkeypatch):
    """Arguments nested past a request body's bound are no call (as vLLM leaves an unparsable
    call): the whole text is the message's content, streamed or not."""
    _model_writes(monkeypatch, server, DEEP_CALL)
    body = {"messages": MSG, "tools": TOOLS_F, "max_tokens": 8}
    status, _, raw = http(server.url + CHAT, body)
    assert status == 200, raw[:300]
    message = json.loads(raw)["choices"][0]["message"]
    assert message["content"] == DEEP_CALL and not message.get("tool_calls")
    status, _, raw = http(server.url + CHAT, {**body, "stream": True})
    events = [line[6:] for line in raw.decode().splitlines() if line.startswith("data: ")]
    assert status == 200 and events[-1] == "[DONE]", events[-3:]
    assert not any(json.loads(e).get("error") for e in events[:-1])
    monkeypatch.undo()
    assert_still_serving(server)


def test_a_stream_the_server_fails_on_ends_with_an_error_event_and_done(server, monkeypatch):
    def broken(self, choice):
        raise RuntimeError("a bug in the output path")

    monkeypatch.setattr(StreamedChoices, "delta", broken)
    status, _, raw = http(server.url + CHAT, {"messages": MSG, "max_tokens": 4, "stream": True})
    events = [line[6:] for line in raw.decode().splitlines() if line.startswith("data: ")]
    assert status == 200 and events[-1] == "[DONE]", events[-3:]
    error = json.loads(events[-2])["error"]
    assert error["code"] is None and error["type"] == "server_error"
    assert "bug" not in error["message"]
    monkeypatch.undo()
    assert_still_serving(server)


# -- schemas: what the grammar follows (issue 35) ------------------------------------------


def _tool(parameters: dict) -> dict:
    return {"type": "function", "function": {"name": "f", "parameters": parameters}}


def _json_schema(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}


NEGATIVE_MULTIPLE = {"type": "object", "properties": {"n": {"type": "number", "multipleOf": -1}}}
EXTENSION = {"type": "object", "properties": {"n": {"type": "number", "x-unit": "kg"}}}
BAD_SCHEMAS = [
    # (name, body, the parameter the error names, the keyword's pointer)
    ("multipleOf -1", {"response_format": _json_schema(NEGATIVE_MULTIPLE)}, "response_format",
     "/properties/n/multipleOf"),
    ("an x- keyword", {"structured_outputs": {"json": EXTENSION}}, "structured_outputs",
     "/properties/n/x-unit"),
    ("x-guidance", {"structured_outputs": {"json": {"type": "object", "x-guidance": {
        "lenient": True}, "not": {}}}}, "structured_outputs", "/x-guidance"),
    ("required with multipleOf -1", {"tools": [_tool(NEGATIVE_MULTIPLE)],
     "tool_choice": "required"}, "tools.0.function.parameters", "/properties/n/multipleOf"),
    ("named with an x- keyword", {"tools": [_tool(EXTENSION)], "tool_choice": {
        "type": "function", "function": {"name": "f"}}}, "tools.0.function.parameters",
     "/properties/n/x-unit"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("body", "param", "where"), [c[1:] for c in BAD_SCHEMAS], ids=[c[0] for c in BAD_SCHEMAS]
)
def test_schema_keywords_the_grammar_would_not_follow_are_400s(server, body, param, where):
    status, _, raw = http(server.url + CHAT, {"messages": MSG, "max_tokens": 4, **body})
    error = assert_openai_error(status, raw, 400)
    assert error["param"] == param and where in error["message"], error
    assert_still_serving(server)


def test_a_forced_call_resolves_a_tools_own_definitions(server):
    """A tool whose parameters define what they use ($defs) is called under tool_choice
    required as under its name: each tool's references resolve against its own parameters."""
    parameters = {
        "type": "object",
        "$defs": {"city": {"type": "string", "maxLength": 8}},
        "properties": {"city": {"$ref": "#/$defs/city"}},
        "required": ["city"],
        "additionalProperties": False,
    }
    for choice in ("required", {"type": "function", "function": {"name": "f"}}):
        body = {"messages": MSG, "max_tokens": 200, "seed": 1, "tools": [_tool(parameters)],
                "tool_choice": choice}  # fmt: skip
        status, _, raw = http(server.url + CHAT, body)
        assert status == 200, raw[:300]
        message = json.loads(raw)["choices"][0]["message"]
        if message.get("tool_calls"):  # a random model may run out of tokens first
            arguments = json.loads(message["tool_calls"][0]["function"]["arguments"])
            assert isinstance(arguments["city"], str) and len(arguments["city"]) <= 8


# -- size: nothing heavy on the event loop -------------------------------------------------


def _health_latencies(url: str, stop: threading.Event, out: list[float]) -> None:
    """Seconds each /health probe took until stop; a probe that failed or timed out counts as
    forever (the prober goes on: a stalled server must fail the test, not end the probing)."""
    while not stop.is_set():
        t = time.perf_counter()
        try:
            with urllib.request.urlopen(url + "/health", timeout=10) as resp:
                ok = resp.status == 200
        except OSError:
            ok = False
        out.append(time.perf_counter() - t if ok else math.inf)
        time.sleep(0.01)


def test_health_answers_fast_while_maximal_requests_are_admitted(model_dirs):
    """Bodies at the size limit (text, token ids, chat, /tokenize) are refused by their size
    without holding the event loop: /health, probed all along, answers within 100 ms (all but
    one probe). The server runs in a process of its own, so that only its own work competes for
    its GIL."""
    text = "hello world " * ((BODY_LIMIT - 4096) // 12)
    cases = [
        (COMP, {"prompt": text, "max_tokens": 1}),
        (COMP, {"prompt": [5] * (MAX_JSON_ITEMS - 1), "max_tokens": 1}),
        (CHAT, {"messages": [{"role": "user", "content": text}]}),
        ("/tokenize", {"prompt": text}),
    ]
    bodies = [(path, json.dumps(body).encode()) for path, body in cases]
    assert all(len(raw) <= BODY_LIMIT for _, raw in bodies)
    with _serve_process(model_dirs, free_port(), []) as url:
        http(url + "/health", method="GET")  # warm
        stop = threading.Event()
        latencies: list[float] = []
        prober = threading.Thread(target=_health_latencies, args=(url, stop, latencies))
        prober.start()
        try:
            time.sleep(0.1)
            t = time.perf_counter()
            results = [http(url + path, raw) for path, raw in bodies for _ in range(2)]
            elapsed = time.perf_counter() - t
        finally:
            stop.set()
            prober.join()
    for status, _, raw in results:
        error = assert_openai_error(status, raw, 400)
        assert error["code"] == "context_length_exceeded", error
    assert elapsed < 30
    assert len(latencies) >= 10
    # A body parsed or tokenized on the loop stalls it once per request, eight times over; one
    # probe late alone is the machine (a 2-core CI box building images beside the suite).
    assert sum(latency >= 0.1 for latency in latencies) <= 1, sorted(latencies)[-5:]


def test_health_answers_fast_while_big_tool_arguments_are_parsed(model_dirs):
    """Requests whose strings hold JSON at the body's size, six at a time: tool calls'
    arguments (too many values; one long string, which parses and renders, then is too long
    for the context; many calls) and a schema's text. The server parses them off the event
    loop, one at a time and within bounds, so /health, probed all along, answers within 0.5 s
    (parsed on the loop, one such request stalled it for a second)."""
    room = BODY_LIMIT - 4096
    many_values = "[" + "[], " * (room // 4) + "[]]"  # past MAX_JSON_ITEMS: refused
    long_string = json.dumps({"code": "x" * room})  # parsed; the prompt cannot fit
    calls = [
        {"id": f"call_{i}", "type": "function",
         "function": {"name": "f", "arguments": json.dumps({"v": [1] * 400, "s": "y" * 20_000})}}
        for i in range(room // 22_000)
    ]  # fmt: skip
    schema_text = json.dumps({"type": "object", "description": "[{" * (room // 2)})
    cases = [
        {"messages": _with_arguments(many_values)},
        {"messages": _with_arguments(long_string), "tools": TOOLS_F},
        {"messages": [*MSG, {"role": "assistant", "tool_calls": calls}]},
        {"messages": MSG, "structured_outputs": {"json": schema_text}},
    ]
    bodies = [json.dumps(body).encode() for body in cases]
    assert all(BODY_LIMIT * 0.9 < len(raw) <= BODY_LIMIT for raw in bodies), [
        len(b) for b in bodies
    ]
    with _serve_process(model_dirs, free_port(), []) as url:
        http(url + "/health", method="GET")  # warm
        stop = threading.Event()
        latencies: list[float] = []
        prober = threading.Thread(target=_health_latencies, args=(url, stop, latencies))
        prober.start()
        results: list[tuple[int, dict, bytes]] = []

        def send(raw: bytes) -> None:
            results.append(http(url + CHAT, raw))

        try:
            time.sleep(0.1)
            for raw in bodies:
                senders = [threading.Thread(target=send, args=(raw,)) for _ in range(6)]
                for t in senders:
                    t.start()
                for t in senders:
                    t.join(120)
        finally:
            stop.set()
            prober.join()
    assert len(results) == 6 * len(bodies)
    for status, _, raw in results:
        assert_openai_error(status, raw, 400)
    assert len(latencies) >= 10
    assert max(latencies) < 0.5, sorted(latencies)[-5:]


# -- admission counts sequences ------------------------------------------------------------


def test_prompts_times_n_beyond_the_queue_is_400_at_once(server):
    body = {"prompt": [[5, 6, 7]] * 64, "n": 10, "max_tokens": 400, "ignore_eos": True}
    t = time.monotonic()
    status, _, raw = http(server.url + COMP, body)
    error = assert_openai_error(status, raw, 400)
    assert time.monotonic() - t < 5
    assert str(MAX_WAITING) in error["message"] and "640" in error["message"]
    assert server.srv.engine.num_waiting_sequences == 0
    assert server.srv.engine.core.num_requests == 0
    assert_still_serving(server)


def test_queue_full_counts_the_sequences_of_each_request(server):
    engine = server.srv.engine
    engine.fault_stall.set()  # nothing gets scheduled: the queue fills
    try:
        blocker = threading.Thread(
            target=http, args=(server.url + COMP, {"prompt": [[5]] * 30, "n": 2, "max_tokens": 2})
        )
        blocker.start()
        deadline = time.monotonic() + 10
        while engine.num_waiting_sequences < 60:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        # 60 waiting + 5 > 64: refused; 60 + 4 fits.
        status, headers, raw = http(server.url + CHAT, {"messages": MSG, "n": 5})
        assert assert_openai_error(status, raw, 429)["code"] == "queue_full"
        assert headers["Retry-After"]
        fits = threading.Thread(
            target=http, args=(server.url + CHAT, {"messages": MSG, "n": 4, "max_tokens": 2})
        )
        fits.start()
        while engine.num_waiting_sequences < 64:
            assert time.monotonic() < deadline
            time.sleep(0.02)
    finally:
        engine.fault_stall.clear()
    blocker.join(60)
    fits.join(60)
    assert_still_serving(server)


# -- slow clients --------------------------------------------------------------------------


def _closed_within(sock: socket.socket, seconds: float) -> float:
    """Seconds until the server closed the connection (it may answer first)."""
    sock.settimeout(seconds)
    t = time.monotonic()
    while True:
        data = sock.recv(65536)
        if not data:
            return time.monotonic() - t


def test_half_a_request_line_is_closed_after_the_header_timeout(server):
    with socket.create_connection(("127.0.0.1", server.srv.port)) as sock:
        sock.sendall(b"POST /v1/compl")
        assert _closed_within(sock, HEADER_TIMEOUT + 5) < HEADER_TIMEOUT + 2
    with socket.create_connection(("127.0.0.1", server.srv.port)) as sock:
        # Headers trickled one byte at a time never complete in time either.
        head = _head(COMP, f"Bearer {API_KEY}".encode(), b"{}")
        t = time.monotonic()
        try:
            for byte in head:
                sock.sendall(bytes([byte]))
                time.sleep(0.05)
        except OSError:
            pass
        assert time.monotonic() - t < HEADER_TIMEOUT + 2
        assert _closed_within(sock, HEADER_TIMEOUT + 5) < HEADER_TIMEOUT + 2
    assert_still_serving(server)


def test_idle_keep_alive_connections_are_closed(server):
    with socket.create_connection(("127.0.0.1", server.srv.port)) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert b"200" in sock.recv(65536)
        assert _closed_within(sock, HEADER_TIMEOUT + 5) < HEADER_TIMEOUT + 2


def test_a_body_sent_too_slowly_gets_408(server):
    body = json.dumps({"prompt": "x", "max_tokens": 1}).encode()
    head = (
        f"POST {COMP} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", server.srv.port)) as sock:
        sock.sendall(head + body[:5])
        sock.settimeout(BODY_TIMEOUT + 5)
        t = time.monotonic()
        reply = sock.recv(65536)
        assert time.monotonic() - t < BODY_TIMEOUT + 1
        # Then the connection is closed: the rest of the body is not waited for long.
        reply += sock.recv(65536)
        assert _closed_within(sock, 5) < 3
    status_line, _, rest = reply.partition(b"\r\n")
    assert b" 408 " in status_line, reply
    error = json.loads(rest.partition(b"\r\n\r\n")[2])["error"]
    assert error["code"] == "body_timeout"


def test_long_streams_outlive_the_header_timeout(server):
    async def main() -> list[bytes]:
        async with aiohttp.ClientSession() as session:
            body = {"prompt": "go", "max_tokens": 300, "ignore_eos": True, "stream": True}
            headers = {"Authorization": f"Bearer {API_KEY}"}
            async with session.post(server.url + COMP, json=body, headers=headers) as resp:
                lines = [line async for line in resp.content if line.startswith(b"data: ")]
                return lines

    server.srv.engine.fault_stall.set()
    threading.Timer(HEADER_TIMEOUT + 0.5, server.srv.engine.fault_stall.clear).start()
    lines = asyncio.run(main())
    assert lines[-1].strip() == b"data: [DONE]"


# -- the CLI -------------------------------------------------------------------------------


def test_api_key_from_flag_file_or_environment(tmp_path, monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    parser = build_parser()

    def key(*argv: str) -> str | None:
        return server_settings_from(parser.parse_args(["serve", *argv])).api_key

    assert key() is None
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert key() == "from-env"
    key_file = tmp_path / "key"
    key_file.write_text("from-file\n")
    assert key("--api-key-file", str(key_file)) == "from-file"
    assert key("--api-key", "from-flag", "--api-key-file", str(key_file)) == "from-flag"
    key_file.write_text("")
    with pytest.raises(ValueError, match="empty"):
        key("--api-key-file", str(key_file))


@pytest.mark.parametrize("argv", [["--api", "k"], ["--hos", "0.0.0.0"], ["--por", "9999"]])
def test_flag_abbreviations_are_errors(argv):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["serve", *argv])
    assert exc.value.code == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_a_settings_error_is_one_line(model_dirs, caplog):
    """--device cuda without a GPU: what is wrong, in one line, not a validation dump."""
    argv = ["generate", "--prompt", "hi", "--model", str(model_dirs["llama"]), "--device", "cuda"]
    with caplog.at_level(logging.ERROR, logger="kvfleet.engine"):
        assert cli_main(argv) == 2
    (record,) = [r for r in caplog.records if r.levelno >= logging.ERROR]
    message = record.getMessage()
    assert "\n" not in message and "no CUDA device" in message, message
    assert "pydantic" not in message and "validation error" not in message


def test_api_key_from_environment_guards_a_live_server(model_dirs):
    """The variable the operator sets, end to end: no key on the command line."""
    port = free_port()
    env = {**os.environ, API_KEY_ENV: "env-secret", "PYTHONUNBUFFERED": "1"}
    with _serve_process(model_dirs, port, [], env) as url:
        status, headers, _ = http(url + "/v1/models", method="GET", headers={"Authorization": ""})
        assert status == 401 and headers["WWW-Authenticate"] == "Bearer"
        status, _, _ = http(
            url + "/v1/models", method="GET", headers={"Authorization": "bearer env-secret"}
        )
        assert status == 200


# -- the shutdown deadline -----------------------------------------------------------------


def _serve_process(model_dirs, port: int, extra: list[str], env: dict | None = None):
    return EngineProcess(model_dirs["llama"], port, extra, MODEL, env)


def test_shutdown_deadline_aborts_streams_and_exits_0(model_dirs):
    port = free_port()
    server = _serve_process(model_dirs, port, ["--shutdown-timeout", "2"])
    with server as url:
        proc = server.proc
        assert proc is not None and proc.stdout is not None

        async def stream(session: aiohttp.ClientSession, started: asyncio.Event) -> list[str]:
            body = {"prompt": "go", "max_tokens": 1000, "ignore_eos": True, "stream": True}
            return await sse_data_lines(session, url + COMP, body, started)

        async def main() -> tuple[float, list[list[str]]]:
            async with aiohttp.ClientSession() as session:
                started = [asyncio.Event() for _ in range(10)]
                tasks = [asyncio.create_task(stream(session, e)) for e in started]
                await asyncio.gather(*(e.wait() for e in started))
                # The tiny model on CPU would need far longer than 2 s for 1000 tokens x 10.
                proc.send_signal(signal.SIGTERM)
                t = time.monotonic()
                return t, await asyncio.gather(*tasks)

        sent_at, streams = asyncio.run(main())
        for lines in streams:
            events = [json.loads(x[6:]) for x in lines if x != "data: [DONE]"]
            assert "error" in events[-1], lines[-3:]
            assert events[-1]["error"]["code"] == "draining"
            assert len(events) < 1000
        assert proc.wait(30) == 0
        assert time.monotonic() - sent_at < 10
        log = proc.stdout.read().decode()
        assert "aborting 10 requests" in log and "Traceback" not in log


# -- errors from the engine ----------------------------------------------------------------

ENGINE_FAILURES = [
    # (exception, status, code, Retry-After expected)
    (RequestFailedError("sampling failed for this request"), 500, "request_failed", False),
    (RequestAbortedError("the server is shutting down"), 503, "draining", True),
    (EngineDeadError("the engine loop died: device lost"), 503, "engine_dead", False),
]


@pytest.mark.parametrize(
    ("error", "status", "code", "retry"), ENGINE_FAILURES, ids=[c[2] for c in ENGINE_FAILURES]
)
def test_engine_errors_map_to_their_codes(server, monkeypatch, error, status, code, retry):
    async def failing(*args, **kwargs):
        raise error
        yield  # an async generator, as AsyncEngine.generate is

    monkeypatch.setattr(server.srv.engine, "generate", failing)
    for path, body in ((COMP, {"prompt": "x"}), (CHAT, {"messages": MSG})):
        got, headers, raw = http(server.url + path, body)
        assert assert_openai_error(got, raw, status)["code"] == code
        assert ("Retry-After" in headers) == retry
        got, _, raw = http(server.url + path, {**body, "stream": True})
        assert got == 200
        events = [line[6:] for line in raw.decode().splitlines() if line.startswith("data: ")]
        error_event = json.loads(next(e for e in events if e.startswith('{"error"')))["error"]
        assert error_event["code"] == code and "Traceback" not in error_event["message"]
    monkeypatch.undo()
    assert_still_serving(server)
