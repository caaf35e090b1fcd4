"""The request of OpenAI's Responses API (POST /v1/responses), validated as the chat request's
schema is (strict types, bounded numbers, unknown fields refused), and the chat completion
request it stands for: the Responses API is served by the chat path under a second surface.

What kvfleet does not serve is refused by name rather than ignored: built-in tools, non-text
input, reasoning effort (no reasoning parser runs), and everything stateful (kvfleet stores
no responses: previous_response_id, conversation, background)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from kvfleet.engine.server.openai_requests import (
    MAX_TOKENS_CAP,
    MAX_TOOLS,
    ChatCompletionRequest,
    FunctionName,
    JsonSchemaFormat,
    NamedToolChoice,
    ResponseFormat,
)
from kvfleet.protocol.chat_template import ChatMessage
from kvfleet.protocol.responses_input import (
    FunctionCallItem,
    FunctionCallOutputItem,
    Input,
    chat_messages,
    check_item_types,
)
from kvfleet.protocol.tool_prompt import ChatTool, responses_tool_as_chat

# OpenAI's bounds on metadata: 16 pairs, keys of 64 characters, values of 512.
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class FunctionTool(_Strict):
    type: Literal["function"]
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def chat_tool(self) -> ChatTool:
        return ChatTool.model_validate(responses_tool_as_chat(self.model_dump(exclude_none=True)))


class FunctionToolChoice(_Strict):
    type: Literal["function"]
    name: str


class TextFormat(_Strict):
    """text.format: free text, any JSON object, or JSON following a schema."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    # `schema` would shadow BaseModel.schema(); the JSON field is still "schema".
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _fields_of_its_type(self) -> TextFormat:
        schema_fields = (self.name, self.description, self.json_schema, self.strict)
        if self.type == "json_schema":
            if self.name is None or self.json_schema is None:
                raise ValueError('type "json_schema" needs name and schema')
        elif any(v is not None for v in schema_fields):
            raise ValueError('name, description, schema and strict go with type "json_schema"')
        try:
            self.response_format()  # the name's pattern and the schema's bounds, said here
        except ValidationError as e:
            first = e.errors()[0]
            raise ValueError(first["msg"].removeprefix("Value error, ")) from None
        return self

    def response_format(self) -> ResponseFormat:
        if self.type != "json_schema":
            return ResponseFormat(type=self.type)
        assert self.name is not None
        schema = JsonSchemaFormat.model_validate(
            {"name": self.name, "description": self.description, "schema": self.json_schema,
             "strict": self.strict}
        )  # fmt: skip
        return ResponseFormat(type="json_schema", json_schema=schema)


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class Reasoning(_Strict):
    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None

    @model_validator(mode="after")
    def _no_reasoning(self) -> Reasoning:
        if self.effort not in (None, "none") or self.summary or self.generate_summary:
            raise ValueError(
                "this server runs no reasoning parser: leave reasoning out, or set its effort "
                'to "none"'
            )
        return self


class ResponsesRequest(_Strict):
    model: str | None = None
    input: Input
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS_CAP)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    tools: list[FunctionTool] | None = Field(default=None, max_length=MAX_TOOLS)
    # None: "auto" with tools, "none" without, as OpenAI defaults it.
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    stream: bool = False
    # Accepted, and nothing is stored whatever it says (the response's store is false).
    store: bool | None = None
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    reasoning: Reasoning | None = None
    truncation: Literal["disabled"] | None = None
    include: list[str] | None = None
    background: bool | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _item_types(cls, value: Any) -> Any:
        return check_item_types(value)

    @field_validator("input")
    @classmethod
    def _outputs_answer_calls(cls, value: Input) -> Input:
        """Each function_call_output answers a function_call before it (said by item, where
        the chat path would name the message the item became)."""
        if isinstance(value, str):
            return value
        made: set[str] = set()
        for i, item in enumerate(value):
            if isinstance(item, FunctionCallItem):
                made.add(item.call_id)
            elif isinstance(item, FunctionCallOutputItem) and item.call_id not in made:
                raise ValueError(
                    f"item {i}: call_id {item.call_id!r} answers no function_call item before it"
                )
        return value

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools(cls, value: Any) -> Any:
        if isinstance(value, list):
            for i, tool in enumerate(value):
                kind = tool.get("type") if isinstance(tool, dict) else None
                if kind != "function":
                    raise ValueError(
                        f"tool {i} has type {kind!r}: this server runs no built-in tools "
                        '(only type "function", which the client runs)'
                    )
        return value

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice(cls, value: Any) -> Any:
        if value is None or value in ("none", "auto", "required"):
            return value
        if isinstance(value, dict) and value.get("type") == "function":
            return value
        raise ValueError(
            'must be "none", "auto", "required" or {"type": "function", "name": ...} (this '
            "server runs no built-in tools)"
        )

    @field_validator("metadata")
    @classmethod
    def _metadata_bounds(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is None:
            return value
        if len(value) > MAX_METADATA_PAIRS:
            raise ValueError(f"at most {MAX_METADATA_PAIRS} pairs are allowed, got {len(value)}")
        for key, item in value.items():
            if len(key) > MAX_METADATA_KEY_CHARS or len(item) > MAX_METADATA_VALUE_CHARS:
                raise ValueError(
                    f"keys are at most {MAX_METADATA_KEY_CHARS} characters and values at most "
                    f"{MAX_METADATA_VALUE_CHARS}"
                )
        return value

    @model_validator(mode="after")
    def _stateless(self) -> ResponsesRequest:
        if self.background:
            raise ValueError(
                "background responses need stored state, which this server keeps none of: "
                "leave background out"
            )
        if self.include:
            raise ValueError(
                f"include: this server has none of {', '.join(self.include)} to add to a "
                "response; leave include out"
            )
        return self

    @property
    def format(self) -> TextFormat | None:
        return None if self.text is None else self.text.format

    def chat_request(self) -> ChatCompletionRequest:
        """The chat completion request this one stands for."""
        choice = self.tool_choice
        if isinstance(choice, FunctionToolChoice):
            named = NamedToolChoice(type="function", function=FunctionName(name=choice.name))
            chat_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = named
        else:
            chat_choice = choice
        fmt = self.format
        return ChatCompletionRequest(
            model=self.model,
            messages=[
                ChatMessage.model_validate(m) for m in chat_messages(self.input, self.instructions)
            ],
            max_completion_tokens=self.max_output_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            tools=None if self.tools is None else [t.chat_tool() for t in self.tools],
            tool_choice=chat_choice,
            parallel_tool_calls=self.parallel_tool_calls,
            response_format=None if fmt is None else fmt.response_format(),
            stream=self.stream,
            user=self.user,
        )


# A chat request's fields as a Responses request names them, for the errors the chat path
# raises.
_PARAMS = (
    ("response_format", "text.format"),
    ("max_completion_tokens", "max_output_tokens"),
    ("max_tokens", "max_output_tokens"),
)


def responses_param(param: str | None) -> str | None:
    """The Responses request's field for a chat request's field (an error's param)."""
    if param is None:
        return None
    if param == "messages" or param.startswith("messages."):
        return "input"  # a message's index is not its item's
    for chat, responses in _PARAMS:
        if param == chat or param.startswith(chat + "."):
            return responses + param[len(chat) :]
    if param.startswith("tools.") and ".function." in param:
        return param.replace(".function.", ".", 1)
    return param
