"""JSON schemas for the structured-output tests, each with a prompt that asks the default model
for it, an instance it accepts (the catalog's own check), and what a greedy answer must give.

Strings carry a maxLength and arrays a maxItems: a small model decoding greedily under a grammar
can repeat itself inside an open string or array until max_tokens, and the bounds make every
answer fit in ``MAX_TOKENS``. The one case that cannot fit (``TOO_LONG``) must end with
finish_reason "length". Schemas marked ``optional_feature`` use a JSON Schema keyword that an
engine may refuse instead (string formats, tuple items): then the answer is a 400 that names the
keyword, as issue 22 asks of unsupported features."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Room for every fitting schema's answer by the default model, greedy.
MAX_TOKENS = 160


@dataclass(frozen=True)
class SchemaCase:
    name: str
    schema: dict[str, Any]
    prompt: str
    example: Any
    # A keyword an engine may refuse with a 400 that names it, instead of following it.
    optional_feature: str | None = None


def _obj(properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    """A closed object; every property required unless ``required`` names fewer."""
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
        "additionalProperties": False,
    }


def _str(max_length: int = 24, **extra: Any) -> dict[str, Any]:
    return {"type": "string", "maxLength": max_length, **extra}


CASES: list[SchemaCase] = [
    SchemaCase(
        "flat_person",
        _obj({"name": _str(), "age": {"type": "integer", "minimum": 0, "maximum": 120}}),
        "Give the name and age of a famous scientist.",
        {"name": "Marie Curie", "age": 66},
    ),
    SchemaCase(
        "nested_address",
        _obj({"name": _str(), "address": _obj({"city": _str(), "country": _str()})}),
        "Where does the President of France live?",
        {"name": "Elysee", "address": {"city": "Paris", "country": "France"}},
    ),
    SchemaCase(
        "array_min_max_items",
        _obj({"colors": {"type": "array", "items": _str(12), "minItems": 2, "maxItems": 3}}),
        "List the colours of the French flag.",
        {"colors": ["blue", "white", "red"]},
    ),
    SchemaCase(
        "enum_string",
        _obj({"sentiment": {"enum": ["positive", "negative", "neutral"]}}),
        "What is the sentiment of: 'I love sunny days'?",
        {"sentiment": "positive"},
    ),
    SchemaCase(
        "number_bounds",
        _obj(
            {
                "temperature_c": {"type": "number", "minimum": -60, "maximum": 60},
                "humidity": {"type": "number", "minimum": 0, "maximum": 100},
            }
        ),
        "Describe a typical summer day in Madrid: temperature and humidity.",
        {"temperature_c": 31.5, "humidity": 30},
    ),
    SchemaCase(
        "integer_exclusive_bounds",
        _obj({"legs": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10}}),
        "How many legs does a spider have?",
        {"legs": 8},
    ),
    SchemaCase(
        "booleans",
        _obj({"is_capital": {"type": "boolean"}, "is_coastal": {"type": "boolean"}}),
        "Is Paris a capital city, and is it on the coast?",
        {"is_capital": True, "is_coastal": False},
    ),
    SchemaCase(
        "optional_fields",
        _obj(
            {
                "title": _str(40),
                "year": {"type": "integer", "minimum": 1000, "maximum": 2100},
                "subtitle": _str(40),
            },
            required=["title"],
        ),
        "Name a famous novel.",
        {"title": "Les Miserables"},
    ),
    SchemaCase(
        "string_pattern",
        _obj({"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}}),
        "Invent a product code made of three capital letters, a dash and three digits.",
        {"code": "ABC-123"},
    ),
    SchemaCase(
        "string_length_bounds",
        _obj({"word": {"type": "string", "minLength": 3, "maxLength": 8}}),
        "Give one word that describes the sea.",
        {"word": "vast"},
    ),
    SchemaCase(
        "string_format_date",
        _obj({"event": _str(), "date": {"type": "string", "format": "date"}}),
        "When did the French Revolution start? Give the event and its date.",
        {"event": "Storming of the Bastille", "date": "1789-07-14"},
        optional_feature="format",
    ),
    SchemaCase(
        "defs_and_refs",
        {
            "$defs": {
                "point": _obj(
                    {
                        "x": {"type": "integer", "minimum": -100, "maximum": 100},
                        "y": {"type": "integer", "minimum": -100, "maximum": 100},
                    }
                )
            },
            **_obj({"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}}),
        },
        "Give the start and end points of a short line segment.",
        {"start": {"x": 0, "y": 0}, "end": {"x": 3, "y": 4}},
    ),
    SchemaCase(
        "any_of",
        _obj({"answer": {"anyOf": [{"type": "integer"}, _str(12)]}}),
        "What is two plus two?",
        {"answer": 4},
    ),
    SchemaCase(
        "array_of_objects",
        _obj(
            {
                "items": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 2,
                    "items": _obj(
                        {"name": _str(16), "qty": {"type": "integer", "minimum": 1, "maximum": 9}}
                    ),
                }
            }
        ),
        "Write a short shopping list for breakfast.",
        {"items": [{"name": "eggs", "qty": 6}]},
    ),
    SchemaCase(
        "top_level_array",
        {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": 99},
            "minItems": 3,
            "maxItems": 3,
        },
        "Give three small prime numbers.",
        [2, 3, 5],
    ),
    SchemaCase(
        "const_and_integer_enum",
        _obj({"version": {"const": 2}, "level": {"enum": [1, 2, 3]}}),
        "Rate the difficulty of chess from 1 to 3.",
        {"version": 2, "level": 3},
    ),
    SchemaCase(
        "nullable",
        _obj(
            {
                "nickname": {"type": ["string", "null"], "maxLength": 16},
                "rank": {
                    "anyOf": [{"type": "integer", "minimum": 1, "maximum": 10}, {"type": "null"}]
                },
            }
        ),
        "Does Paris have a nickname? Give it, or null.",
        {"nickname": "City of Light", "rank": None},
    ),
    SchemaCase(
        "deep_nesting",
        _obj({"a": _obj({"b": _obj({"c": _obj({"d": {"type": "integer", "maximum": 9}})})})}),
        "Fill in the nested object with a digit at the bottom.",
        {"a": {"b": {"c": {"d": 7}}}},
    ),
    SchemaCase(
        "tuple_prefix_items",
        _obj(
            {
                "pair": {
                    "type": "array",
                    "prefixItems": [_str(12), {"type": "integer", "minimum": 0, "maximum": 1000}],
                    "items": False,
                }
            }
        ),
        "Give a city and its height above sea level in metres as a pair.",
        {"pair": ["Madrid", 657]},
        optional_feature="prefixItems",
    ),
    SchemaCase(
        "extraction_record",
        _obj(
            {
                "city": _str(20),
                "country": _str(20),
                "population_millions": {"type": "number", "minimum": 0, "maximum": 50},
                "landmarks": {"type": "array", "items": _str(24), "maxItems": 2},
                "is_capital": {"type": "boolean"},
            }
        ),
        "Tell me about Rome.",
        {
            "city": "Rome",
            "country": "Italy",
            "population_millions": 2.8,
            "landmarks": ["Colosseum"],
            "is_capital": True,
        },
    ),
]

# Forty objects of at least five tokens each: no answer fits in TOO_LONG_MAX_TOKENS.
TOO_LONG = SchemaCase(
    "too_long_for_max_tokens",
    {
        "type": "array",
        "minItems": 40,
        "items": _obj({"id": {"type": "integer"}, "label": _str(10, minLength=5)}),
    },
    "List forty labelled items.",
    [{"id": i, "label": f"item-{i}"} for i in range(40)],
)
TOO_LONG_MAX_TOKENS = 48


def response_format(case: SchemaCase, strict: bool = True) -> dict[str, Any]:
    """OpenAI's json_schema response_format for ``case``."""
    return {
        "type": "json_schema",
        "json_schema": {"name": case.name, "schema": case.schema, "strict": strict},
    }


def wide_schema(properties: int, tag: str = "p") -> dict[str, Any]:
    """An object of ``properties`` optional small properties named ``{tag}0``, ``{tag}1``, ...:
    big to compile, and each ``tag`` a schema the engine has never seen."""
    kinds = [{"type": "integer"}, {"type": "boolean"}, _str(8), {"enum": ["a", "b", "c"]}]
    return _obj({f"{tag}{i}": kinds[i % len(kinds)] for i in range(properties)}, required=[])


# A function tool (chat's shape) whose arguments greedy SmolLM2 fills within bounds; the tool
# and Responses tests call it.
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
