"""Structured outputs (issue 22) through real clients against the real default model, greedy:
the openai SDK's parse() and its streaming helper, LangChain's with_structured_output, twenty
JSON schemas whose answers must validate with jsonschema, json_object on both endpoints streamed
and not, vLLM's structured_outputs extras, hostile schemas (400s naming the parameter, in
bounded time, the engine serving right after), a flood of new schemas beside a plain request,
and a json_schema request through the router."""

from __future__ import annotations

import asyncio
import enum
import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import aiohttp
import pytest
from jsonschema import Draft202012Validator, FormatChecker
from openai import OpenAI
from pydantic import BaseModel, Field

from kvfleet.router.proxy import Router, RouterSettings, build_runner
from tests.support.json_schemas import (
    CASES,
    MAX_TOKENS,
    TOO_LONG,
    TOO_LONG_MAX_TOKENS,
    SchemaCase,
    response_format,
    wide_schema,
)
from tests.support.net import http_call
from tests.support.servers import DEFAULT_SERVED_NAME, openai_client, runner_in_thread

MODEL = DEFAULT_SERVED_NAME
SYSTEM = "You are a helpful assistant. Answer in JSON."


@pytest.fixture(scope="module")
def server(default_server):
    return default_server


@pytest.fixture
def client(server) -> OpenAI:
    return openai_client(server.url, timeout=300)


def chat_body(prompt: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}],
        "temperature": 0,
        **extra,
    }


async def _post_all(url: str, bodies: list[dict[str, Any]]) -> list[tuple[int, dict[str, Any]]]:
    async def one(session: aiohttp.ClientSession, body: dict[str, Any]) -> tuple[int, dict]:
        async with session.post(url, json=body) as resp:
            return resp.status, await resp.json()

    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        return list(await asyncio.gather(*(one(session, b) for b in bodies)))


def validate(schema: dict[str, Any], instance: Any) -> None:
    Draft202012Validator(schema, format_checker=FormatChecker()).validate(instance)


def plain_latency(server) -> float:
    """Seconds a short plain completion takes; asserts it is served."""
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4, "temperature": 0}
    t0 = time.perf_counter()
    status, _, raw = http_call(server.url + "/v1/completions", body)
    assert status == 200, raw
    return time.perf_counter() - t0


# --------------------------------------------------------------------------------------------
# The catalog itself (no server)
# --------------------------------------------------------------------------------------------


def test_the_schema_catalog_is_valid_json_schema_with_valid_examples() -> None:
    assert len(CASES) >= 20
    assert len({c.name for c in CASES} | {TOO_LONG.name}) == len(CASES) + 1
    for case in [*CASES, TOO_LONG]:
        Draft202012Validator.check_schema(case.schema)
        validate(case.schema, case.example)


# --------------------------------------------------------------------------------------------
# Twenty schemas, answered together
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def schema_answers(server) -> dict[str, tuple[int, dict[str, Any]]]:
    """Every case's answer, sent at once: one batch instead of twenty-one sequential decodes."""
    cases = [*CASES, TOO_LONG]
    bodies = [
        chat_body(
            c.prompt,
            response_format=response_format(c),
            max_tokens=TOO_LONG_MAX_TOKENS if c is TOO_LONG else MAX_TOKENS,
        )
        for c in cases
    ]
    answers = asyncio.run(_post_all(server.url + "/v1/chat/completions", bodies))
    return {c.name: a for c, a in zip(cases, answers, strict=True)}


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_every_answer_validates_against_its_schema(schema_answers, case: SchemaCase) -> None:
    status, body = schema_answers[case.name]
    if case.optional_feature and status == 400:
        # An engine may refuse the keyword, but then says which and where.
        assert body["error"]["param"].startswith("response_format"), body
        assert case.optional_feature in body["error"]["message"], body
        return
    assert status == 200, body
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    validate(case.schema, json.loads(choice["message"]["content"]))


def test_an_answer_that_cannot_fit_ends_with_length(schema_answers) -> None:
    status, body = schema_answers[TOO_LONG.name]
    assert status == 200, body
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == TOO_LONG_MAX_TOKENS
    # Forty items at five tokens or more: the text is a prefix of an answer, not an answer.
    assert body["choices"][0]["message"]["content"].startswith("[")


# --------------------------------------------------------------------------------------------
# The openai SDK's parse() and LangChain
# --------------------------------------------------------------------------------------------


class Kind(enum.StrEnum):
    museum = "museum"
    monument = "monument"
    park = "park"
    church = "church"


class Landmark(BaseModel):
    name: str = Field(max_length=30)
    kind: Kind


class City(BaseModel):
    name: str = Field(max_length=20)
    country: str = Field(max_length=20)
    population_millions: float = Field(ge=0, le=50)
    landmarks: list[Landmark] = Field(min_length=1, max_length=2)
    nickname: str | None = Field(default=None, max_length=20)


CITY_PROMPT = "Tell me about Paris: its country, population in millions and two landmarks."


def assert_city(city: Any) -> None:
    assert isinstance(city, City), city
    assert 1 <= len(city.landmarks) <= 2
    assert all(isinstance(lm, Landmark) and isinstance(lm.kind, Kind) for lm in city.landmarks)
    assert city.nickname is None or isinstance(city.nickname, str)


def test_sdk_parse_returns_the_pydantic_model(client: OpenAI) -> None:
    completion = client.chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": CITY_PROMPT}],
        response_format=City,
        temperature=0,
        max_completion_tokens=200,
    )
    message = completion.choices[0].message
    assert message.refusal is None
    assert_city(message.parsed)
    assert completion.choices[0].finish_reason == "stop"


def test_sdk_stream_helper_parses_the_streamed_answer(client: OpenAI) -> None:
    with client.chat.completions.stream(
        model=MODEL,
        messages=[{"role": "user", "content": CITY_PROMPT}],
        response_format=City,
        temperature=0,
        max_completion_tokens=200,
    ) as stream:
        deltas = [e.delta for e in stream if e.type == "content.delta"]
        final = stream.get_final_completion()
    assert len(deltas) > 1
    assert_city(final.choices[0].message.parsed)
    assert "".join(deltas) == final.choices[0].message.content


def test_langchain_with_structured_output(server) -> None:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        model=MODEL,
        base_url=server.url + "/v1",
        api_key="unused",
        temperature=0,
        max_tokens=200,
        max_retries=0,
        timeout=300,
    )
    assert_city(llm.with_structured_output(City).invoke(CITY_PROMPT))


# --------------------------------------------------------------------------------------------
# json_object, vLLM's structured_outputs
# --------------------------------------------------------------------------------------------

JSON_OBJECT = {"type": "json_object"}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_json_object_on_chat(client: OpenAI, stream: bool) -> None:
    kwargs: dict[str, Any] = {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "Give the name and age of a fictional cat."},
        ],
        "response_format": JSON_OBJECT,
        "temperature": 0,
        "max_tokens": 80,
    }
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **kwargs))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    else:
        choice = client.chat.completions.create(**kwargs).choices[0]
        text, finish = choice.message.content or "", choice.finish_reason
    assert finish == "stop", text
    assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_json_object_on_completions(client: OpenAI, stream: bool) -> None:
    kwargs: dict[str, Any] = {
        "model": MODEL,
        "prompt": "A JSON object with the name and age of a fictional cat:\n",
        "temperature": 0,
        "max_tokens": 80,
        "extra_body": {"response_format": JSON_OBJECT},
    }
    if stream:
        chunks = list(client.completions.create(stream=True, **kwargs))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    else:
        choice = client.completions.create(**kwargs).choices[0]
        text, finish = choice.text, choice.finish_reason
    assert finish == "stop", text
    assert isinstance(json.loads(text), dict)


def test_vllm_structured_outputs_choice_grammar_regex_and_json(client: OpenAI) -> None:
    def ask(prompt: str, constraint: dict[str, Any]) -> str:
        completion = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": prompt}],
            temperature=0,
            max_tokens=40,
            extra_body={"structured_outputs": constraint},
        )
        assert completion.choices[0].finish_reason == "stop"
        return completion.choices[0].message.content or ""

    assert ask("Is Paris in France?", {"choice": ["yes", "no"]}) in ("yes", "no")
    assert ask("Is Paris in France?", {"grammar": 'root ::= "oui" | "non"'}) in ("oui", "non")
    assert re.fullmatch(r"[0-9]{4}", ask("In which year did WW2 end?", {"regex": r"[0-9]{4}"}))
    case = CASES[0]
    validate(case.schema, json.loads(ask(case.prompt, {"json": case.schema})))


# --------------------------------------------------------------------------------------------
# Hostile schemas
# --------------------------------------------------------------------------------------------


def _ref_chain(depth: int) -> dict[str, Any]:
    """Objects nested ``depth`` deep through $defs, each needing the next: JSON only a few
    levels deep, a grammar (and any answer) ``depth`` levels deep."""
    defs = {
        f"d{i}": {
            "type": "object",
            "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}},
            "required": ["x"],
        }
        for i in range(depth)
    }
    defs[f"d{depth}"] = {"type": "integer"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def _json_schema(schema: Any) -> dict[str, Any]:
    return {
        "response_format": {"type": "json_schema", "json_schema": {"name": "h", "schema": schema}}
    }


HOSTILE: dict[str, tuple[dict[str, Any], str]] = {
    # Thousands of properties, a megabyte of schema.
    "huge": (_json_schema(wide_schema(30000)), "response_format"),
    "deep_ref_chain": (_json_schema(_ref_chain(5000)), "response_format"),
    "ref_cycle": (
        _json_schema(
            {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
        ),
        "response_format",
    ),
    "self_ref": (_json_schema({"$ref": "#"}), "response_format"),
    "dangling_ref": (_json_schema({"$ref": "#/$defs/missing"}), "response_format"),
    "unknown_type": (_json_schema({"type": "objekt"}), "response_format"),
    "properties_not_an_object": (
        _json_schema({"type": "object", "properties": 5}),
        "response_format",
    ),
    "negative_min_length": (_json_schema({"type": "string", "minLength": -1}), "response_format"),
    "bad_pattern": (_json_schema({"type": "string", "pattern": "(["}), "response_format"),
    "schema_not_an_object": (_json_schema([1, 2]), "response_format"),
    "response_format_a_string": ({"response_format": "json_object"}, "response_format"),
    "unknown_response_format": ({"response_format": {"type": "xml"}}, "response_format"),
    "json_schema_missing": ({"response_format": {"type": "json_schema"}}, "response_format"),
    "json_schema_name_not_a_string": (
        {"response_format": {"type": "json_schema", "json_schema": {"name": 5, "schema": {}}}},
        "response_format",
    ),
    "empty_choice": ({"structured_outputs": {"choice": []}}, "structured_outputs"),
    "bad_regex": ({"structured_outputs": {"regex": "(["}}, "structured_outputs"),
    "json_not_a_schema": ({"structured_outputs": {"json": 5}}, "structured_outputs"),
    "two_constraints": (
        {"structured_outputs": {"regex": "a+", "choice": ["a"]}},
        "structured_outputs",
    ),
}
# A refusal takes no model step: seconds are for a 2-core machine that runs other tests too.
REFUSAL_S = 10.0


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_schemas_are_400s_naming_the_param(server, name: str) -> None:
    extra, param = HOSTILE[name]
    body = chat_body("Hi", max_tokens=8, **extra)
    t0 = time.perf_counter()
    status, _, raw = http_call(server.url + "/v1/chat/completions", body)
    took = time.perf_counter() - t0
    assert status == 400, raw[:500]
    error = json.loads(raw)["error"]
    assert error["type"] == "invalid_request_error" and error["message"], error
    assert (error["param"] or "").startswith(param), error
    assert took < REFUSAL_S, took
    assert plain_latency(server) < REFUSAL_S


def test_a_flood_of_new_schemas_does_not_stall_a_plain_request(server) -> None:
    alone = plain_latency(server)
    # Each schema new to the engine (its own property names) and big enough to take a while
    # to compile; one token each, so that the flood's decoding costs little.
    flood = [
        chat_body(
            "Hi",
            max_tokens=1,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": f"flood{i}", "schema": wide_schema(300, tag=f"f{i}_")},
            },
        )
        for i in range(32)
    ]
    with ThreadPoolExecutor(1) as pool:
        answers = pool.submit(asyncio.run, _post_all(server.url + "/v1/chat/completions", flood))
        time.sleep(0.3)
        during = plain_latency(server)
        results = answers.result(600)
    assert [s for s, _ in results] == [200] * len(flood), results[0]
    assert during < 3 * alone + 3.0, (alone, during)


# --------------------------------------------------------------------------------------------
# Through the router
# --------------------------------------------------------------------------------------------


def test_json_schema_through_the_router(server) -> None:
    case = next(c for c in CASES if c.name == "extraction_record")
    body = chat_body(case.prompt, response_format=response_format(case), max_tokens=MAX_TOKENS)
    router = Router(RouterSettings(hold_timeout=5.0), None)
    router.set_endpoints([server.url.removeprefix("http://")])
    with runner_in_thread(build_runner(router)) as front:
        status, _, raw = http_call(front.url + "/v1/chat/completions", body)
    assert status == 200, raw[:500]
    choice = json.loads(raw)["choices"][0]
    assert choice["finish_reason"] == "stop"
    validate(case.schema, json.loads(choice["message"]["content"]))
