"""A request through the router to an engine (the tiny model), both in this process with JSON
logs and traces to the SDK's in-memory exporter: every log line is a JSON object and a request's
lines carry its id; the router's span and the engine's are one trace, the engine's with the
GenAI semantic-convention attributes."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any, TypeVar

import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from kvfleet.engine.config import EngineArgs
from kvfleet.engine.server.app import ServerSettings
from kvfleet.router.proxy import Router, RouterSettings, build_runner
from kvfleet.telemetry.tracing import Tracing
from tests.support.logs import captured_logs, json_lines
from tests.support.net import http_call
from tests.support.servers import engine_server, runner_in_thread

MODEL = "tiny"
T = TypeVar("T")


def eventually(check: Callable[[], T | None], timeout: float = 10.0) -> T:
    """What check returns once truthy: a span ends, and a request's access line is written, as
    its handler returns, which may be just after the client has the whole response."""
    deadline = time.monotonic() + timeout
    while not (result := check()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)
    return result


@pytest.fixture(scope="module")
def fleet(model_dirs) -> Iterator[SimpleNamespace]:
    exporter = InMemorySpanExporter()
    engine_tracing = Tracing.to(exporter, "engine", batch=False)
    router_tracing = Tracing.to(exporter, "router", batch=False)
    settings = ServerSettings(host="127.0.0.1", port=0, served_model_name=[MODEL])
    args = EngineArgs(model=str(model_dirs["llama"]), dtype="float32")
    with (
        captured_logs("json") as logs,
        engine_server(args, settings, engine_tracing) as engine,
    ):
        router = Router(RouterSettings(), tracing=router_tracing)
        router.set_endpoints([engine.url.removeprefix("http://")])
        with runner_in_thread(build_runner(router)) as served:
            yield SimpleNamespace(
                router=served.url, engine=engine.url, logs=logs, exporter=exporter
            )


def _spans(fleet: SimpleNamespace, service: str, trace_id: int | None = None) -> list[ReadableSpan]:
    return [
        s
        for s in fleet.exporter.get_finished_spans()
        if s.resource.attributes["service.name"] == f"kvfleet-{service}"
        and s.kind == SpanKind.SERVER
        and (trace_id is None or s.context.trace_id == trace_id)
    ]


def _lines_of(fleet: SimpleNamespace, request_id: str) -> list[dict[str, Any]]:
    return [e for e in json_lines(fleet.logs) if e.get("request_id") == request_id]


def test_a_request_is_logged_as_json_under_its_id_by_router_and_engine(fleet):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    status, headers, _ = http_call(
        fleet.router + "/v1/chat/completions", body, headers={"X-Request-Id": "req-logs-1"}
    )
    assert status == 200
    assert headers["X-Request-Id"] == "req-logs-1"

    def both_access_lines() -> list[dict[str, Any]] | None:
        lines = _lines_of(fleet, "req-logs-1")
        loggers = {e["logger"] for e in lines}
        return lines if {"kvfleet.router.access", "kvfleet.engine.access"} <= loggers else None

    lines = eventually(both_access_lines)
    for entry in lines:
        assert {"time", "level", "logger", "message"} <= entry.keys()
    access = [e for e in lines if e["logger"] == "kvfleet.engine.access"]
    assert access[0]["message"].startswith("POST /v1/chat/completions 200 ")
    assert access[0]["level"] == "INFO"
    # Every line, the servers' start-up ones included, is one JSON object.
    assert all(json_lines(fleet.logs))


def test_a_request_without_an_id_gets_one_and_a_forged_one_is_replaced(fleet):
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 1}
    _, headers, _ = http_call(fleet.engine + "/v1/completions", body)
    made = headers["X-Request-Id"]
    assert len(made) == 32
    eventually(lambda: _lines_of(fleet, made))
    # A newline could forge a log line in a text log: such an id is not taken.
    _, headers, _ = http_call(
        fleet.engine + "/v1/completions", body, headers={"X-Request-Id": "a b" + "x" * 200}
    )
    assert headers["X-Request-Id"] != "a b" + "x" * 200
    assert len(headers["X-Request-Id"]) == 32


def test_router_and_engine_spans_are_one_trace_with_genai_attributes(fleet):
    trace_id = 0x0AF7651916CD43DD8448EB211C80319C
    parent_id = 0xB7AD6B7169203331
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Say hello"}],
        "max_tokens": 4,
        "temperature": 0.0,
        "top_p": 0.5,
    }
    traceparent = f"00-{trace_id:032x}-{parent_id:016x}-01"
    status, _, raw = http_call(
        fleet.router + "/v1/chat/completions", body, headers={"traceparent": traceparent}
    )
    assert status == 200
    answer = json.loads(raw)
    (router_span,) = eventually(lambda: _spans(fleet, "router", trace_id))
    (engine_span,) = eventually(lambda: _spans(fleet, "engine", trace_id))
    # The client's trace goes on through the router into the engine.
    assert router_span.parent is not None and router_span.parent.span_id == parent_id
    assert engine_span.parent is not None
    assert engine_span.parent.span_id == router_span.context.span_id
    assert router_span.name == "POST /v1/chat/completions"
    assert router_span.attributes["http.response.status_code"] == 200
    (upstream,) = [e for e in router_span.events if e.name == "upstream"]
    assert upstream.attributes["server.address"] == fleet.engine.removeprefix("http://")

    attrs = engine_span.attributes
    assert engine_span.name == f"chat {MODEL}"
    assert attrs["gen_ai.operation.name"] == "chat"
    assert attrs["gen_ai.request.model"] == MODEL
    assert attrs["gen_ai.request.max_tokens"] == 4
    assert attrs["gen_ai.request.temperature"] == 0.0
    assert attrs["gen_ai.request.top_p"] == 0.5
    assert attrs["gen_ai.response.id"] == answer["id"]
    assert attrs["gen_ai.response.model"] == MODEL
    assert attrs["gen_ai.usage.input_tokens"] == answer["usage"]["prompt_tokens"]
    assert attrs["gen_ai.usage.output_tokens"] == answer["usage"]["completion_tokens"] == 4
    assert tuple(attrs["gen_ai.response.finish_reasons"]) == ("length",)
    duration_s = (engine_span.end_time - engine_span.start_time) / 1e9
    assert 0 < attrs["gen_ai.response.time_to_first_chunk"] < duration_s
    assert [e.name for e in engine_span.events] == ["gen_ai.first_token"]


def test_a_streamed_completion_records_its_first_token_and_every_choice(fleet):
    body = {"model": MODEL, "prompt": ["one", "two"], "max_tokens": 2, "n": 2, "stream": True}
    status, headers, raw = http_call(fleet.router + "/v1/completions", body)
    assert status == 200 and raw.rstrip().endswith(b"data: [DONE]")
    request_id = headers["X-Request-Id"]
    (access,) = eventually(
        lambda: [e for e in _lines_of(fleet, request_id) if e["logger"] == "kvfleet.engine.access"]
    )
    assert access["message"].startswith("POST /v1/completions 200 ")

    def engine_span() -> ReadableSpan | None:
        n = "gen_ai.request.choice.count"
        return next((s for s in _spans(fleet, "engine") if s.attributes.get(n) == 2), None)

    attrs = eventually(engine_span).attributes
    assert attrs["gen_ai.operation.name"] == "text_completion"
    assert attrs["gen_ai.usage.output_tokens"] == 8  # 2 prompts x n=2 x 2 tokens
    assert tuple(attrs["gen_ai.response.finish_reasons"]) == ("length",) * 4
    assert attrs["gen_ai.response.time_to_first_chunk"] > 0


def test_probes_and_scrapes_make_no_spans_or_access_lines(fleet):
    # An earlier test's span may still be ending (its stream closes after the client has its
    # answer): count from a quiet exporter.
    before = -1
    while (now := len(fleet.exporter.get_finished_spans())) != before:
        before = now
        time.sleep(0.3)
    for url in (fleet.engine + "/health", fleet.engine + "/metrics", fleet.router + "/health"):
        assert http_call(url)[0] == 200
    time.sleep(0.2)
    assert len(fleet.exporter.get_finished_spans()) == before
    assert not [
        e
        for e in json_lines(fleet.logs)
        if e["logger"].endswith(".access") and " /health " in e["message"]
    ]
