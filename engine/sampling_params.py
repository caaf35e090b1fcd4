"""Per-request sampling settings, as vLLM's SamplingParams.

Every field is bounded here, whatever front end built it, so that no value can reach the
sampler's tensor ops out of range: seeds fit torch.Generator.manual_seed, floats are finite,
counts fit int32. Bounds that depend on the model (top_k and stop_token_ids within the
vocabulary, min_tokens within the context) are EngineCore.admit's."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

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


def child_seed(seed: int, index: int) -> int:
    """The seed of child `index` of an n > 1 request: seed + index, wrapped around within the
    signed 64-bit range so that it never leaves it."""
    return (seed + index - SEED_MIN) % 2**64 + SEED_MIN


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
    skip_special_tokens: bool = True

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
