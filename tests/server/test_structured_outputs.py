"""Structured outputs over HTTP with the real default model: the SDK's parse() once, then what
the client-level suite (test_structured_clients.py) leaves out: response_format json_schema and
the structured_outputs extra on /v1/completions, streamed regex output, n > 1 with a seed, the
removed guided_* extras, unsupported schema features and conflicting constraints as 400s, and
a self-referring schema refused while the engine keeps serving."""

from __future__ import annotations

import json
import re
import time

import jsonschema
import pytest
from openai import BadRequestError, OpenAI
from pydantic import BaseModel

from tests.support.net import http_call
from tests.support.servers import DEFAULT_SERVED_NAME, assert_engine_idle, metric, openai_client

MODEL = DEFAULT_SERVED_NAME
CHOICES = ["red", "green", "blue"]


@pytest.fixture(scope="module")
def server(default_server):
    return default_server


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return openai_client(server.url)


def _user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


class Pet(BaseModel):
    name: str
    legs: int


def test_sdk_parse_returns_the_pydantic_object(client: OpenAI) -> None:
    completion = client.chat.completions.parse(
        model=MODEL,
        messages=_user("Describe a pet as JSON with its name and number of legs."),
        response_format=Pet,
        max_tokens=60,
        temperature=0,
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    assert isinstance(choice.message.parsed, Pet)


def test_completions_take_response_format_and_structured_outputs(client: OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {"color": {"enum": CHOICES}, "count": {"type": "integer", "maximum": 9}},
        "required": ["color", "count"],
        "additionalProperties": False,
    }
    out = client.completions.create(
        model=MODEL,
        prompt="A color and a count, as JSON:",
        max_tokens=40,
        temperature=0,
        extra_body={
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "pick", "schema": schema, "strict": True},
            },
        },
    )
    assert out.choices[0].finish_reason == "stop", out.choices[0].text
    jsonschema.validate(json.loads(out.choices[0].text), schema)
    picked = client.completions.create(
        model=MODEL,
        prompt="My favourite color is",
        max_tokens=8,
        temperature=0,
        extra_body={"structured_outputs": {"choice": CHOICES}},
    )
    assert picked.choices[0].text in CHOICES


def test_streamed_regex_output_and_n2_with_a_seed(client: OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=_user("Give me a time of day."),
        max_tokens=12,
        temperature=0,
        stream=True,
        extra_body={"structured_outputs": {"regex": r"[0-2][0-9]:[0-5][0-9]"}},
    )
    text, finish = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    assert re.fullmatch(r"[0-2][0-9]:[0-5][0-9]", text) and finish == "stop", (text, finish)

    def two() -> list[str]:
        out = client.chat.completions.create(
            model=MODEL,
            messages=_user("Name a color."),
            max_tokens=8,
            temperature=1.0,
            seed=4,
            n=2,
            extra_body={"structured_outputs": {"choice": CHOICES}},
        )
        return [c.message.content or "" for c in out.choices]

    first = two()
    assert all(c in CHOICES for c in first)
    assert two() == first


@pytest.mark.parametrize(
    "extra, param, message",
    [
        ({"guided_json": {"type": "object"}}, None, "guided_json was removed"),
        ({"guided_choice": ["a"]}, None, "use structured_outputs.choice"),
        (
            {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
            None,
            "not both",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"not": {"type": "string"}}},
                }
            },
            "response_format",
            'unsupported features.*"not"',
        ),
        ({"structured_outputs": {"grammar": "start: nowhere"}}, "structured_outputs", "grammar"),
        (
            {
                "response_format": {"type": "json_object"},
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": "required",
            },
            "tool_choice",
            "cannot both constrain",
        ),
    ],
)
def test_bad_constraints_are_400s(client: OpenAI, extra, param, message) -> None:
    with pytest.raises(BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL, messages=_user("Hi"), max_tokens=4, extra_body=extra
        )
    error = e.value.body
    assert re.search(message, error["message"]), error
    assert error["param"] == param, error


def test_a_schema_no_output_satisfies_is_refused_and_the_engine_serves_on(
    client: OpenAI,
) -> None:
    with pytest.raises(BadRequestError, match="allows no output"):
        client.chat.completions.create(
            model=MODEL,
            messages=_user("Hi"),
            max_tokens=4,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "loop", "schema": {"$ref": "#"}},
            },
        )
    after = client.chat.completions.create(
        model=MODEL, messages=_user("Hi"), max_tokens=2, temperature=0
    )
    assert after.choices[0].message.content


def test_unsupported_feature_on_completions_names_response_format(server) -> None:
    status, _, raw = http_call(
        server.url + "/v1/completions",
        {
            "model": MODEL,
            "prompt": "Hi",
            "max_tokens": 4,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "u", "schema": {"type": "array", "uniqueItems": True}},
            },
        },
    )
    assert status == 400, raw
    error = json.loads(raw)["error"]
    assert error["param"] == "response_format" and "uniqueItems" in error["message"], error


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_a_streamed_request_whose_schema_fails_to_compile_is_a_400_that_leaves_nothing(
    server, path
) -> None:
    """The engine queues a request while its new schema compiles (its prompt prefills
    meanwhile): one that fails to compile is still a 400 before a byte of the stream, and the
    engine keeps nothing of it."""
    prompt = {"messages": _user("Hi")} if "chat" in path else {"prompt": "Hi"}
    status, _, raw = http_call(
        server.url + path,
        {
            "model": MODEL,
            **prompt,
            "max_tokens": 4,
            "stream": True,
            "n": 2,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "loop", "schema": {"$ref": "#"}},
            },
        },
    )
    assert status == 400, raw
    error = json.loads(raw)["error"]
    assert error["param"] == "response_format" and "allows no output" in error["message"], error
    assert_engine_idle(server)


def _slow_compiles(server, monkeypatch, seconds: float) -> list[list[tuple[int, int]]]:
    """Make the server's compiles end only once every running request has computed all its
    tokens but the one that samples, or after `seconds` (a slow machine's prefill is no reason
    to fail); each one records, as it ends, the (computed, all) tokens of every running
    request."""
    core = server.srv.engine.core
    real = core.structured.grammar
    seen: list[list[tuple[int, int]]] = []

    def prefilled() -> bool:
        running = list(core.scheduler.running)
        return bool(running) and all(r.num_computed_tokens == r.num_tokens - 1 for r in running)

    def slow(params):
        deadline = time.monotonic() + seconds
        while not prefilled() and time.monotonic() < deadline:
            time.sleep(0.01)
        seen.append([(r.num_computed_tokens, r.num_tokens) for r in core.scheduler.running])
        return real(params)

    monkeypatch.setattr(core.structured, "grammar", slow)
    return seen


def test_a_new_schema_compiles_while_its_prompt_prefills(server, client, monkeypatch) -> None:
    seen = _slow_compiles(server, monkeypatch, 30)
    schema = {
        "type": "object",
        "properties": {"color": {"enum": CHOICES}},
        "required": ["color"],
        "additionalProperties": False,
    }
    stream = client.chat.completions.create(
        model=MODEL,
        messages=_user("Pick a color."),
        max_tokens=40,
        temperature=0,
        stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "slow", "schema": schema}},
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), schema)
    # The prompt ran while the schema compiled, all but the position that samples.
    assert len(seen) == 1 and len(seen[0]) == 1, seen
    computed, prompt = seen[0][0]
    assert computed == prompt - 1, seen
    assert_engine_idle(server)


def test_a_schema_that_fails_after_its_request_is_queued_is_a_400(server, monkeypatch) -> None:
    _slow_compiles(server, monkeypatch, 0.3)
    status, _, raw = http_call(
        server.url + "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": _user("Hi"),
            "max_tokens": 4,
            "stream": True,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "late", "schema": {"type": "string", "not": {}}},
            },
        },
    )
    assert status == 400, raw
    error = json.loads(raw)["error"]
    assert error["param"] == "response_format" and "unsupported" in error["message"], error
    assert_engine_idle(server)


def _lark_chain(n: int) -> str:
    return "\n".join(["start: r0"] + [f"r{i}: r{i + 1}" for i in range(n)] + [f'r{n}: "a"'])


def _ref_chain(n: int) -> dict:
    """Objects whose $refs chain through n definitions: 63 KB at 1,150, inside the schema
    size and depth bounds, and enough to overflow the compiler's stack."""
    defs = {str(i): {"properties": {"x": {"$ref": f"#/$defs/{i + 1}"}}} for i in range(n)}
    defs[str(n)] = {"type": "string"}
    return {"$ref": "#/$defs/0", "$defs": defs}


# Each crashed an engine (SIGSEGV in the grammar compiler) or failed as a 500 at its first token.
NATIVE_HAZARDS = [
    ({"structured_outputs": {"grammar": _lark_chain(3000)}}, "structured_outputs", "deep"),
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "chain", "schema": _ref_chain(1150)},
            }
        },
        "response_format",
        r"\$refs followed",
    ),
    ({"structured_outputs": {"json": _ref_chain(1150)}}, "structured_outputs", "refs followed"),
    ({"structured_outputs": {"regex": "a{1000000000}"}}, "structured_outputs", "repeats"),
    (
        {
            "structured_outputs": {
                "grammar": "root ::= " + " | ".join(f'"w{i}"' for i in range(6000))
            }
        },
        "structured_outputs",
        "alternatives",
    ),
    (
        {"structured_outputs": {"json": {"type": "string", "pattern": "^(a{1000}){1000}$"}}},
        "structured_outputs",
        "pattern repeats",
    ),
]


@pytest.mark.parametrize("extra, param, message", NATIVE_HAZARDS)
def test_what_would_crash_the_grammar_compiler_is_a_400(server, extra, param, message) -> None:
    started = time.monotonic()
    status, _, raw = http_call(
        server.url + "/v1/chat/completions",
        {"model": MODEL, "messages": _user("Hi"), "max_tokens": 4, **extra},
    )
    assert status == 400, raw[:500]
    error = json.loads(raw)["error"]
    assert re.search(message, error["message"]) and error["param"] == param, error
    assert time.monotonic() - started < 10
    status, _, _ = http_call(server.url + "/health", method="GET")
    assert status == 200
    assert metric(server, "kvfleet_engine_grammar_compiler_crashes_total") == 0


def test_the_grammar_cache_and_structured_outputs_are_in_the_metrics(server, client) -> None:
    client.chat.completions.create(
        model=MODEL,
        messages=_user("Say yes or no."),
        max_tokens=4,
        extra_body={"structured_outputs": {"regex": "(yes|no){1,3}"}},
    )
    assert metric(server, "kvfleet_engine_structured_outputs_available") == 1
    assert metric(server, "kvfleet_engine_grammar_cache_entries") >= 1
    assert metric(server, "kvfleet_engine_grammar_cache_bytes") > 0
    assert metric(server, "kvfleet_engine_grammar_compiles_total") >= 1


def test_a_constraint_that_fails_as_it_runs_is_the_requests_400(server, monkeypatch) -> None:
    """A grammar that runs out of the parser's limits at a later token (a row of more items
    than it holds, say) is the constraint's fault: a 400, or an error event and [DONE] in a
    stream, and the engine serves on."""
    from kvfleet.engine.grammar import GrammarError

    structured = server.srv.engine.core.structured
    real = structured.masks

    def failing(reqs):
        masks = real(reqs)
        if masks is not None:
            for i, req in enumerate(reqs):
                if req.grammar is not None and req.output_token_ids:
                    masks.failed[i] = GrammarError("row too long", "structured_outputs")
        return masks

    monkeypatch.setattr(structured, "masks", failing)
    body = {
        "model": MODEL,
        "messages": _user("Count."),
        "max_tokens": 8,
        "structured_outputs": {"regex": "[0-9]{8}"},
    }
    status, _, raw = http_call(server.url + "/v1/chat/completions", body)
    assert status == 400, raw
    error = json.loads(raw)["error"]
    assert "row too long" in error["message"] and error["param"] == "structured_outputs", error
    status, _, raw = http_call(server.url + "/v1/chat/completions", {**body, "stream": True})
    assert status == 200
    events = [e for e in raw.decode().split("\n\n") if e.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    failure = json.loads(events[-2][len("data: ") :])["error"]
    assert "row too long" in failure["message"], failure
    assert failure["type"] == "invalid_request_error" and failure["param"] == "structured_outputs"
    assert_engine_idle(server)
