"""The keywords of a JSON schema that constrains an output: which are taken, what their values
may be, and where the subschemas under them are.

llguidance silently ignores every keyword JSON Schema does not define (an ``x-`` extension, a
misspelling, OpenAPI's ``nullable``) and would follow the schema as if the keyword were not
there, so a schema may hold only :data:`CONSTRAINTS` and :data:`ANNOTATIONS` (not even
``x-guidance``, whose options would replace the server's); values are checked as the
meta-schema demands, since the library takes some as they come. Each problem names the
keyword's JSON Pointer (docs/api.md#structured-outputs). Pure: no grammar library, no I/O; the
walk is iterative (callers bound the depth).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Iterator
from typing import Any

# What llguidance compiles (its IMPLEMENTED keywords).
CONSTRAINTS = frozenset(
    {
        "anyOf", "oneOf", "allOf", "$ref", "const", "enum", "type",
        "items", "additionalItems", "prefixItems", "minItems", "maxItems",
        "properties", "additionalProperties", "patternProperties", "required",
        "minProperties", "maxProperties",
        "minLength", "maxLength", "pattern", "format",
        "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
    }
)  # fmt: skip
# Keywords that constrain nothing: JSON Schema's identifiers, definitions and meta-data, and
# OpenAPI's `discriminator`, which pydantic writes beside the `oneOf` it describes.
ANNOTATIONS = frozenset(
    {
        "$schema", "$id", "id", "$anchor", "$defs", "definitions", "$comment",
        "title", "description", "default", "examples", "deprecated", "readOnly", "writeOnly",
        "contentMediaType", "contentEncoding", "discriminator",
    }
)  # fmt: skip
_TYPES = frozenset({"null", "boolean", "object", "array", "number", "string", "integer"})
# Keywords whose value is one schema, a list of schemas, or a map of names to schemas.
_ONE_SCHEMA = ("additionalProperties", "additionalItems", "items")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_STRING_VALUED = (
    "$ref", "$schema", "$id", "id", "$anchor", "$comment", "title", "description", "pattern",
    "format", "contentMediaType", "contentEncoding",
)  # fmt: skip


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _count(v: Any) -> bool:
    """A non-negative integer; 2.0 is one (JSON Schema counts by value, not by spelling)."""
    return _number(v) and v >= 0 and float(v).is_integer()


def _schema(v: Any) -> bool:
    return isinstance(v, dict | bool)


def _schemas(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and all(map(_schema, v))


def _type(v: Any) -> bool:
    if isinstance(v, str):
        return v in _TYPES
    return (
        isinstance(v, list)
        and bool(v)
        and all(isinstance(t, str) and t in _TYPES for t in v)
        and len(set(v)) == len(v)
    )


def _strings(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(s, str) for s in v) and len(set(v)) == len(v)


def _str(v: Any) -> bool:
    return isinstance(v, str)


def _bool(v: Any) -> bool:
    return isinstance(v, bool)


_ANY = "any JSON value"
# keyword -> (the check of its value, what it must be)
_VALUES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "type": (_type, 'a type name ("string", "integer", ...) or a list of distinct ones'),
    "enum": (lambda v: isinstance(v, list), "a list"),
    "multipleOf": (lambda v: _number(v) and v > 0, "a number greater than 0"),
    "minimum": (_number, "a number"),
    "maximum": (_number, "a number"),
    # A boolean is draft 4's form, which the library reads as such.
    "exclusiveMinimum": (lambda v: _number(v) or isinstance(v, bool), "a number"),
    "exclusiveMaximum": (lambda v: _number(v) or isinstance(v, bool), "a number"),
    **dict.fromkeys(
        ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties"),
        (_count, "a non-negative integer"),
    ),
    "required": (_strings, "a list of distinct strings"),
    **dict.fromkeys(("allOf", "anyOf", "oneOf"), (_schemas, "a non-empty list of schemas")),
    "prefixItems": (_schemas, "a non-empty list of schemas"),
    "items": (lambda v: _schema(v) or _schemas(v), "a schema"),
    **dict.fromkeys(("additionalProperties", "additionalItems"), (_schema, "a schema")),
    **dict.fromkeys(
        _SCHEMA_MAPS,
        (lambda v: isinstance(v, dict) and all(map(_schema, v.values())), "a map of schemas"),
    ),
    **dict.fromkeys(_STRING_VALUED, (_str, "a string")),
    **dict.fromkeys(("deprecated", "readOnly", "writeOnly"), (_bool, "true or false")),
    "examples": (lambda v: isinstance(v, list), "a list"),
    "discriminator": (lambda v: isinstance(v, dict), "an object"),
    "const": (lambda v: True, _ANY),
    "default": (lambda v: True, _ANY),
}


def pointer(path: tuple[str | int, ...]) -> str:
    """RFC 6901's JSON Pointer of a path (the root: "/")."""
    if not path:
        return "/"
    return "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in path)


def _subschemas(schema: dict[str, Any]) -> Iterator[tuple[tuple[str | int, ...], Any]]:
    """(relative path, subschema) for each schema directly under a schema's keywords."""
    for key in _ONE_SCHEMA:
        if _schema(schema.get(key)):
            yield (key,), schema[key]
    for key in _SCHEMA_LISTS:
        value = schema.get(key)
        if isinstance(value, list):
            yield from (((key, i), v) for i, v in enumerate(value))
    for key in _SCHEMA_MAPS:
        value = schema.get(key)
        if isinstance(value, dict):
            yield from (((key, name), v) for name, v in value.items())


def keyword_problem(schema: Any) -> str | None:
    """The first thing wrong with a schema's keywords, said with its JSON Pointer; None if
    nothing is."""
    stack: list[tuple[tuple[str | int, ...], Any]] = [((), schema)]
    while stack:
        path, node = stack.pop()
        if isinstance(node, bool):
            continue
        if not isinstance(node, dict):
            return f"{pointer(path)} must be a schema (an object or a boolean)"
        for key, value in node.items():
            if key not in CONSTRAINTS and key not in ANNOTATIONS:
                return f'unsupported features: the keyword "{key}" at {pointer((*path, key))}'
            check, requirement = _VALUES[key]
            if not check(value):
                shown = json.dumps(value)
                shown = shown if len(shown) <= 40 else shown[:37] + "..."
                return f"{pointer((*path, key))} must be {requirement}, got {shown}"
        stack.extend(((*path, *rel), sub) for rel, sub in reversed(list(_subschemas(node))))
    return None


def rebase_refs(schema: Any, base: str) -> Any:
    """A copy of a schema in which each reference into it (``#`` or ``#/...``) points into the
    same place once the schema lives at ``base`` (a JSON Pointer fragment such as
    ``#/$defs/f``) inside a larger one. References under an ``$id`` resolve against that
    resource, not the root, and stay as they are; so do anchors (``#name``) and other
    documents' references."""
    root = copy.deepcopy(schema)  # callers bound the depth
    stack = [] if isinstance(root, dict) and "$id" in root else [root]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        ref = node.get("$ref")
        if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
            node["$ref"] = base + ref[1:]
        stack.extend(
            sub for _, sub in _subschemas(node) if not (isinstance(sub, dict) and "$id" in sub)
        )
    return root
