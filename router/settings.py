"""The settings of ``kvfleet-router``: where it serves and finds its engines (ServingSettings), and
how it routes, within which bounds (RouterSettings). Its flags are built from these fields
(kvfleet.telemetry.settings_flags), each the flag of its name."""

from __future__ import annotations

import functools
import os
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvfleet.protocol.byte_size import ByteSize
from kvfleet.protocol.json_body import JsonLimits
from kvfleet.protocol.tool_prompt import TOOL_CALL_PARSERS
from kvfleet.router.breaker import BreakerPolicy
from kvfleet.router.endpoints import parse_static
from kvfleet.router.kv_index import MAX_BLOCKS
from kvfleet.router.request_body import BodyLimits
from kvfleet.router.routing_key import CHARS_PER_TOKEN, KeyPolicy
from kvfleet.telemetry.ports import ENGINE_PORT, ROUTER_PORT
from kvfleet.telemetry.settings_flags import Flag

# The engines' API key, for the router's own requests to them (KV events, the tokenizer): read
# from the environment only, never a flag, where the node's process table would show it.
ENGINE_API_KEY_ENV = "KVFLEET_ENGINE_API_KEY"


def engine_api_key() -> str | None:
    return os.environ.get(ENGINE_API_KEY_ENV, "").strip() or None


class _StaticEndpoints:
    """--endpoints as written: ``host:port,host:port`` (a settings_flags FlagSyntax)."""

    metavar = ""
    forms = ""

    def parse(self, text: str) -> frozenset[str]:
        return parse_static(text)

    def show(self, value: frozenset[str]) -> str:
        return ",".join(sorted(value))


class ServingSettings(BaseModel):
    """Where the router listens, and where it finds the engines: the EndpointSlices of a
    Service, or a static list."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = Field(default="0.0.0.0", description="address to listen on")
    port: int = Field(default=ROUTER_PORT, ge=0, le=65535, description="port to listen on")
    engine_service: str | None = Field(
        default=None, description="watch this Service's EndpointSlices; this or --endpoints"
    )
    endpoints: Annotated[frozenset[str] | None, _StaticEndpoints()] = Field(
        default=None, description="static host:port,host:port list; this or --engine-service"
    )
    namespace: str | None = Field(
        default=None, description="of the engine Service (default: the pod's namespace)"
    )
    engine_port: int = Field(
        default=ENGINE_PORT,
        ge=1,
        le=65535,
        description="the engines' HTTP port, with --engine-service",
    )
    tokenizer: str | None = Field(
        default=None,
        description="local HF tokenizer directory for token prefix keys; default: the engines' "
        "own (GET /tokenizer) with --prefix-scoring precise, prefix keys of characters until "
        "it is fetched",
    )
    tool_call_parser: Literal[TOOL_CALL_PARSERS] | None = Field(  # type: ignore[valid-type]
        default=None,
        description="the engines' --tool-call-parser, in whose format a --tokenizer's template "
        "that reads no tools gets a request's tools (default: the one the template points to, "
        "as the engines default; a fetched tokenizer comes with the engines' own)",
    )

    @model_validator(mode="after")
    def _one_source(self) -> ServingSettings:
        if (self.engine_service is None) == (self.endpoints is None):
            raise ValueError("give one of --engine-service and --endpoints")
        return self


class RouterSettings(BaseModel):
    """How the router keys requests and spreads them over the engines, and the bounds it
    holds clients and engines to."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    session_header: str = Field(
        default=KeyPolicy.session_header,
        description="request header whose value keeps a session on one engine",
    )
    use_user_field: bool = Field(
        default=KeyPolicy.use_user_field,
        description="key a request without that header by its body's user",
    )
    prefix_affinity: bool = Field(
        default=KeyPolicy.prefix_affinity,
        description="key any other request by its prompt's prefix",
    )
    prefix_length: int = Field(
        default=KeyPolicy.prefix_length, ge=1, description="prompt tokens in the key"
    )
    load_factor: float = Field(
        default=1.25,
        ge=1,
        description="an engine takes at most this times the mean load before keys spill to the "
        "next",
    )
    prefix_scoring: Literal["precise", "approximate"] = Field(
        default="precise",
        description="precise: score engines by the prompt blocks they hold, from their KV events "
        "(needs a tokenizer, --tokenizer or the engines'; approximate for an engine whose events "
        "are stale); approximate: "
        "the prefix key on the hash ring alone",
    )
    prefix_scoring_tokens: int = Field(
        default=1024,
        ge=16,
        description="prompt tokens precise scoring tokenizes and scores, at most (a prompt's "
        "head decides where it goes, and tokenizing is the router's largest cost)",
    )
    kv_events_stale_after: float = Field(
        default=3.0,
        gt=0,
        allow_inf_nan=False,
        description="seconds without a line from an engine's KV events (it sends one a second) "
        "before its view is stale and its stream is opened again",
    )
    kv_index_max_blocks: int = Field(
        default=MAX_BLOCKS, ge=1, description="KV block hashes indexed per engine, at most"
    )
    engine_load_interval: float = Field(
        default=1.0,
        ge=0,
        allow_inf_nan=False,
        description="seconds between reads of each engine's own load (its /metrics), which the "
        "load bound counts; 0: own requests only",
    )
    hold_timeout: float = Field(
        default=120.0, ge=0, description="seconds a request waits for a ready engine"
    )
    max_body_bytes: ByteSize = Field(
        default=BodyLimits.max_bytes, ge=1024, description="larger request bodies get 413"
    )
    max_json_depth: int = Field(
        default=JsonLimits.max_depth, ge=8, description="deeper-nested request bodies get 400"
    )
    body_timeout: float = Field(
        default=30.0, gt=0, description="seconds a client has to send a request body"
    )
    keepalive_timeout: float = Field(
        default=15.0,
        gt=0,
        description="seconds an idle connection stays open; also the time to send a request head",
    )
    # A non-streamed answer's headers come when its generation ends, so this is the longest
    # generation the router waits for; the OpenAI SDK's own default timeout is as long.
    upstream_first_byte_timeout: float = Field(
        default=600.0,
        gt=0,
        allow_inf_nan=False,
        description="seconds an engine has to begin its answer once the request is sent; a "
        "non-streamed answer begins when its generation ends",
    )
    # A stream is silent from its start until its first token: while the request waits in the
    # engine's queue and its prompt prefills (seconds for the longest prompts; the engine calls
    # itself stalled after 60 s in one step), and while a preempted request waits to resume.
    upstream_idle_timeout: float = Field(
        default=120.0,
        gt=0,
        allow_inf_nan=False,
        description="seconds an engine may send nothing once its answer began, and before a "
        "stream's headers; covers a queued request's wait and its prefill",
    )
    breaker_failures: int = Field(
        default=BreakerPolicy.failures, description="consecutive failures that eject an engine"
    )
    breaker_backoff: float = Field(
        default=BreakerPolicy.backoff_s,
        description="seconds of the first ejection; doubles for each in a row",
    )
    breaker_max_backoff: float = Field(
        default=BreakerPolicy.max_backoff_s, description="the longest ejection, in seconds"
    )

    # Set by code only (tests): the fraction of an ejection cut off at random, and the time an
    # ejected engine's /health probe has.
    breaker_jitter: Annotated[float, Flag(on_command_line=False)] = BreakerPolicy.jitter
    probe_timeout: Annotated[float, Flag(on_command_line=False)] = Field(default=5.0, gt=0)

    @model_validator(mode="after")
    def _valid_breaker(self) -> RouterSettings:
        try:
            _ = self.breaker
        except ValueError as e:
            raise ValueError(f"circuit breaker: {e}") from None
        return self

    @functools.cached_property
    def policy(self) -> KeyPolicy:
        return KeyPolicy(
            self.session_header, self.use_user_field, self.prefix_affinity, self.prefix_length
        )

    @functools.cached_property
    def tokenized_chars(self) -> int:
        """The characters of a prompt tokenized: enough for the prefix key's tokens even at 8
        characters a token (a key must not change with the prompt's length), and for precise
        scoring's at 4 (fewer at wordier text costs only a shorter score)."""
        need = 2 * CHARS_PER_TOKEN * self.prefix_length
        if self.prefix_scoring == "precise":
            need = max(need, CHARS_PER_TOKEN * self.prefix_scoring_tokens)
        return need

    @functools.cached_property
    def body(self) -> BodyLimits:
        return BodyLimits(max_bytes=self.max_body_bytes, max_depth=self.max_json_depth)

    @functools.cached_property
    def breaker(self) -> BreakerPolicy:
        return BreakerPolicy(
            failures=self.breaker_failures,
            backoff_s=self.breaker_backoff,
            max_backoff_s=self.breaker_max_backoff,
            jitter=self.breaker_jitter,
        )
