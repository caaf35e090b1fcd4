"""OpenAI request schemas, validated with pydantic. Unknown fields are rejected as
OpenAI rejects them; vLLM's sampling extensions (top_k, min_p, repetition_penalty, ignore_eos,
min_tokens, stop_token_ids, ...) are accepted, so clients written for vLLM work unchanged.

Types are strict (no "16" for an integer, no "yes" for a boolean; a JSON integer is still a valid
float) and every number has bounds, so that nothing a client sends can reach the sampler out of
the range it accepts. The bounds that depend on the model (token ids and top_k inside the
vocabulary, the context length) are checked by the serving context and the engine."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    field_validator,
    model_validator,
)

from kvfleet.engine.sampling_params import (
    MAX_STRUCTURES,
    SamplingParams,
    StructuralTag,
    StructuredOutputsParams,
    TagStructure,
    TagText,
    check_tag_shape,
)
from kvfleet.protocol.chat_template import ChatMessage
from kvfleet.protocol.tool_prompt import ChatTool

# The sampler's generator takes a signed 64-bit seed.
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
# Caps on what one request may ask for; each is said in the error that enforces it.
MAX_N = 128
MAX_PROMPTS = 64
MAX_STOP = 16
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 64
MAX_TOKENS_CAP = 2**31 - 1
TOP_K_CAP = 2**31 - 1
TOKEN_ID_MAX = 2**31 - 1
# OpenAI's limits on the tools of one request and on logit_bias.
MAX_TOOLS = 128
MAX_LOGIT_BIAS = 300
LOGIT_BIAS_LIMIT = 100.0


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


TokenId = Annotated[int, Field(ge=0, le=TOKEN_ID_MAX)]
TokenIds = list[TokenId]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(_Strict):
    """OpenAI's response_format.json_schema."""

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    # `schema` would shadow BaseModel.schema(); the JSON field is still "schema".
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    # Outputs always follow the schema here, strict or not (as in vLLM).
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    # vLLM's structural tag (type "structural_tag"): free text whose triggered parts follow
    # their structures' schemas.
    structures: list[TagStructure] | None = Field(
        default=None, min_length=1, max_length=MAX_STRUCTURES
    )
    triggers: list[TagText] | None = Field(default=None, min_length=1, max_length=MAX_STRUCTURES)

    @model_validator(mode="before")
    @classmethod
    def _tag_shape(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("type") == "structural_tag":
            check_tag_shape(data)
        return data

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError('json_schema is required with type "json_schema", and only then')
        tag_fields = self.structures is not None or self.triggers is not None
        if self.type == "structural_tag":
            if self.structures is None or self.triggers is None:
                raise ValueError('type "structural_tag" needs structures and triggers')
            # Each begin's trigger and the schemas' bounds, reported under response_format.
            self.structural_tag()
        elif tag_fields:
            raise ValueError('structures and triggers are only allowed with type "structural_tag"')
        if self.json_schema is not None and self.json_schema.json_schema is not None:
            # The schema's own bounds (depth, size), reported under response_format.
            StructuredOutputsParams(json=self.json_schema.json_schema)
        return self

    def structural_tag(self) -> StructuralTag:
        assert self.structures is not None and self.triggers is not None
        return StructuralTag(structures=self.structures, triggers=self.triggers)


# vLLM's pre-2025 request extras for constraints: it removed them, so refused with the new name.
_REMOVED_GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
    "guided_decoding_backend": None,
    "guided_whitespace_pattern": "whitespace_pattern",
}


class _SamplingRequest(_Strict):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1, le=TOP_K_CAP)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=2.0)
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    stop: StopString | list[StopString] | None = None
    stop_token_ids: TokenIds | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0, le=MAX_TOKENS_CAP)
    skip_special_tokens: bool = True
    # vLLM's extension: each prompt token's logprob (and the top N) in the response.
    prompt_logprobs: int | None = Field(default=None, ge=0, le=20)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # OpenAI's shape: token id (as a JSON object key, so a string) -> bias in [-100, 100].
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    # vLLM's extension: a regex, choice, grammar, JSON or structural-tag constraint on the output.
    structured_outputs: StructuredOutputsParams | None = None

    @model_validator(mode="before")
    @classmethod
    def _no_guided_fields(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for old, new in _REMOVED_GUIDED.items():
                if old in data:
                    instead = f"structured_outputs.{new}" if new else "structured_outputs"
                    raise ValueError(f"{old} was removed (as in vLLM): use {instead}")
        return data

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> _SamplingRequest:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        if self.structured_outputs is not None and self.response_format_constraint is not None:
            raise ValueError("give response_format or structured_outputs, not both")
        if isinstance(self.stop, list) and len(self.stop) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences are allowed")
        return self

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias_bounds(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if not v:
            return v
        if len(v) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} token ids are allowed, got {len(v)}")
        for key, bias in v.items():
            if not (key.isascii() and key.isdigit() and int(key) <= TOKEN_ID_MAX):
                raise ValueError(f"keys must be token ids (non-negative integers), got {key!r}")
            if not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:
                raise ValueError(
                    f"the bias of token {key} is {bias}; biases must be within "
                    f"[-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}]"
                )
        return v

    @property
    def scores_prompt(self) -> int | None:
        """Top N of the prompt's logprobs the engine computes; None: none."""
        return self.prompt_logprobs

    @property
    def response_format_constraint(self) -> StructuredOutputsParams | None:
        rf = self.response_format
        if rf is None or rf.type == "text":
            return None
        if rf.type == "structural_tag":
            return StructuredOutputsParams(structural_tag=rf.structural_tag())
        if rf.json_schema is not None and rf.json_schema.json_schema is not None:
            return StructuredOutputsParams(json=rf.json_schema.json_schema)
        return StructuredOutputsParams(json_object=True)

    @property
    def constraint(self) -> tuple[StructuredOutputsParams | None, str]:
        """The output constraint and the request field that set it (for its errors)."""
        from_format = self.response_format_constraint
        if from_format is not None:
            return from_format, "response_format"
        return self.structured_outputs, "structured_outputs"

    def _sampling(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        values: dict[str, Any] = {
            "n": self.n,
            "max_tokens": max_tokens,
            "min_tokens": self.min_tokens,
            "seed": self.seed,
            "stop": self.stop,
            "stop_token_ids": self.stop_token_ids or [],
            "ignore_eos": self.ignore_eos,
            "logprobs": logprobs,
            "prompt_logprobs": self.scores_prompt,
            "skip_special_tokens": self.skip_special_tokens,
            "logit_bias": {int(k): b for k, b in (self.logit_bias or {}).items()} or None,
            "structured_outputs": self.constraint[0],
        }
        for name in (
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
        ):
            value = getattr(self, name)
            if value is not None:
                values[name] = value
        return SamplingParams(**values)


def _prompt_shape(value: Any) -> str:
    if isinstance(value, str):
        return "text"
    if isinstance(value, list) and value:
        if isinstance(value[0], str):
            return "texts"
        if isinstance(value[0], list):
            return "token_lists"
    return "tokens"


# The shape picks the one schema to validate against: trying each member of a plain union would
# build an error for every element of a long token list that the other members reject.
Prompt = Annotated[
    Annotated[str, Tag("text")]
    | Annotated[list[str], Tag("texts")]
    | Annotated[TokenIds, Tag("tokens")]
    | Annotated[list[TokenIds], Tag("token_lists")],
    Discriminator(_prompt_shape),
]


class CompletionRequest(_SamplingRequest):
    prompt: Prompt
    # 0 only with echo: the prompt scored, nothing generated (how lm-eval-harness asks).
    max_tokens: int | None = Field(default=16, ge=0, le=MAX_TOKENS_CAP)
    logprobs: int | None = Field(default=None, ge=0, le=5)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1, le=MAX_N)

    @model_validator(mode="after")
    def _check(self) -> CompletionRequest:
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.best_of not in (None, self.n):
            raise ValueError("best_of other than n is not supported")
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens 0 needs echo (it scores the prompt, generating nothing)")
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt must not be empty")
        if len(self.prompts()) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts are allowed in one request")
        return self

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [p]  # type: ignore[list-item]
        return list(p)  # type: ignore[arg-type]

    @property
    def scores_prompt(self) -> int | None:
        """Top N of the prompt's logprobs to compute: echo with logprobs scores the echoed
        prompt (as OpenAI and vLLM do); the larger of that and prompt_logprobs."""
        echoed = self.logprobs if self.echo else None
        asked = [n for n in (echoed, self.prompt_logprobs) if n is not None]
        return max(asked) if asked else None

    def sampling_params(self, max_tokens: int | None) -> SamplingParams:
        return self._sampling(max_tokens, self.logprobs)


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS_CAP)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS_CAP)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[ChatTool] | None = Field(default=None, max_length=MAX_TOOLS)
    # None: "auto" with tools, "none" without, as OpenAI defaults it.
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice(cls, v: object) -> object:
        # One message for any bad value, rather than one per member of the union.
        if v is None or v in ("none", "auto", "required"):
            return v
        try:
            return NamedToolChoice.model_validate(v)
        except ValidationError:
            raise ValueError(
                'must be "none", "auto", "required" or {"type": "function", "function": '
                '{"name": ...}}'
            ) from None

    @model_validator(mode="after")
    def _check(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs are not available when stream is true (as in vLLM)")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def sampling_params(self, max_tokens: int | None) -> SamplingParams:
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling(max_tokens, logprobs)


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    # With messages, as on chat completions: the prompt is counted as chat renders it.
    add_generation_prompt: bool = True
    tools: list[ChatTool] | None = Field(default=None, max_length=MAX_TOOLS)
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        if self.prompt is not None and (
            self.tools is not None or self.chat_template_kwargs is not None
        ):
            raise ValueError("tools and chat_template_kwargs go with messages, not prompt")
        return self


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: TokenIds
