"""Structural tags in the engine, with the real default model's tokenizer: the grammar leaves
text free until a trigger, then the token mask allows only the rest of a structure's begin,
JSON that follows its schema, and its end; triggers and ends that are special tokens, the
request's JSON options, the cache, and each bad tag refused with an error naming the problem."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from pydantic import ValidationError

from kvfleet.engine.engine_core import load_tokenizer
from kvfleet.engine.grammar import GrammarError
from kvfleet.engine.sampling_params import StructuredOutputsParams
from kvfleet.engine.structured_output import GrammarMatcher, StructuredOutputs

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TAG = {
    "structures": [
        {"begin": "<function=get_weather>", "schema": WEATHER, "end": "</function>"},
        # No schema: any JSON object.
        {"begin": "<function=get_time>", "end": "</function>"},
    ],
    "triggers": ["<function="],
}


@pytest.fixture(scope="module")
def tokenizer(smollm2_gguf) -> Any:
    return load_tokenizer(str(smollm2_gguf))


@pytest.fixture(scope="module")
def structured(tokenizer) -> StructuredOutputs:
    return StructuredOutputs(tokenizer, len(tokenizer), frozenset([tokenizer.eos_token_id]))


def _matcher(structured: StructuredOutputs, **constraint: Any) -> GrammarMatcher:
    return structured.grammar(StructuredOutputsParams(**constraint)).matcher()


def _allowed(m: GrammarMatcher, vocab: int) -> list[int]:
    bits = np.unpackbits(np.frombuffer(m.raw.compute_bitmask(), dtype=np.uint8), bitorder="little")
    return [int(t) for t in np.nonzero(bits[:vocab])[0]]


def _texts(m: GrammarMatcher, tokenizer: Any) -> set[str]:
    return {tokenizer.decode([t]) for t in _allowed(m, len(tokenizer))}


def _feed(m: GrammarMatcher, tokenizer: Any, text: str) -> None:
    for token in tokenizer.encode(text, add_special_tokens=False):
        m.accept(token)


def _free(m: GrammarMatcher, tokenizer: Any) -> bool:
    """Free text: nearly every token allowed, and the output may end here."""
    return len(_allowed(m, len(tokenizer))) > 0.99 * len(tokenizer) and m.raw.is_accepting()


def test_text_is_free_until_a_trigger_then_the_structure_is_forced(structured, tokenizer):
    m = _matcher(structured, structural_tag=TAG)
    assert _free(m, tokenizer)
    _feed(m, tokenizer, "Let me check <function> and <func")
    assert _free(m, tokenizer)
    _feed(m, tokenizer, "tion=")
    # Only the rest of a begin that starts with the trigger, and no end of output.
    rest = _texts(m, tokenizer)
    assert rest and all("get_weather>".startswith(t) or "get_time>".startswith(t) for t in rest)
    assert not m.raw.is_accepting()
    _feed(m, tokenizer, "get_weather>")
    assert _texts(m, tokenizer) <= {"{", '{"'}
    _feed(m, tokenizer, '{"city": "Oslo", "days": ')
    digits = _texts(m, tokenizer)
    assert digits and all(t.strip() == "" or t.strip()[0] in "123456789" for t in digits)
    _feed(m, tokenizer, "3}")
    assert all("</function>".startswith(t) for t in _texts(m, tokenizer))
    _feed(m, tokenizer, "</function> Done.")
    assert _free(m, tokenizer)
    # A second structure after the first, and the output may still go on or end.
    _feed(m, tokenizer, ' <function=get_time>{"tz": "UTC"}</function>')
    assert _free(m, tokenizer) and not m.terminated


@pytest.mark.parametrize(
    "text",
    [
        '<function=get_weather>{"town"',
        '<function=get_weather>{"city": "a", "days": 10}',
        '<function=get_weather>{"city": "a"}',
        "<function=get_wether>",
        '<function=get_weather>{"city": "a", "days": 1}</func>',
        "<function=get_time>[1]",
    ],
)
def test_text_that_breaks_a_triggered_structure_is_refused(structured, tokenizer, text):
    m = _matcher(structured, structural_tag=TAG)
    with pytest.raises(ValueError, match="refused"):
        _feed(m, tokenizer, text)


def test_special_token_trigger_and_end_are_those_tokens(structured, tokenizer):
    start, sep = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<file_sep>"])
    tag = {
        "structures": [{"begin": "<|im_start|>call", "schema": WEATHER, "end": "<file_sep>"}],
        "triggers": ["<|im_start|>"],
    }
    m = _matcher(structured, structural_tag=tag)
    assert start in _allowed(m, len(tokenizer))
    _feed(m, tokenizer, "Calling: ")
    m.accept(start)
    assert all("call".startswith(t) for t in _texts(m, tokenizer))
    _feed(m, tokenizer, 'call{"city": "Rome", "days": 2}')
    # The end is the special token itself, not the text that spells it.
    assert _allowed(m, len(tokenizer)) == [sep]
    m.accept(sep)
    assert _free(m, tokenizer)


def test_the_json_options_hold_inside_structures(structured, tokenizer):
    open_schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    tag = {
        "structures": [{"begin": "<f>", "schema": open_schema, "end": "</f>"}],
        "triggers": ["<f"],
    }
    compact = _matcher(structured, structural_tag=tag, disable_any_whitespace=True)
    _feed(compact, tokenizer, "<f>{")
    assert _texts(compact, tokenizer) and all(
        not t[0].isspace() for t in _texts(compact, tokenizer)
    )
    closed = _matcher(structured, structural_tag=tag, disable_additional_properties=True)
    _feed(closed, tokenizer, "<f>{")
    with pytest.raises(ValueError, match="refused"):
        _feed(closed, tokenizer, '"b": 1')
    # Whitespace between JSON tokens is bounded by default, as for json schemas.
    spaced = _matcher(structured, structural_tag=tag)
    _feed(spaced, tokenizer, "<f>{" + " " * 32)
    assert all(t.strip() for t in _texts(spaced, tokenizer))


def test_the_tag_as_json_text_or_object_is_one_cached_grammar(tokenizer):
    fresh = StructuredOutputs(tokenizer, len(tokenizer), frozenset([tokenizer.eos_token_id]))
    as_text = StructuredOutputsParams(structural_tag=json.dumps({"type": "structural_tag", **TAG}))
    as_object = StructuredOutputsParams(structural_tag=TAG)
    assert fresh.grammar(as_text) is fresh.grammar(as_object)
    assert fresh.compiles == 1


def _tag_with(schema: dict) -> dict:
    return {
        "structures": [
            TAG["structures"][0],
            {"begin": "<function=bad>", "schema": schema, "end": ""},
        ],
        "triggers": ["<function="],
    }


@pytest.mark.parametrize(
    "schema, message",
    [
        ({"not": {"type": "string"}}, r"structures\[1\]\.schema: .*unsupported features.*not"),
        ({"type": "nope"}, r"structures\[1\]\.schema: /type must be a type name"),
    ],
)
def test_a_schema_with_a_bad_keyword_is_refused_naming_its_structure(schema, message):
    with pytest.raises(ValidationError, match=message):
        StructuredOutputsParams(structural_tag=_tag_with(schema))


def test_a_schema_no_output_satisfies_is_a_grammar_error_naming_its_structure(structured):
    with pytest.raises(GrammarError, match=r"structures\[1\]\.schema: .*allows no output"):
        structured.grammar(StructuredOutputsParams(structural_tag=_tag_with({"$ref": "#"})))


def _deep(levels: int) -> dict:
    schema: dict = {}
    for _ in range(levels):
        schema = {"items": schema}
    return schema


@pytest.mark.parametrize(
    "tag, message",
    [
        (
            {"structures": [{"begin": "<g>", "end": "</g>"}], "triggers": ["<f"]},
            r"structures\[0\]\.begin '<g>' starts with none of the triggers",
        ),
        ({"structures": [], "triggers": ["<f"]}, "at least 1 item"),
        ({"structures": [{"begin": "<f>", "end": ""}], "triggers": []}, "at least 1 item"),
        ({"structures": [{"begin": "<f>", "end": ""}], "triggers": [""]}, "at least 1 character"),
        ({"structures": [{"begin": "<f>"}], "triggers": ["<f"]}, "end\n  Field required"),
        (
            {"structures": [{"begin": "<f>", "tag_schema": {}, "end": ""}], "triggers": ["<f"]},
            "tag_schema\n  Extra inputs",
        ),
        ({"type": "structural_tag", "format": {"type": "any_text"}}, '"format" shape'),
        ("{not json", "structural_tag is not valid JSON"),
        ("[]", "must be a JSON object"),
        (
            {"structures": [{"begin": "<f>", "schema": _deep(70), "end": ""}], "triggers": ["<f"]},
            r"structures\[0\]\.schema nests deeper than 64",
        ),
    ],
)
def test_a_bad_tag_shape_is_a_validation_error(tag, message):
    with pytest.raises(ValidationError, match=message):
        StructuredOutputsParams(structural_tag=tag)
