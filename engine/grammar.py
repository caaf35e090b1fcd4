"""A structured-outputs constraint compiled into an llguidance matcher: the grammar text for each
kind of constraint, the bounds it is checked against first (`grammar_bounds`), and the matcher's
validation. Free of torch, so that the grammar sandbox's worker process starts in a moment; the
engine's cache, jobs and batch masks are in `structured_output`."""

from __future__ import annotations

import copy
import json
import re
from typing import TYPE_CHECKING, Any, TypedDict

import llguidance
import llguidance.gbnf_to_lark
import numpy as np

from kvfleet.engine import grammar_bounds
from kvfleet.engine.request import InvalidRequestError
from kvfleet.engine.sampling_params import StructuredOutputsParams, TagStructure

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # a TypedDict of the stubs only


# llguidance's defaults, tightened where a hostile request could make one step slow: the mask
# of one step (step_lexer_fuel, step_max_items) must stay far below a decode step's time.
class _ParserLimits(TypedDict):
    """The llguidance.LLParserLimits arguments the engine sets."""

    max_items_in_row: int
    initial_lexer_fuel: int
    step_lexer_fuel: int
    step_max_items: int
    max_lexer_states: int
    max_grammar_size: int
    verbose_errors: bool


_LIMITS = _ParserLimits(
    max_items_in_row=grammar_bounds.MAX_RULE_ALTERNATIVES,
    initial_lexer_fuel=1_000_000,
    step_lexer_fuel=200_000,
    step_max_items=50_000,
    max_lexer_states=100_000,
    max_grammar_size=200_000,
    verbose_errors=False,
)


class GrammarError(InvalidRequestError):
    """A constraint that cannot be compiled: invalid, unsupported, or beyond the limits."""


def tokenizer_json(hf_tokenizer: Any) -> str:
    """The serialized fast tokenizer that llguidance reads (what llguidance.hf.from_tokenizer
    passes it): sent as it is to the sandbox's workers, so that theirs is the engine's."""
    if not hasattr(hf_tokenizer, "backend_tokenizer"):
        raise ValueError("the grammar library reads only fast (Rust) tokenizers")
    backend = copy.copy(hf_tokenizer.backend_tokenizer)
    backend.no_padding()
    backend.no_truncation()
    return backend.to_str()


def grammar_tokenizer(serialized: str, n_vocab: int, eos_token_ids: list[int]) -> Any:
    """llguidance's tokenizer; ValueError when it cannot read this one (a WordLevel vocabulary
    without a decoder, say)."""
    return llguidance.LLTokenizer(serialized, n_vocab=n_vocab, eos_token=eos_token_ids or None)


def _close_objects(schema: Any) -> Any:
    """The schema with additionalProperties false wherever an object schema does not set it
    (disable_additional_properties). StructuredOutputsParams bounds its depth."""
    if isinstance(schema, list):
        return [_close_objects(v) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _close_objects(v) for k, v in schema.items()}
    is_object = out.get("type") == "object" or "properties" in out
    if is_object and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


_REGEX_META = set("\\.+*?()|[]{}^$#&-~")


def _regex_literal(text: str) -> str:
    return "".join("\\" + ch if ch in _REGEX_META else ch for ch in text)


# The whitespace JSON may have between two tokens unless the request says otherwise: enough for
# pretty-printing (a newline and indentation), bounded, because a grammar that allows unbounded
# whitespace lets a model spend its whole budget on it and return truncated JSON (a failure
# vLLM users meet with any-whitespace JSON grammars, and what a random-weight model always does).
DEFAULT_WHITESPACE_PATTERN = r"[\x20\x0A\x0D\x09]{0,32}"


def _json_options(params: StructuredOutputsParams) -> JsonCompileOptions:
    if params.disable_any_whitespace:
        return {"whitespace_flexible": False}
    return {
        "whitespace_flexible": True,
        "whitespace_pattern": params.whitespace_pattern or DEFAULT_WHITESPACE_PATTERN,
    }


def _special_token(tokenizer: Any, text: str) -> int | None:
    """The id of the special token spelled `text`, if the tokenizer has one."""
    if tokenizer is None or not text:
        return None
    ids = tokenizer.tokenize_str(text)
    return ids[0] if len(ids) == 1 and tokenizer.is_special_token(ids[0]) else None


def _lark_literal(tokenizer: Any, text: str) -> str:
    """Lark for literal text; a special token of the model is that token, which the model emits
    as one id, never as the text that spells it."""
    special = _special_token(tokenizer, text)
    return json.dumps(text) if special is None else f"<[{special}]>"


def _structure_schema(params: StructuredOutputsParams, structure: TagStructure) -> dict[str, Any]:
    """A structural tag's structure's schema as compiled: any JSON object when it gives none,
    under the request's JSON options (whitespace, closed objects), which llguidance reads from
    x-guidance (a request's schema may not carry its own: engine/schema_keywords.py)."""
    schema = structure.tag_schema if structure.tag_schema is not None else {"type": "object"}
    if params.disable_additional_properties:
        schema = _close_objects(schema)
    return {**schema, "x-guidance": _json_options(params)}


def _structural_tag_lark(params: StructuredOutputsParams, tokenizer: Any) -> str:
    """The Lark grammar of a structural tag: free text in which each text trigger is a lazy
    lexeme (it matches where the text first holds it, so the text cannot hold it and go on
    freely) and each special-token trigger that token, followed by one of the structures it
    opens: the rest of its begin, its JSON, its end; then free text again. Structures that
    share a trigger share its lexeme and the model picks among them after it. (llguidance's
    StructTag makes a lexeme per structure and takes any <...> trigger for a special token,
    which SmolLM2's <tool_call>, say, is not: a grammar that does not compile.)"""
    tag = params.structural_tag
    assert tag is not None
    bodies: dict[str, list[str]] = {}
    for structure in tag.structures:
        trigger = tag.trigger_of(structure)
        assert trigger is not None  # StructuralTag checks that every begin has one
        parts = [_lark_literal(tokenizer, structure.begin[len(trigger) :])]
        parts.append(f"%json {json.dumps(_structure_schema(params, structure))}")
        parts.append(_lark_literal(tokenizer, structure.end))
        bodies.setdefault(trigger, []).append(" ".join(p for p in parts if p != '""'))
    names = [f"tag_{i}" for i in range(len(bodies))]
    lines = ["%llguidance {}", f"start: ({' | '.join(names)})* TEXT", r"TEXT: /(.|\n)*/"]
    for name, (trigger, alternatives) in zip(names, bodies.items(), strict=True):
        opened = " | ".join(alternatives)
        if _special_token(tokenizer, trigger) is not None:
            lines.append(f"{name}: TEXT {_lark_literal(tokenizer, trigger)} ({opened})")
        else:
            lines.append(f"{name}_trigger[lazy]: TEXT {json.dumps(trigger)}")
            lines.append(f"{name}: {name}_trigger ({opened})")
    return "\n".join(lines)


def grammar_spec(params: StructuredOutputsParams, tokenizer: Any = None) -> tuple[str, str]:
    """(kind, llguidance grammar) for a constraint, checked against `grammar_bounds` first
    (GrammarBoundError, a ValueError); GrammarError for malformed GBNF. `tokenizer` (an
    llguidance one) tells which structural-tag triggers are special tokens; without it every
    trigger is text."""
    if params.whitespace_pattern is not None:
        grammar_bounds.check_regex(params.whitespace_pattern, "whitespace_pattern")
    if params.json is not None:
        schema = params.json
        if params.disable_additional_properties:
            schema = _close_objects(schema)
        grammar_bounds.check_schema(schema)
        return "json", llguidance.LLMatcher.grammar_from_json_schema(
            schema, defaults=_json_options(params)
        )
    if params.json_object:
        return "json_object", llguidance.LLMatcher.grammar_from_json_schema(
            {"type": "object"}, defaults=_json_options(params)
        )
    if params.regex is not None:
        grammar_bounds.check_regex(params.regex)
        return "regex", llguidance.LLMatcher.grammar_from_regex(params.regex)
    if params.choice is not None:
        alternatives = "|".join(f"({_regex_literal(c)})" for c in params.choice)
        return "choice", llguidance.LLMatcher.grammar_from_regex(alternatives)
    if params.structural_tag is not None:
        # Its Lark embeds each structure's schema (%json), which check_lark checks as one.
        lark = _structural_tag_lark(params, tokenizer)
        grammar_bounds.check_lark(lark, "structural_tag")
        return "structural_tag", llguidance.LLMatcher.grammar_from_lark(lark)
    assert params.grammar is not None  # StructuredOutputsParams holds exactly one constraint
    try:
        lark = llguidance.gbnf_to_lark.any_to_lark(params.grammar)
    except RecursionError:
        raise GrammarError("invalid grammar: it nests too deep", "structured_outputs") from None
    except Exception as e:  # the converter raises its own error types for malformed GBNF
        raise GrammarError(f"invalid grammar: {e}", "structured_outputs") from None
    grammar_bounds.check_lark(lark)
    return "grammar", llguidance.LLMatcher.grammar_from_lark(lark)


# How llguidance words running out of its fuel or size limits.
_LIMIT_ERROR = re.compile(r"fuel|limit|too many|too big", re.IGNORECASE)


def compile_matcher(
    params: StructuredOutputsParams, tokenizer: Any, limits: Any, eos_token_ids: frozenset[int]
) -> tuple[str, Any]:
    """(kind, a matcher at the start of the constraint's grammar), its first mask computed;
    GrammarError for a constraint that is beyond the bounds, invalid, allows no output, or fails
    at its first token. The same call in the sandbox's worker and in the engine."""
    try:
        kind, spec = grammar_spec(params, tokenizer)
        if params.structural_tag is not None:
            _check_structures(params, tokenizer, limits, eos_token_ids)
    except GrammarError:
        raise
    except ValueError as e:  # llguidance's own check of what it is handed, and the bounds
        raise GrammarError(str(e) or "invalid constraint", "structured_outputs") from None
    return kind, _matcher(kind, spec, tokenizer, limits, eos_token_ids)


def _check_structures(
    params: StructuredOutputsParams, tokenizer: Any, limits: Any, eos_token_ids: frozenset[int]
) -> None:
    """Each distinct schema of a structural tag compiled alone, so that a bad one is an
    error that names its structure, and one that no JSON satisfies is refused: the tag's
    grammar would compile (its free text allows output), but the structure, once
    triggered, could never end."""
    tag = params.structural_tag
    assert tag is not None
    seen: set[str] = set()
    for i, structure in enumerate(tag.structures):
        schema = _structure_schema(params, structure)
        key = json.dumps(schema, sort_keys=True)
        if key in seen:
            continue
        seen.add(key)
        where = f"structures[{i}].schema: "
        try:
            spec = llguidance.LLMatcher.grammar_from_json_schema(schema)
        except ValueError as e:
            raise GrammarError(f"{where}{e}", "structured_outputs") from None
        _matcher("json", spec, tokenizer, limits, eos_token_ids, where)


def _matcher(
    kind: str,
    spec: str,
    tokenizer: Any,
    limits: Any,
    eos_token_ids: frozenset[int],
    where: str = "",
) -> Any:
    """A matcher at the start of a grammar; GrammarError (its message after `where`) when
    the grammar is in error, fails computing its first mask, or no output satisfies it."""
    # The constructor validates and builds the lexer, without the GIL.
    matcher = llguidance.LLMatcher(tokenizer, spec, log_level=0, limits=limits)
    if matcher.is_error():
        raise GrammarError(where + _explain(kind, matcher.get_error()), "structured_outputs")
    # The first mask also warms the lexer; a constraint whose lexer runs out of its limits
    # fails here, with a 400, rather than at the first sampled token.
    mask = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8).copy()
    for eos in eos_token_ids:
        mask[eos // 8] &= ~(1 << (eos % 8)) & 0xFF
    error = matcher.get_error() if matcher.is_error() else None
    if error is not None and _LIMIT_ERROR.search(error):
        first = error.strip().splitlines()[0]
        raise GrammarError(
            f"{where}the {_KIND_NAMES[kind]} is too costly to follow within the grammar "
            f"library's limits ({first}): simplify it",
            "structured_outputs",
        )
    # Some output satisfies the grammar: a first token other than EOS is allowed, or the empty
    # output is complete. (A schema that only refers to itself compiles, yet allows nothing.)
    if not mask.any() and not matcher.is_accepting():
        raise GrammarError(
            f"{where}the {_KIND_NAMES[kind]} allows no output at all", "structured_outputs"
        )
    if error is not None:
        raise GrammarError(where + _explain(kind, error), "structured_outputs")
    return matcher


_KIND_NAMES = {
    "json": "JSON schema",
    "json_object": "JSON object",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
    "structural_tag": "structural tag",
}


def _explain(kind: str, error: str) -> str:
    first = error.strip().splitlines()[0] if error.strip() else "unknown error"
    if kind in ("json", "json_object"):
        if "Unimplemented keys" in first:
            return f"the JSON schema uses unsupported features: {first}"
        return f"invalid JSON schema: {first}"
    if kind == "grammar":
        return f"invalid grammar: {first}"
    return f"invalid {_KIND_NAMES[kind]}: {first}"
