"""Per-request sampling settings, as vLLM's SamplingParams.

Every field is bounded here, whatever front end built it, so that no value can reach the
sampler's tensor ops out of range: seeds fit torch.Generator.manual_seed, floats are finite,
counts fit int32. Bounds that depend on the model (top_k and stop_token_ids within the
vocabulary, min_tokens within the context) are admission's (Admission.admit)."""

from __future__ import annotations

import json as _json
import warnings
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from kvfleet.engine.schema_keywords import keyword_problem
from kvfleet.protocol.json_body import JsonLimits, RequestRefused, decode_json_text

# Below this temperature sampling is treated as greedy: dividing by it would overflow.
_GREEDY_EPS = 1e-5

# The signed 64-bit range, as vLLM takes it: torch.Generator.manual_seed accepts every value in it.
SEED_MIN = -(2**63)
SEED_MAX = 2**63 - 1
INT32_MAX = 2**31 - 1
MAX_N = 128
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
# OpenAI's bounds on logit_bias.
MAX_LOGIT_BIAS_ENTRIES = 300
LOGIT_BIAS_LIMIT = 100.0
# Size bounds on a structured-output constraint, checked before anything compiles it.
MAX_STRUCTURED_SPEC_CHARS = 64 * 1024
# A schema or structural tag sent as JSON text: its length, before it is parsed (room for
# pretty-printing a constraint whose compact form is within MAX_STRUCTURED_SPEC_CHARS).
MAX_STRUCTURED_TEXT_CHARS = 4 * MAX_STRUCTURED_SPEC_CHARS
MAX_CHOICES = 256
MAX_CHOICE_CHARS = 1024
# Nesting of a JSON schema's own JSON. The grammar library refuses more than 128 levels and
# crashes the process on some thousands; no real schema comes near this.
MAX_SCHEMA_DEPTH = 64
# Structures (and triggers) of one structural tag: one a tool, as OpenAI's cap on tools.
MAX_STRUCTURES = 128
_TEXT_LIMITS = JsonLimits(max_depth=MAX_SCHEMA_DEPTH)


def child_seed(seed: int, index: int) -> int:
    """The seed of child `index` of an n > 1 request: seed + index, wrapped around within the
    signed 64-bit range so that it never leaves it."""
    return (seed + index - SEED_MIN) % 2**64 + SEED_MIN


def json_depth(value: Any, limit: int) -> int:
    """Nesting depth of a JSON value, counted without recursion (the value may be hostile) and
    only up to limit + 1."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        deepest = max(deepest, depth)
        if depth > limit:
            break
        if isinstance(v, dict):
            stack.extend((x, depth + 1) for x in v.values())
        elif isinstance(v, list):
            stack.extend((x, depth + 1) for x in v)
    return deepest


def check_schema(schema: dict[str, Any], what: str) -> None:
    """ValueError for a JSON schema beyond the bounds every constraint's schema has, or with a
    keyword the grammar would not follow as written (kvfleet.engine.schema_keywords)."""
    if json_depth(schema, MAX_SCHEMA_DEPTH) > MAX_SCHEMA_DEPTH:
        raise ValueError(f"{what} nests deeper than {MAX_SCHEMA_DEPTH} levels")
    if len(_json.dumps(schema)) > MAX_STRUCTURED_SPEC_CHARS:
        raise ValueError(f"{what} is longer than {MAX_STRUCTURED_SPEC_CHARS} characters")
    problem = keyword_problem(schema)
    if problem is not None:
        raise ValueError(f"{what}: {problem}")


def check_tag_shape(data: Any) -> None:
    """ValueError for a structural tag in xgrammar's newer shape, which nests its formats under
    "format": said as such rather than as an unknown field."""
    if isinstance(data, dict) and "format" in data:
        raise ValueError(
            'the "format" shape of structural tags is not supported: give "structures" '
            '(each with "begin", "schema", "end") and "triggers"'
        )


TagText = Annotated[str, Field(min_length=1, max_length=MAX_CHOICE_CHARS)]


class TagStructure(BaseModel):
    """One structure of a structural tag: the text from `begin` to `end` holds JSON that follows
    `schema`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    begin: TagText
    # `schema` would shadow BaseModel.schema(); the JSON field is still "schema".
    tag_schema: dict[str, Any] | None = Field(
        default=None,
        alias="schema",
        description="a JSON schema of what comes between begin and end; default any JSON object",
    )
    end: str = Field(max_length=MAX_CHOICE_CHARS, description="may be empty")


class StructuralTag(BaseModel):
    """vLLM's structural tag: free text, except that once the output holds one of `triggers`, it
    goes on as one of the structures whose `begin` starts with that trigger, to its `end`. How
    agent frameworks hold tool calls such as `<function=f>{...}</function>` to their schemas
    while the rest stays free."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["structural_tag"] = "structural_tag"
    structures: list[TagStructure] = Field(min_length=1, max_length=MAX_STRUCTURES)
    triggers: list[TagText] = Field(min_length=1, max_length=MAX_STRUCTURES)

    @model_validator(mode="before")
    @classmethod
    def _legacy_shape_only(cls, data: Any) -> Any:
        check_tag_shape(data)
        return data

    @model_validator(mode="after")
    def _check(self) -> StructuralTag:
        for i, structure in enumerate(self.structures):
            if self.trigger_of(structure) is None:
                raise ValueError(
                    f"structures[{i}].begin {structure.begin!r} starts with none of the "
                    f"triggers {self.triggers}: each begin must start with a trigger"
                )
            if structure.tag_schema is not None:
                check_schema(structure.tag_schema, f"structures[{i}].schema")
        if len(self.model_dump_json()) > MAX_STRUCTURED_SPEC_CHARS:
            raise ValueError(
                f"structural_tag is longer than {MAX_STRUCTURED_SPEC_CHARS} characters"
            )
        return self

    def trigger_of(self, structure: TagStructure) -> str | None:
        """The trigger that opens a structure: the shortest its begin starts with, since the
        output holds that one first."""
        starts = [t for t in self.triggers if structure.begin.startswith(t)]
        return min(starts, key=len) if starts else None


# vLLM's field name `json` shadows BaseModel's deprecated json() method, on purpose: the field
# value wins on instances, and pydantic's warning about it says nothing a user can act on.
warnings.filterwarnings("ignore", message='Field name "json" in "StructuredOutputsParams"')


class StructuredOutputsParams(BaseModel):
    """A constraint on the generated text, named and shaped as vLLM's `structured_outputs`:
    exactly one of json (a JSON schema), regex, choice, grammar or json_object (any JSON object).

    The pre-2025 `guided_*` request fields are not accepted as aliases: vLLM removed them, and a
    second spelling of the same constraint would let two fields contradict each other."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    json: dict[str, Any] | None = Field(
        default=None, description="a JSON schema (an object, or its JSON text)"
    )
    regex: str | None = Field(default=None, min_length=1, max_length=MAX_STRUCTURED_SPEC_CHARS)
    choice: list[Annotated[str, Field(min_length=1, max_length=MAX_CHOICE_CHARS)]] | None = Field(
        default=None, min_length=1, max_length=MAX_CHOICES
    )
    grammar: str | None = Field(
        default=None,
        min_length=1,
        max_length=MAX_STRUCTURED_SPEC_CHARS,
        description="a context-free grammar: Lark syntax, or GBNF (a `root ::=` rule)",
    )
    json_object: bool | None = Field(default=None, description="true: any JSON object")
    structural_tag: StructuralTag | None = Field(
        default=None, description="free text with triggered structures (an object or its JSON text)"
    )
    disable_any_whitespace: bool = Field(
        default=False, description="JSON without whitespace between tokens"
    )
    disable_additional_properties: bool = Field(
        default=False,
        description="objects of the schema that do not say otherwise allow no extra properties",
    )
    whitespace_pattern: str | None = Field(
        default=None,
        min_length=1,
        max_length=MAX_CHOICE_CHARS,
        description="a regex for the whitespace JSON may have between tokens; default: at "
        "most 32 spaces, tabs or newlines",
    )

    @field_validator("json", "structural_tag", mode="before")
    @classmethod
    def _object_or_its_text(cls, v: object, info: ValidationInfo) -> object:
        # vLLM takes a schema as an object or as its JSON text, and a structural tag as JSON
        # text (its request field is a string); an object is as good. The text is bounded in
        # length and nesting before it is parsed, as a request body is.
        if isinstance(v, str):
            if len(v) > MAX_STRUCTURED_TEXT_CHARS:
                raise ValueError(
                    f"{info.field_name} is {len(v)} characters of JSON text; at most "
                    f"{MAX_STRUCTURED_TEXT_CHARS} are accepted"
                )
            try:
                v = decode_json_text(v, _TEXT_LIMITS, info.field_name or "the text")
            except RequestRefused as e:
                raise ValueError(e.message) from None
            if not isinstance(v, dict):
                what = "a JSON schema object" if info.field_name == "json" else "a JSON object"
                raise ValueError(f"{info.field_name} must be {what}")
        return v

    @model_validator(mode="after")
    def _one_constraint(self) -> StructuredOutputsParams:
        set_ = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name)]
        if self.json_object:
            set_.append("json_object")
        if self.structural_tag is not None:
            set_.append("structural_tag")
        if len(set_) != 1:
            raise ValueError(
                "structured_outputs needs exactly one of json, regex, choice, grammar, "
                f"json_object, structural_tag; got {', '.join(set_) if set_ else 'none'}"
            )
        if self.json is not None:
            check_schema(self.json, "json schema")
        if self.disable_any_whitespace and self.whitespace_pattern is not None:
            raise ValueError("disable_any_whitespace and whitespace_pattern exclude each other")
        return self


class SamplingParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    n: int = Field(default=1, ge=1, le=MAX_N, description=f"completions per prompt, 1..{MAX_N}")
    max_tokens: int | None = Field(
        default=16, ge=1, le=INT32_MAX, description="None: up to the context length"
    )
    min_tokens: int = Field(
        default=0, ge=0, le=INT32_MAX, description="at most max_tokens and the context room"
    )
    temperature: float = Field(default=1.0, ge=0.0, le=2.0, description="finite, 0..2")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="finite, (0, 1]")
    top_k: int = Field(
        default=0, ge=-1, le=INT32_MAX, description="0 or -1: all tokens; at most the vocabulary"
    )
    min_p: float = Field(default=0.0, ge=0.0, le=1.0, description="finite, 0..1")
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0, description="finite, -2..2")
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0, description="finite, -2..2")
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=2.0, description="finite, (0, 2]")
    seed: int | None = Field(
        default=None,
        ge=SEED_MIN,
        le=SEED_MAX,
        description="signed 64-bit; child i of an n > 1 request uses seed + i, wrapped in range",
    )
    stop: list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS)]] = Field(
        default_factory=list,
        max_length=MAX_STOP_STRINGS,
        description=f"at most {MAX_STOP_STRINGS} non-empty strings of at most "
        f"{MAX_STOP_STRING_CHARS} characters",
    )
    stop_token_ids: list[Annotated[int, Field(ge=0, le=INT32_MAX)]] = Field(
        default_factory=list,
        max_length=MAX_STOP_TOKEN_IDS,
        description=f"at most {MAX_STOP_TOKEN_IDS} ids, each inside the vocabulary",
    )
    ignore_eos: bool = False
    logprobs: int | None = Field(
        default=None, ge=0, le=MAX_LOGPROBS, description=f"top logprobs a token, 0..{MAX_LOGPROBS}"
    )
    prompt_logprobs: int | None = Field(
        default=None,
        ge=0,
        le=MAX_LOGPROBS,
        description="logprob of each prompt token given the ones before it, plus the top N "
        f"(0..{MAX_LOGPROBS}); such a request takes no prefix-cache hit, as in vLLM",
    )
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: (
        dict[
            Annotated[int, Field(ge=0, le=INT32_MAX)],
            Annotated[float, Field(ge=-LOGIT_BIAS_LIMIT, le=LOGIT_BIAS_LIMIT)],
        ]
        | None
    ) = Field(
        default=None,
        max_length=MAX_LOGIT_BIAS_ENTRIES,
        description=f"token id -> a bias in [-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}] added to "
        f"its logit before sampling, at most {MAX_LOGIT_BIAS_ENTRIES} ids inside the vocabulary",
    )

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, v: object) -> object:
        if v is None:
            return []
        if isinstance(v, str):
            return [v]
        return v

    @model_validator(mode="after")
    def _check(self) -> SamplingParams:
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"
            )
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS or self.top_k == 1

    @property
    def uses_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )
