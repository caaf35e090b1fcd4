"""kvfleet.engine.schema_keywords: a schema that constrains an output holds only keywords the
grammar follows, or annotations, each with a value JSON Schema allows; each problem is named by
its JSON Pointer. And what the grammar library does with the keywords refused here, so that a
library that starts to follow one shows up."""

from __future__ import annotations

from typing import Annotated, Literal

import llguidance
import pytest
from pydantic import BaseModel, Field, ValidationError

from kvfleet.engine.sampling_params import StructuredOutputsParams
from kvfleet.engine.schema_keywords import CONSTRAINTS, keyword_problem, pointer, rebase_refs
from tests.support.json_schemas import CASES


def _compiles(schema: dict) -> str:
    """llguidance's verdict on a schema: "" when it compiles, else its error."""
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
    except ValueError as e:
        return str(e)
    return llguidance.LLMatcher.validate_grammar(grammar)


BAD_VALUES = [
    # (schema, the pointer of the keyword named)
    ({"type": "number", "multipleOf": -1}, "/multipleOf"),
    ({"type": "number", "multipleOf": 0}, "/multipleOf"),
    ({"properties": {"a": {"type": "string", "minLength": -1}}}, "/properties/a/minLength"),
    ({"type": "string", "maxLength": 1.5}, "/maxLength"),
    ({"type": "array", "items": {"minItems": True}}, "/items/minItems"),
    ({"type": "object", "maxProperties": "3"}, "/maxProperties"),
    ({"type": "integer", "minimum": "0"}, "/minimum"),
    ({"type": "integer", "maximum": True}, "/maximum"),
    ({"type": "strin"}, "/type"),
    ({"type": ["string", "string"]}, "/type"),
    ({"required": ["a", "a"]}, "/required"),
    ({"required": "a"}, "/required"),
    ({"anyOf": []}, "/anyOf"),
    ({"allOf": [{"type": "string"}, 3]}, "/allOf"),
    ({"enum": "abc"}, "/enum"),
    ({"$defs": {"a/b": {"pattern": 7}}}, "/$defs/a~1b/pattern"),
    ({"prefixItems": [{"type": "string"}], "items": {"$ref": 1}}, "/items/$ref"),
    ({"title": ["a"]}, "/title"),
    ({"properties": {"a": 5}}, "/properties"),
]


@pytest.mark.parametrize(("schema", "where"), BAD_VALUES, ids=[w for _, w in BAD_VALUES])
def test_keyword_values_are_checked_as_json_schema_demands(schema, where):
    problem = keyword_problem(schema)
    assert problem is not None and problem.startswith(where + " must be"), problem


def test_the_library_takes_a_negative_multiple_of_as_it_comes():
    """Why the values are checked here: llguidance compiles this schema."""
    assert _compiles({"type": "number", "multipleOf": -1}) == ""


@pytest.mark.parametrize(
    "keyword", ["x-foo", "x-guidance", "nullable", "maxlength", "propertyOrdering"]
)
def test_keywords_the_grammar_would_ignore_are_refused(keyword):
    schema = {"type": "object", "properties": {"a": {"type": "string", keyword: True}}}
    problem = keyword_problem(schema)
    assert problem == f'unsupported features: the keyword "{keyword}" at /properties/a/{keyword}'
    # ...where the library compiles the schema as if the keyword were not there.
    assert _compiles(schema) == "", keyword


@pytest.mark.parametrize(
    "keyword", ["not", "if", "uniqueItems", "dependentRequired", "$dynamicRef"]
)
def test_keywords_the_grammar_does_not_implement_are_refused(keyword):
    problem = keyword_problem({"anyOf": [{"type": "string"}, {keyword: {}}]})
    assert problem == f'unsupported features: the keyword "{keyword}" at /anyOf/1/{keyword}'


def test_the_library_follows_every_constraint_kept():
    """Each keyword taken as a constraint is one llguidance implements (it reports the ones it
    does not: "Unimplemented keys")."""
    values = {
        "anyOf": [{"type": "string"}], "oneOf": [{"type": "string"}], "allOf": [{}],
        "$ref": "#/$defs/a", "const": 1, "enum": [1], "type": "object", "items": {},
        "additionalItems": {}, "prefixItems": [{}], "minItems": 1, "maxItems": 2,
        "properties": {}, "additionalProperties": {}, "patternProperties": {}, "required": [],
        "minProperties": 0, "maxProperties": 3, "minLength": 0, "maxLength": 3, "pattern": "a",
        "format": "date", "minimum": 0, "maximum": 9, "exclusiveMinimum": 0,
        "exclusiveMaximum": 9, "multipleOf": 2,
    }  # fmt: skip
    assert set(values) == CONSTRAINTS
    for keyword, value in values.items():
        schema = {keyword: value, "$defs": {"a": {}}}
        assert keyword_problem(schema) is None, keyword
        assert "Unimplemented" not in _compiles(schema), keyword


class _Cat(BaseModel):
    kind: Literal["cat"]
    lives: int = Field(ge=0, le=9, description="how many are left")


class _Dog(BaseModel):
    kind: Literal["dog"]
    name: str = Field(min_length=1, max_length=20, examples=["Rex"])


class _Owner(BaseModel):
    pets: list[Annotated[_Cat | _Dog, Field(discriminator="kind")]] = Field(max_length=3)
    nickname: str | None = Field(default=None, deprecated=True)


def test_what_clients_send_is_accepted():
    """Schemas as pydantic writes them (titles, descriptions, examples, defaults, "deprecated",
    "$defs", a discriminated union's "discriminator") and the structured-output tests' own."""
    assert keyword_problem(_Owner.model_json_schema()) is None
    for case in CASES:
        assert keyword_problem(case.schema) is None, case.name


def test_a_constraint_names_its_problem_under_its_field():
    with pytest.raises(ValidationError, match=r"json schema: /properties/n/multipleOf must be"):
        StructuredOutputsParams(json={"properties": {"n": {"multipleOf": -2}}})
    with pytest.raises(ValidationError, match=r'structures\[0\]\.schema: .*"x-guidance"'):
        StructuredOutputsParams(
            structural_tag={
                "structures": [{"begin": "<f>", "schema": {"x-guidance": {}}, "end": "</f>"}],
                "triggers": ["<f>"],
            }
        )


def test_pointers_escape_as_rfc_6901_says():
    assert pointer(()) == "/"
    assert pointer(("properties", "a/b~c", "items", 0)) == "/properties/a~1b~0c/items/0"


def test_refs_are_rebased_onto_where_the_schema_moves():
    schema = {
        "$defs": {"c": {"type": "string"}},
        "properties": {
            "a": {"$ref": "#/$defs/c"},
            "b": {"$ref": "#"},
            "e": {"$ref": "#anchor"},
            "f": {"$ref": "other.json#/x"},
            "g": {"$id": "inner", "$ref": "#/y"},
            "h": {"const": {"$ref": "#"}},
        },
    }
    moved = rebase_refs(schema, "#/$defs/t")
    props = moved["properties"]
    assert props["a"]["$ref"] == "#/$defs/t/$defs/c"
    assert props["b"]["$ref"] == "#/$defs/t"
    assert props["e"]["$ref"] == "#anchor" and props["f"]["$ref"] == "other.json#/x"
    assert props["g"]["$ref"] == "#/y"  # resolves against its own $id
    assert props["h"]["const"] == {"$ref": "#"}  # data, not a schema
    assert schema["properties"]["a"]["$ref"] == "#/$defs/c"  # a copy: the original is kept
    assert rebase_refs({"$id": "x", "$ref": "#/a"}, "#/$defs/t") == {"$id": "x", "$ref": "#/a"}
