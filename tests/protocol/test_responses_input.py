"""A Responses request's input as the chat messages it stands for (what the engine renders and
the router keys on), and the input's bounds and refusals."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from kvfleet.protocol.responses_input import (
    MAX_CONTENT_PARTS,
    MAX_INPUT_ITEMS,
    chat_messages,
    parse_input,
)

CALL = {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": '{"a": 1}'}
TOOL_CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}


def test_a_string_is_one_user_message_after_the_instructions() -> None:
    assert chat_messages(parse_input("hi"), "be brief") == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
    ]
    assert chat_messages(parse_input("hi"), None) == [{"role": "user", "content": "hi"}]


def test_items_become_the_chat_conversation_calls_joined_to_their_assistant_message() -> None:
    items: list[Any] = [
        {"role": "developer", "content": [{"type": "input_text", "text": "a"},
                                          {"type": "input_text", "text": "b"}]},
        {"type": "message", "role": "user", "content": "q"},
        # An earlier response's output sent back: its message, then its two calls.
        {"type": "message", "id": "msg_1", "status": "completed", "role": "assistant",
         "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}]},
        {**CALL, "id": "fc_1", "status": "completed"},
        {**CALL, "call_id": "call_2"},
        {"type": "function_call_output", "call_id": "call_1", "output": "r1"},
        {"type": "function_call_output", "call_id": "call_2",
         "output": [{"type": "input_text", "text": "r2"}]},
        # Calls with no assistant text before them open an assistant message of their own.
        {**CALL, "call_id": "call_3"},
    ]  # fmt: skip
    assert chat_messages(parse_input(items), None) == [
        {"role": "developer", "content": "ab"},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "Let me look.",
         "tool_calls": [TOOL_CALL, {**TOOL_CALL, "id": "call_2"}]},
        {"role": "tool", "content": "r1", "tool_call_id": "call_1"},
        {"role": "tool", "content": "r2", "tool_call_id": "call_2"},
        {"role": "assistant", "content": None, "tool_calls": [{**TOOL_CALL, "id": "call_3"}]},
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("items", "named"),
    [
        ([{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}], "input_image"),
        ([{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}], "input_file"),
        ([{"type": "web_search_call", "id": "ws"}], "web_search_call"),
        ([{"type": "item_reference", "id": "msg_1"}], "item_reference"),
        ([{"role": "tool", "content": "x"}], "function_call_output"),
        (
            [
                {
                    "type": "function_call_output",
                    "call_id": "c",
                    "output": [{"type": "input_image", "image_url": "u"}],
                }
            ],
            "input_image",
        ),
        ([{"role": "user", "content": "x"}] * (MAX_INPUT_ITEMS + 1), str(MAX_INPUT_ITEMS)),
        ([{"role": "user", "content": [{"type": "input_text", "text": "x"}] * 257}], "256"),
        ([], "at least 1"),
    ],
)
def test_what_is_not_text_or_past_the_bounds_is_refused_by_name(items: Any, named: str) -> None:
    assert MAX_CONTENT_PARTS == 256
    with pytest.raises((ValueError, ValidationError)) as e:
        parse_input(items)
    assert named in str(e.value)
