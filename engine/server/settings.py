"""The settings of `kvfleet-engine serve`'s HTTP server, apart from the server itself: the command
line builds its flags from them without importing the engine (torch) or aiohttp."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from kvfleet.engine.liveness import CPU_SECONDS_PER_TOKEN, GPU_SECONDS_PER_TOKEN
from kvfleet.protocol.byte_size import ByteSize
from kvfleet.protocol.tool_prompt import TOOL_CALL_PARSERS
from kvfleet.telemetry.ports import ENGINE_PORT

API_KEY_ENV = "KVFLEET_API_KEY"


class ServerSettings(BaseModel):
    """How `kvfleet-engine serve` serves the engine: address, names, auth, bounds, shutdown."""

    model_config = ConfigDict(extra="forbid")

    host: str = Field(
        default="0.0.0.0",
        description="the address to listen on: 0.0.0.0 every IPv4 interface, 127.0.0.1 this "
        "machine only, :: every IPv6 one",
    )
    port: int = Field(
        default=ENGINE_PORT, ge=0, le=65535, description="the TCP port; 0: any free one"
    )
    served_model_name: list[str] | None = Field(
        default=None,
        description="the names clients give as the request's model (the first is the one "
        "/metrics shows); default: the --model path, or smollm2-135m-instruct for the default "
        "model",
    )
    api_key: str | None = Field(
        default=None,
        description="the API key clients must send as a bearer token (visible in the process "
        f"table: prefer --api-key-file or the {API_KEY_ENV} environment variable)",
    )
    api_key_file: str | None = Field(
        default=None, description="a file holding the API key (used when --api-key is not given)"
    )
    max_waiting_requests: int | None = Field(
        default=None,
        ge=1,
        description="sequences (prompts x n) allowed to wait for the engine; more get 429",
    )
    shutdown_timeout: float = Field(
        default=30.0,
        ge=0,
        description="seconds in-flight requests get to finish after SIGTERM or Ctrl-C before "
        "they are aborted (a second signal aborts them at once and exits 128 + its number); a "
        "step still running then is interrupted and the process exits 0 (1 if the step is "
        "stuck: past its /health bound, it is left behind)",
    )
    max_request_body_bytes: ByteSize = Field(
        default=16 << 20,
        ge=1024,
        description="the largest request body accepted; a larger one gets 413",
    )
    health_stall_timeout: float = Field(
        default=60.0,
        gt=0,
        description="/health reports the engine stuck (503) when a step runs longer than this "
        "plus its tokens' allowance (--health-seconds-per-token), or when no step starts for "
        "this long while requests wait",
    )
    health_seconds_per_token: float | None = Field(
        default=None,
        gt=0,
        description="the least time a step is allowed per token it computes, on top of "
        "--health-stall-timeout; four times the rate of the engine's recent steps when that is "
        f"more. Default: {CPU_SECONDS_PER_TOKEN} on the CPU, {GPU_SECONDS_PER_TOKEN} on a GPU",
    )
    header_timeout: float = Field(
        default=15.0,
        gt=0,
        description="seconds a connection may go without a complete request head, when new or "
        "idle between keep-alive requests; then it is closed",
    )
    body_timeout: float = Field(
        default=30.0,
        gt=0,
        description="seconds a client has to send a request body; then 408",
    )
    chat_template: str | None = Field(
        default=None,
        description="a Jinja chat template (a file, or the template inline) used instead of the "
        "model's own; default: the model's, ChatML when it has none",
    )
    tool_call_parser: Literal[TOOL_CALL_PARSERS] | None = Field(  # type: ignore[valid-type]
        default=None,
        description="how tool calls are read from the model's output; default: from the chat "
        "template's family (Llama 3 tokens: llama3_json, Mistral's: mistral, else hermes)",
    )
    enable_runtime_lora_updating: bool = Field(
        default=False,
        description="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's), "
        "which load and unload LoRA adapters while the server runs; needs --enable-lora",
    )
    enable_auto_tool_choice: bool = Field(
        default=True,
        description='tool_choice "auto" (the default with tools): the model decides and its calls '
        "are parsed; off, such requests get 400",
    )

    @field_validator("chat_template")
    @classmethod
    def _read_chat_template(cls, v: str | None) -> str | None:
        return None if v is None else load_chat_template(v)


def resolve_api_key(settings: ServerSettings) -> str | None:
    """The API key from --api-key, else the file --api-key-file names, else the environment."""
    if settings.api_key:
        return settings.api_key
    if settings.api_key_file:
        try:
            key = Path(settings.api_key_file).read_text().strip()
        except OSError as e:
            raise OSError(
                f"--api-key-file {settings.api_key_file}: cannot read it ({e.strerror})"
            ) from None
        if not key:
            raise ValueError(f"the API key file {settings.api_key_file} is empty")
        return key
    return os.environ.get(API_KEY_ENV) or None


def load_chat_template(value: str) -> str:
    """--chat-template: a file holding a Jinja template, or the template itself inline."""
    # Inline first: a template is no path (and may be too long to be one).
    if "{{" in value or "{%" in value:
        return value
    path = Path(value)
    if path.is_file():
        return path.read_text()
    raise ValueError(
        f"--chat-template {value!r} is neither a readable file nor an inline Jinja template"
    )
