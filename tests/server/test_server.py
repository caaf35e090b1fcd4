"""The HTTP server, live on a free port: the official openai client end to end, a battery of bad
inputs, clients that hang up, health under a wedged engine loop, graceful SIGTERM."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import aiohttp
import openai
import pytest
from openai import OpenAI

from kvfleet.engine.config import EngineArgs
from kvfleet.engine.server.app import ServerSettings
from kvfleet.engine.server.serving import SERVING
from tests.support.net import free_port, http_call
from tests.support.servers import (
    EngineProcess,
    assert_engine_idle,
    engine_server,
    metric,
    sse_data_lines,
)

API_KEY = "test-key"
MODEL = "tiny"


@pytest.fixture(scope="module")
def server(model_dirs):
    settings = ServerSettings(
        host="127.0.0.1",
        port=0,
        served_model_name=[MODEL, "tiny-alias"],
        api_key=API_KEY,
        max_request_body_bytes=64 * 1024,
        health_stall_timeout=1.0,
    )
    with engine_server(EngineArgs(model=str(model_dirs["llama"]), dtype="float32"), settings) as s:
        yield s


@pytest.fixture
def client(server) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def http(
    url: str,
    body: bytes | dict | None = None,
    method: str | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, dict, dict]:
    status, hdrs, raw = http_call(url, body, method, headers, API_KEY)
    if status >= 400:
        return status, hdrs, json.loads(raw) if raw else {}
    return status, hdrs, json.loads(raw or b"null")


def _metric_or_zero(server, series: str) -> float:
    with urllib.request.urlopen(server.url + "/metrics", timeout=10) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith(series + "}"):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_cached_prefix_blocks_are_exported_and_outlive_their_request(client, server):
    """The gauge the operator weighs to keep warm engines on scale-down: a finished request's full
    prompt blocks stay cached (and counted) after it ends."""
    before = metric(server, "kvfleet_engine_prefix_cache_blocks")
    # 64 tokens no other test sends: four full 16-token blocks.
    client.completions.create(model=MODEL, prompt=list(range(400, 464)), max_tokens=1)
    assert_engine_idle(server)
    assert metric(server, "kvfleet_engine_prefix_cache_blocks") >= before + 4


# -- the official client -------------------------------------------------------------------


def test_chat_stream_equals_non_stream(client, server):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    full = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=20, temperature=0
    )
    assert full.object == "chat.completion"
    assert full.choices[0].message.role == "assistant"
    assert full.usage.completion_tokens == 20 or full.choices[0].finish_reason == "stop"
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=20,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert_engine_idle(server)


def test_completion_stream_equals_non_stream(client, server):
    full = client.completions.create(
        model=MODEL, prompt="the weather", max_tokens=24, temperature=0
    )
    stream = client.completions.create(
        model=MODEL,
        prompt="the weather",
        max_tokens=24,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens == 24
    # A list of prompts, token ids among them; echo prepends the prompt text.
    multi = client.completions.create(
        model="tiny-alias", prompt=[[5, 6, 7, 8], [9, 10]], max_tokens=3, temperature=0
    )
    assert sorted(c.index for c in multi.choices) == [0, 1]
    echoed = client.completions.create(
        model=MODEL, prompt="the weather", max_tokens=24, temperature=0, echo=True
    )
    assert echoed.choices[0].text == "the weather" + full.choices[0].text
    assert_engine_idle(server)


def test_n_with_seed_is_reproducible(client):
    def run():
        return client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "tell a story"}],
            max_tokens=12,
            n=3,
            seed=42,
            temperature=1.0,
        )

    a, b = run(), run()
    texts = [c.message.content for c in sorted(a.choices, key=lambda c: c.index)]
    assert [c.index for c in sorted(a.choices, key=lambda c: c.index)] == [0, 1, 2]
    assert texts == [c.message.content for c in sorted(b.choices, key=lambda c: c.index)]
    assert len(set(texts)) > 1
    assert a.usage.completion_tokens == 36


def test_logprobs(client):
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 6
    for entry in content:
        assert entry.logprob <= 0
        assert len(entry.top_logprobs) == 3
        # Greedy: the chosen token is the most likely one.
        assert entry.logprob == pytest.approx(max(t.logprob for t in entry.top_logprobs))
    comp = client.completions.create(
        model=MODEL, prompt="hello", max_tokens=5, temperature=0, logprobs=2
    )
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert all(
        b - a == len(t)
        for a, b, t in zip(lp.text_offset, lp.text_offset[1:], lp.tokens, strict=False)
    )


def test_stop_strings(client):
    base = client.completions.create(model=MODEL, prompt="cooking", max_tokens=40, temperature=0)
    text = base.choices[0].text
    stop = text[10:13]
    cut = client.completions.create(
        model=MODEL, prompt="cooking", max_tokens=40, temperature=0, stop=[stop]
    )
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    streamed = client.completions.create(
        model=MODEL, prompt="cooking", max_tokens=40, temperature=0, stop=stop, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == cut.choices[0].text


def test_models_tokenize_detokenize(server):
    status, _, body = http(server.url + "/v1/models", method="GET")
    assert status == 200 and [m["id"] for m in body["data"]] == [MODEL, "tiny-alias"]
    plain = {"prompt": "hello world", "add_special_tokens": False}
    status, _, tok = http(server.url + "/tokenize", plain)
    assert status == 200 and tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == 1024
    status, _, detok = http(server.url + "/detokenize", {"tokens": tok["tokens"]})
    assert status == 200 and detok["prompt"] == "hello world"
    status, _, chat = http(
        server.url + "/tokenize", {"messages": [{"role": "user", "content": "x"}]}
    )
    assert status == 200 and chat["count"] > tok["count"] - 2


def test_the_sdk_retrieves_each_served_model_and_404s_others(client, server):
    for name in (MODEL, "tiny-alias"):
        card = client.models.retrieve(name)
        assert (card.id, card.object, card.owned_by) == (name, "model", "kvfleet")
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4o")
    assert e.value.code == "model_not_found"
    # A served name may be org/name; the SDK puts the slash into the path as it is.
    status, _, body = http(server.url + "/v1/models/org/other", method="GET")
    assert status == 404 and body["error"]["code"] == "model_not_found"


# -- bad input -----------------------------------------------------------------------------

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
_MSG = [{"role": "user", "content": "hi"}]

BAD_INPUTS = [
    # (name, path, body, extra headers, status, error type)
    ("malformed json", COMP, b"{not json", None, 400, "invalid_request_error"),
    ("body not an object", COMP, b"[1, 2]", None, 400, "invalid_request_error"),
    ("missing prompt", COMP, {"model": MODEL}, None, 400, "invalid_request_error"),
    ("missing messages", CHAT, {"model": MODEL}, None, 400, "invalid_request_error"),
    ("empty messages", CHAT, {"messages": []}, None, 400, "invalid_request_error"),
    ("bad role", CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, None, 400,
     "invalid_request_error"),
    ("temperature wrong type", COMP, {"prompt": "x", "temperature": "hot"}, None, 400,
     "invalid_request_error"),
    ("temperature out of range", COMP, {"prompt": "x", "temperature": 3}, None, 400,
     "invalid_request_error"),
    ("top_p zero", COMP, {"prompt": "x", "top_p": 0}, None, 400, "invalid_request_error"),
    ("n zero", CHAT, {"messages": _MSG, "n": 0}, None, 400, "invalid_request_error"),
    ("presence penalty", CHAT, {"messages": _MSG, "presence_penalty": 5}, None, 400,
     "invalid_request_error"),
    ("unknown field", COMP, {"prompt": "x", "frobnicate": 1}, None, 400, "invalid_request_error"),
    ("max_tokens zero", COMP, {"prompt": "x", "max_tokens": 0}, None, 400,
     "invalid_request_error"),
    ("max_tokens beyond context", COMP, {"prompt": "x", "max_tokens": 100000}, None, 400,
     "invalid_request_error"),
    ("prompt beyond context", COMP, {"prompt": [5] * 1100, "max_tokens": 1}, None, 400,
     "invalid_request_error"),
    ("empty token prompt", COMP, {"prompt": []}, None, 400, "invalid_request_error"),
    ("token outside vocab", COMP, {"prompt": [5, 99999]}, None, 400, "invalid_request_error"),
    ("negative token", COMP, {"prompt": [5, -1]}, None, 400, "invalid_request_error"),
    ("stream_options without stream", COMP, {"prompt": "x", "stream_options":
     {"include_usage": True}}, None, 400, "invalid_request_error"),
    ("completion logprobs > 5", COMP, {"prompt": "x", "logprobs": 10}, None, 400,
     "invalid_request_error"),
    ("top_logprobs without logprobs", CHAT, {"messages": _MSG, "top_logprobs": 2}, None, 400,
     "invalid_request_error"),
    ("empty stop string", COMP, {"prompt": "x", "stop": [""]}, None, 400,
     "invalid_request_error"),
    ("min_tokens above max_tokens", COMP, {"prompt": "x", "max_tokens": 2, "min_tokens": 5},
     None, 400, "invalid_request_error"),
    ("tools", CHAT, {"messages": _MSG, "tools": [{"type": "function"}]}, None, 400,
     "invalid_request_error"),
    ("unknown model", COMP, {"model": "gpt-9", "prompt": "x"}, None, 404, "not_found_error"),
    ("missing api key", COMP, {"prompt": "x"}, {"Authorization": ""}, 401,
     "authentication_error"),
    ("wrong api key", COMP, {"prompt": "x"}, {"Authorization": "Bearer nope"}, 401,
     "authentication_error"),
    ("body too large", COMP, {"prompt": "x" * 100_000}, None, 413, "invalid_request_error"),
    ("unknown route", "/v1/engines", {"prompt": "x"}, None, 404, "not_found_error"),
    ("wrong method", COMP, None, None, 405, "invalid_request_error"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("path", "body", "headers", "status", "err_type"),
    [case[1:] for case in BAD_INPUTS],
    ids=[case[0] for case in BAD_INPUTS],
)
def test_bad_input_is_answered_and_server_keeps_serving(server, path, body, headers, status,
                                                        err_type):  # fmt: skip
    method = "GET" if body is None else "POST"
    got, _, payload = http(server.url + path, body, method=method, headers=headers)
    assert got == status, payload
    error = payload["error"]
    assert error["type"] == err_type
    assert error["message"] and "Traceback" not in error["message"]
    assert set(error) == {"message", "type", "param", "code"}
    ok, _, good = http(server.url + COMP, {"model": MODEL, "prompt": "fine", "max_tokens": 2})
    assert ok == 200 and good["usage"]["completion_tokens"] == 2


def _refusal(server, path: str, body: dict) -> dict:
    status, _, payload = http(server.url + path, body)
    assert status == 400, payload
    return payload["error"]


def test_admission_refusals_say_which_limit_and_which_field(server):
    """The engine's admission, as a client sees it: each limit's message, the request field it
    names and, for the context length, OpenAI's code."""
    _, _, models = http(server.url + "/v1/models", method="GET")
    n = models["data"][0]["max_model_len"]
    context = "context_length_exceeded"
    error = _refusal(server, COMP, {"prompt": [5] * n, "max_tokens": 1})
    assert error["message"] == (
        f"This model's maximum context length is {n} tokens. However, your prompt has {n} "
        "tokens, leaving no room for a completion."
    )
    assert (error["param"], error["code"]) == ("prompt", context)
    error = _refusal(server, COMP, {"prompt": [5, 6], "max_tokens": n})
    assert error["message"] == (
        f"This model's maximum context length is {n} tokens. However, you requested {n + 2} "
        f"tokens (2 in the prompt, {n} for the completion). Reduce the prompt or max_tokens."
    )
    assert (error["param"], error["code"]) == ("max_tokens", context)
    error = _refusal(server, CHAT, {"messages": [{"role": "user", "content": "hi " * n}]})
    assert (error["param"], error["code"]) == ("messages", context), error
    error = _refusal(server, COMP, {"prompt": [5, 512, 7]})
    assert error["message"] == "prompt token ids [512] are outside the vocabulary [0, 512)"
    assert (error["param"], error["code"]) == ("prompt", None)
    error = _refusal(server, CHAT, {"messages": _MSG, "top_k": 513})
    assert error["message"] == "top_k (513) must not exceed the vocabulary size (512)"
    assert error["param"] == "top_k"
    error = _refusal(server, COMP, {"prompt": "x", "stop_token_ids": [512]})
    assert (error["param"], error["code"]) == ("stop_token_ids", None)


def test_full_waiting_queue_gets_429_with_retry_after(server):
    ctx = server.srv.app[SERVING]
    ctx.max_waiting_requests = 1
    server.srv.engine.fault_stall.set()  # nothing gets scheduled: the queue fills
    try:
        blocker = threading.Thread(
            target=http, args=(server.url + COMP, {"prompt": "x", "max_tokens": 2})
        )
        blocker.start()
        deadline = time.monotonic() + 10
        while server.srv.engine.core.scheduler.num_waiting < 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        status, headers, body = http(server.url + COMP, {"prompt": "x", "max_tokens": 2})
        assert status == 429 and headers["Retry-After"] == "1"
        assert body["error"]["code"] == "queue_full"
    finally:
        server.srv.engine.fault_stall.clear()
        ctx.max_waiting_requests = None
    blocker.join(30)
    assert_engine_idle(server)


# -- disconnects, health -------------------------------------------------------------------


def test_concurrent_streams_with_disconnects_leave_nothing_behind(server):
    async def one(session: aiohttp.ClientSession, i: int) -> tuple[str, int]:
        body = {"model": MODEL, "prompt": f"client {i}", "max_tokens": 48, "ignore_eos": True,
                "stream": True, "temperature": 0.7}  # fmt: skip
        headers = {"Authorization": f"Bearer {API_KEY}"}
        async with session.post(server.url + COMP, json=body, headers=headers) as resp:
            assert resp.status == 200
            events = 0
            async for line in resp.content:
                if not line.startswith(b"data: "):
                    continue
                if line.strip() == b"data: [DONE]":
                    return "done", events
                events += 1
                if i % 3 == 0 and events == 3:
                    return "hung up", events  # leaving the block closes the connection
        return "truncated", events

    async def main() -> list[tuple[str, int]]:
        async with aiohttp.ClientSession() as session:
            return await asyncio.gather(*(one(session, i) for i in range(50)))

    aborts = 'vllm:request_success_total{finished_reason="abort",model_name="tiny"'
    before = _metric_or_zero(server, aborts)
    results = asyncio.run(main())
    assert sum(r == "hung up" for r, _ in results) == 17
    assert all(r == "done" for i, (r, _) in enumerate(results) if i % 3)
    assert_engine_idle(server)
    assert _metric_or_zero(server, aborts) > before  # hang-ups were aborted, not run to the end
    core = server.srv.engine.core
    assert core.kv_cache_manager.num_free_blocks == core.kv_cache_manager.pool.num_usable_blocks
    assert not core.runner.rows and core.num_requests == 0


def test_health_reports_a_wedged_engine_loop(server):
    assert http(server.url + "/health", method="GET")[0] == 200
    engine = server.srv.engine
    engine.fault_stall.set()
    try:
        pending = threading.Thread(
            target=http, args=(server.url + COMP, {"prompt": "x", "max_tokens": 2})
        )
        pending.start()
        time.sleep(1.5)  # past the 1 s stall timeout, with a request waiting
        status, _, body = http(server.url + "/health", method="GET")
        assert status == 503 and "progress" in body["reason"]
        assert http(server.url + "/ready", method="GET")[0] == 200  # alive, just slow
    finally:
        engine.fault_stall.clear()
    pending.join(30)
    assert http(server.url + "/health", method="GET")[0] == 200
    assert_engine_idle(server)


# -- SIGTERM -------------------------------------------------------------------------------


def test_sigterm_drains_in_flight_streams_then_exits_0(model_dirs):
    server = EngineProcess(model_dirs["llama"], free_port(), ["--shutdown-timeout", "60"], MODEL)
    with server as url:

        async def stream(session: aiohttp.ClientSession, started: asyncio.Event) -> list[str]:
            body = {"model": MODEL, "prompt": "go", "max_tokens": 400, "ignore_eos": True,
                    "stream": True}  # fmt: skip
            return await sse_data_lines(session, url + COMP, body, started)

        async def main():
            async with aiohttp.ClientSession() as session:
                started = [asyncio.Event() for _ in range(3)]
                tasks = [asyncio.create_task(stream(session, e)) for e in started]
                await asyncio.gather(*(e.wait() for e in started))
                server.proc.send_signal(signal.SIGTERM)
                await asyncio.sleep(0.3)
                async with session.post(url + COMP, json={"prompt": "late"}) as resp:
                    late = resp.status, await resp.json()
                return late, await asyncio.gather(*tasks)

        (late_status, late_body), streams = asyncio.run(main())
        assert late_status == 503 and late_body["error"]["type"] == "service_unavailable"
        for lines in streams:
            assert lines[-1] == "data: [DONE]"
            tokens = sum(len(json.loads(x[6:])["choices"]) for x in lines[:-1])
            assert tokens >= 1
            assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "length"
        assert server.proc.wait(60) == 0


def test_a_port_in_use_is_one_line_before_any_model_loads(model_dirs):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        run = subprocess.run(
            [sys.executable, "-m", "kvfleet.engine.cli", "serve", "--model",
             str(model_dirs["llama"]), "--host", "127.0.0.1", "--port", str(port)],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    assert run.returncode == 2
    errors = [line for line in run.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and f"cannot listen on 127.0.0.1:{port}" in errors[0], run.stderr
    assert "Traceback" not in run.stderr and "engine ready" not in run.stderr
