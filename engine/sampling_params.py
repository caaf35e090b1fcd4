"""Per-request sampling settings, as vLLM's SamplingParams."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# Below this temperature sampling is treated as greedy: dividing by it would overflow.
_GREEDY_EPS = 1e-5


class SamplingParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    n: int = Field(default=1, ge=1, le=128)
    max_tokens: int | None = Field(default=16, ge=1)
    min_tokens: int = Field(default=0, ge=0)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)  # 0 or -1: all tokens
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=2.0)
    seed: int | None = None
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=20)
    skip_special_tokens: bool = True

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, v: object) -> object:
        if v is None:
            return []
        if isinstance(v, str):
            return [v]
        return v

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, v: list[str]) -> list[str]:
        if any(s == "" for s in v):
            raise ValueError("stop strings must not be empty")
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
