"""Tool-call parsers per family, whole and streamed split at every character boundary."""

from __future__ import annotations

import json
import re
import time

import pytest

from kvfleet.engine.server.tool_parsers import (
    CALL_LIMITS,
    HERMES,
    LLAMA3_JSON,
    MISTRAL,
    ToolCallParser,
)
from kvfleet.protocol.tool_prompt import parser_for_template

WEATHER = {"city": "Paris", "units": ["c", "f"], "deep": {"a": '}]\\"{['}}

CASES = [
    # (mode, text, content, [(name, arguments)])
    (HERMES, 'Let me look.<tool_call>{"name": "weather", "arguments": '
     + json.dumps(WEATHER) + "}</tool_call>", "Let me look.", [("weather", WEATHER)]),
    (HERMES, '<tool_call>\n{"arguments": {"x": 1}, "name": "f"}\n</tool_call>\n<tool_call>\n'
     '{"name": "g", "arguments": {}}\n</tool_call>', "", [("f", {"x": 1}), ("g", {})]),
    (HERMES, 'a < b and <tool_ is no tag', 'a < b and <tool_ is no tag', []),
    (HERMES, '<tool_call>{"name": "f", "arguments": "{\\"q\\": 2}"}</tool_call>', "",
     [("f", {"q": 2})]),
    (LLAMA3_JSON, '<|python_tag|>{"name": "f", "parameters": {"q": "x"}}', "", [("f", {"q": "x"})]),
    (LLAMA3_JSON, ' {"name": "f", "parameters": {"a": [1, 2]}}; {"name": "g", "parameters": {}}',
     "", [("f", {"a": [1, 2]}), ("g", {})]),
    (LLAMA3_JSON, 'The answer is {"name": 1}', 'The answer is {"name": 1}', []),
    (MISTRAL, 'Sure. [TOOL_CALLS] [{"name": "f", "arguments": {"n": 3}}, {"name": "g", '
     '"arguments": {"s": "]"}}]', "Sure. ", [("f", {"n": 3}), ("g", {"s": "]"})]),
    ("array", '[{"name": "f", "arguments": {"n": 3.5e1, "b": true, "z": null}}]', "",
     [("f", {"n": 35.0, "b": True, "z": None})]),
]  # fmt: skip


def _streamed(mode: str, text: str, cuts: list[int]) -> tuple[str, list[tuple[str, dict]], list]:
    parser = ToolCallParser(mode)
    content = []
    deltas = []
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    for piece in pieces:
        c, d = parser.feed(piece)
        content.append(c)
        deltas.extend(d)
    content.append(parser.finish())
    calls: dict[int, list] = {}
    for d in deltas:
        if d.id is not None:
            assert d.index == len(calls) and d.arguments == "" and d.name
            assert d.id.startswith("call_")
            calls[d.index] = [d.name, ""]
        else:
            calls[d.index][1] += d.arguments
    return "".join(content), [(n, json.loads(a)) for n, a in calls.values()], deltas


@pytest.mark.parametrize(("mode", "text", "content", "calls"), CASES)
def test_whole_text(mode: str, text: str, content: str, calls: list) -> None:
    result = ToolCallParser(mode).parse(text)
    assert result.content == content
    assert [(c.name, json.loads(c.arguments)) for c in result.calls] == calls
    assert len({c.id for c in result.calls}) == len(calls)


@pytest.mark.parametrize(("mode", "text", "content", "calls"), CASES)
def test_streamed_at_every_boundary(mode: str, text: str, content: str, calls: list) -> None:
    for cut in range(len(text) + 1):
        got_content, got_calls, _ = _streamed(mode, text, [cut])
        assert (got_content, got_calls) == (content, calls), cut
    # and one character at a time: no marker ever leaks into the content
    got_content, got_calls, deltas = _streamed(mode, text, list(range(1, len(text))))
    assert (got_content, got_calls) == (content, calls)
    if calls and '"arguments": "' not in text:  # an arguments string is decoded whole
        assert sum(1 for d in deltas if d.id is None) > 1  # arguments really stream


def test_named_function_output() -> None:
    text = ' {"city": "Paris"}'
    for cut in range(len(text) + 1):
        _, calls, deltas = _streamed_named(text, cut)
        assert calls == [("weather", {"city": "Paris"})]
        assert deltas[0].id is not None and deltas[0].name == "weather"


def _streamed_named(text: str, cut: int) -> tuple[str, list, list]:
    parser = ToolCallParser("named", "weather")
    deltas = []
    content = ""
    for piece in (text[:cut], text[cut:]):
        c, d = parser.feed(piece)
        content += c
        deltas.extend(d)
    calls: list = []
    for d in deltas:
        if d.id is not None:
            calls.append([d.name, ""])
        calls[-1][1] += d.arguments
    return content, [(n, json.loads(a)) for n, a in calls], deltas


@pytest.mark.parametrize(
    ("mode", "text"),
    [
        (HERMES, '<tool_call>{"name": "f", "arguments": {"x": </tool_call>'),
        (HERMES, '<tool_call>{"name": "f", "arguments": {"x": 1}'),  # cut off by max_tokens
        (HERMES, "<tool_call>not json</tool_call>"),
        (HERMES, '<tool_call>{"arguments": {}}</tool_call>'),  # no name
        (MISTRAL, '[TOOL_CALLS] {"name": "f"}'),
        (LLAMA3_JSON, '{"name": "f", "parameters": 3}'),
        ("array", '[{"name": "f", "arguments": {}} {"name": "g"}]'),
    ],
)
def test_malformed_calls_are_content(mode: str, text: str) -> None:
    result = ToolCallParser(mode).parse(text)
    assert result.calls == [] and result.content == text


def test_ids_are_unique_and_openai_shaped() -> None:
    call = '<tool_call>{{"name": "f{}", "arguments": {{}}}}</tool_call>'
    text = "".join(call.format(i) for i in range(50))
    calls = ToolCallParser(HERMES).parse(text).calls
    assert len({c.id for c in calls}) == 50
    assert re.fullmatch(r"call_[0-9a-f]{24}", calls[0].id)
    assert (calls[0].name, calls[0].arguments) == ("f0", "{}")


@pytest.mark.parametrize(
    ("template", "parser"),
    [
        (None, HERMES),
        ("{{ '<|im_start|>' + message['role'] }}", HERMES),
        ("{{ '<|start_header_id|>' }}{% if tools %}<|python_tag|>{% endif %}", LLAMA3_JSON),
        ("{{ '[INST] ' + m['content'] + ' [/INST]' }}", MISTRAL),
    ],
)
def test_parser_follows_the_template_family(template: str | None, parser: str) -> None:
    assert parser_for_template(template) == parser


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def _hermes(arguments: str) -> str:
    return f'<tool_call>{{"name": "f", "arguments": {arguments}}}</tool_call>'


DEEP = '{"a": ' + _nested(1000) + "}"  # past Python's recursion limit for json.loads
OVER = '{"a": ' + _nested(CALL_LIMITS.max_depth) + "}"  # one level past the bound
TOO_DEEP = [
    (HERMES, _hermes(DEEP)),
    (HERMES, _hermes(OVER)),
    (HERMES, _hermes(json.dumps(DEEP))),  # arguments as a string holding the JSON
    ("named", DEEP),  # a named call's output is its arguments object
    ("named", OVER),
]


@pytest.mark.parametrize(("mode", "text"), TOO_DEEP)
def test_calls_nested_past_the_bound_are_content(mode: str, text: str) -> None:
    """A call nested deeper than a request body may be is malformed, whole or streamed: no
    RecursionError, the output is content (as vLLM keeps an unparsable call)."""
    result = ToolCallParser(mode, "f").parse(text)
    assert result.calls == [] and result.content == text
    parser = ToolCallParser(mode, "f")
    for i in range(0, len(text), 5):
        parser.feed(text[i : i + 5])
    parser.finish()
    assert parser.malformed


def test_calls_at_the_bound_are_calls() -> None:
    arguments = {"a": json.loads(_nested(CALL_LIMITS.max_depth - 1))}
    text = '<tool_call>{"name": "f", "arguments": ' + json.dumps(arguments) + "}</tool_call>"
    (call,) = ToolCallParser(HERMES).parse(text).calls
    assert json.loads(call.arguments) == arguments


def _stream_seconds(arguments_chars: int) -> float:
    text = _hermes(json.dumps({"code": "x" * arguments_chars}))
    parser = ToolCallParser(HERMES)
    started = time.perf_counter()
    for i in range(0, len(text), 4):
        parser.feed(text[i : i + 4])
    parser.finish()
    assert not parser.malformed
    return time.perf_counter() - started


def test_streaming_a_long_call_costs_each_piece_once() -> None:
    """A call streamed in small pieces costs in proportion to its length: each piece is
    scanned and sent once (copying the text so far on every piece made it quadratic: 800,000
    characters took 18 s)."""
    small, large = _stream_seconds(50_000), _stream_seconds(800_000)
    assert large < 40 * small, (small, large)  # 16x the text: 16x the time, 256x if quadratic
