"""An agent's request (tools, an assistant turn of tool_calls, tool results) tokenizes in the router
to the ids the engine prefills, so precise prefix scoring finds its blocks: for a ChatML template
that reads no tools (the tools written into the system message in the parser family's format,
the family the engine's tokenizer bundle names) and for a template that reads tools itself; for
chat and Responses bodies. The engine's side is its own chat path (plan_tools, render_chat_served)
on a serving context around the same tokenizer."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from kvfleet.engine.server.chat import render_chat_served
from kvfleet.engine.server.openai_requests import ChatCompletionRequest
from kvfleet.engine.server.responses_request import ResponsesRequest
from kvfleet.engine.server.serving import ServingContext
from kvfleet.engine.server.tokenizer_bundle import bundle_bytes
from kvfleet.engine.server.tools import ToolSettings, plan_tools
from kvfleet.protocol.tool_prompt import HERMES, MISTRAL, parser_for_template
from kvfleet.router.fetched_tokenizer import load_bundle
from kvfleet.router.prompt_tokenizer import EngineTokenizer
from kvfleet.router.routing_key import PromptTokenizer, prompt_tokens
from tests.support.json_schemas import WEATHER_TOOL
from tests.support.tiny_model import build_tokenizer

TIME_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]},
}}  # fmt: skip
TOOLS = [WEATHER_TOOL, TIME_TOOL]
CALLS = [
    {"id": "call_0123456789abcdefWEATHER", "type": "function",
     "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}},
    {"id": "call_0123456789abcdefTIME000", "type": "function",
     "function": {"name": "get_time", "arguments": '{"zone": "CET"}'}},
]  # fmt: skip
MESSAGES = [
    {"role": "system", "content": "You plan trips."},
    {"role": "user", "content": "Weather and time in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": CALLS},
    {"role": "tool", "tool_call_id": CALLS[0]["id"], "content": "21 C, sunny"},
    {"role": "tool", "tool_call_id": CALLS[1]["id"], "content": "14:05"},
    {"role": "user", "content": "And tomorrow?"},
]
AGENT = {"messages": MESSAGES, "tools": TOOLS}
RESPONSES = {
    "instructions": "You plan trips.",
    "input": [
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": "call_w", "name": "get_weather",
         "arguments": '{"city": "Paris", "unit": "celsius"}'},
        {"type": "function_call_output", "call_id": "call_w", "output": "21 C"},
    ],
    "tools": [{"type": "function", **WEATHER_TOOL["function"]}],
}  # fmt: skip
BODIES = {
    "chat": AGENT,
    "tool_choice none": {**AGENT, "tool_choice": "none"},
    "responses": RESPONSES,
}

# Qwen 2.5's way with tools, shortened: the tools as JSON in the system turn, calls in
# <tool_call> tags with their arguments as JSON, results as <tool_response> in a user turn.
TOOLS_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n<tools>\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools><|im_end|>\n"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'system' and tools %}"
    "{%- elif m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n{{ m.content }}"
    "{% for c in m.tool_calls %}<tool_call>\n"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}'
    "\n</tool_call>{% endfor %}<|im_end|>\n"
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response id=\"{{ m.tool_call_id }}\">"
    "\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class Engine(SimpleNamespace):
    """The engine as its chat path sees it: a tokenizer and a context length."""

    tokenizer: PreTrainedTokenizerBase
    max_model_len: int = 4096


def engine_ids(tokenizer: PreTrainedTokenizerBase, parser: str, body: dict[str, Any]) -> list[int]:
    """The prompt the engine prefills for a body: its chat path (start_chat's planning and
    rendering), a Responses body as the chat request it stands for."""
    if "input" in body:
        req = ResponsesRequest.model_validate(body).chat_request()
    else:
        req = ChatCompletionRequest.model_validate(body)
    settings = ToolSettings(parser)
    ctx = ServingContext(Engine(tokenizer=tokenizer), ["m"])  # type: ignore[arg-type]
    plan = plan_tools(req, settings)
    render = render_chat_served(
        ctx, req.messages, req.add_generation_prompt, req.chat_template_kwargs, (plan, settings)
    )
    return asyncio.run(render)


@pytest.fixture(scope="module")
def chatml(tmp_path_factory: pytest.TempPathFactory) -> PreTrainedTokenizerBase:
    """The tiny model's tokenizer, whose ChatML template reads no tools."""
    return build_tokenizer(tmp_path_factory.mktemp("chatml"))


@pytest.fixture(scope="module")
def reads_tools(
    chatml: PreTrainedTokenizerBase, tmp_path_factory: pytest.TempPathFactory
) -> tuple[PreTrainedTokenizerBase, Path]:
    """The same tokenizer with a template that reads tools, as an engine's --chat-template
    gives it; and its folder, for a router's --tokenizer."""
    folder = tmp_path_factory.mktemp("reads-tools")
    chatml.save_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = TOOLS_TEMPLATE
    tokenizer.save_pretrained(folder)
    return tokenizer, folder


def assert_same_ids(router: PromptTokenizer, engine: list[int], body: dict[str, Any]) -> None:
    ids = prompt_tokens(body, router)
    assert ids == engine, (ids, engine)


@pytest.mark.parametrize("body", BODIES.values(), ids=BODIES.keys())
def test_a_template_that_reads_no_tools_in_the_engines_parser_format(
    chatml: PreTrainedTokenizerBase, body: dict[str, Any]
) -> None:
    """A fetched tokenizer comes with the engine's parser family (here Mistral's, not the
    template's Hermes: its calls and their 9-character ids differ)."""
    for parser in (HERMES, MISTRAL):
        router = load_bundle(bundle_bytes(chatml, parser), None)
        engine = engine_ids(chatml, parser, body)
        assert_same_ids(router, engine, body)
    assert parser_for_template(chatml.chat_template) == HERMES


@pytest.mark.parametrize("body", BODIES.values(), ids=BODIES.keys())
def test_a_template_that_reads_tools_gets_them_in_the_router_too(
    reads_tools: tuple[PreTrainedTokenizerBase, Path], body: dict[str, Any]
) -> None:
    tokenizer, folder = reads_tools
    engine = engine_ids(tokenizer, HERMES, body)
    assert_same_ids(EngineTokenizer(str(folder)), engine, body)
    text = tokenizer.decode(engine)
    shown = "tools" in body and body.get("tool_choice") != "none"
    assert ("<tools>" in text) == shown and "<tool_call>" in text and "<tool_response" in text


def test_without_tools_the_prompt_is_the_plain_chat_one(chatml: PreTrainedTokenizerBase) -> None:
    """A request with no tools nor tool messages renders as before: the tool path adds nothing
    to it."""
    body = {"messages": [{"role": "user", "content": "hi"}]}
    router = load_bundle(bundle_bytes(chatml), None)
    plain = chatml.apply_chat_template(body["messages"], tokenize=False, add_generation_prompt=True)
    assert prompt_tokens(body, router) == chatml(plain, add_special_tokens=False).input_ids
