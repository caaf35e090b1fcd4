"""kvfleet.protocol.chat_template: chat messages to prompt tokens, the one rendering the engine's
server and the router's token prefix keys both use."""

from __future__ import annotations

import pytest
from pydantic import ValidationError
from transformers import AutoTokenizer

from kvfleet.protocol.chat_template import (
    DEFAULT_CHAT_TEMPLATE,
    ChatMessage,
    conversation_of,
    render_chat,
    render_chat_text,
)
from kvfleet.protocol.json_body import RequestRefused


@pytest.fixture
def tok(model_dirs):
    return AutoTokenizer.from_pretrained(model_dirs["llama"])


def messages(*raw: dict) -> list[ChatMessage]:
    return [ChatMessage.model_validate(m) for m in raw]


def test_messages_as_the_template_reads_them():
    parts = messages(
        {
            "role": "system",
            "content": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}],
        },
        {"role": "user", "content": "hi", "name": "ann"},
        {"role": "assistant", "content": None, "tool_calls": []},  # echoed extras are tolerated
    )
    assert conversation_of(parts) == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi", "name": "ann"},
        {"role": "assistant", "content": ""},
    ]


@pytest.mark.parametrize(
    "raw",
    [
        {"role": "wizard", "content": "hi"},
        {"role": "user", "content": 5},
        {"role": "user", "content": [{"type": "image_url", "image_url": "x"}]},
        {"role": "user", "content": [{"type": "text", "text": "x", "extra": 1}]},
    ],
)
def test_message_shapes_outside_the_api_are_refused(raw):
    with pytest.raises(ValidationError):
        ChatMessage.model_validate(raw)


def test_render_chat_is_the_template_then_the_tokens_without_added_specials(tok):
    chat = messages({"role": "user", "content": "hello there"})
    text = render_chat_text(tok, conversation_of(chat))
    assert (
        text == f"{tok.bos_token}<|im_start|>user\nhello there<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = render_chat(tok, chat)
    assert ids == tok(text, add_special_tokens=False).input_ids
    assert ids.count(tok.bos_token_id) == 1  # the template's BOS, not a second one
    without = render_chat(tok, chat, add_generation_prompt=False)
    assert ids[: len(without)] == without and len(without) < len(ids)


def test_chatml_without_a_template_of_its_own(tok):
    tok.chat_template = None
    text = render_chat_text(tok, [{"role": "user", "content": "hi"}])
    assert text == tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], chat_template=DEFAULT_CHAT_TEMPLATE,
        add_generation_prompt=True, tokenize=False,
    )  # fmt: skip
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_template_refusals_are_400_and_say_nothing_of_its_internals(tok):
    chat = [{"role": "user", "content": "hi"}]
    tok.chat_template = "{{ raise_exception('Conversation roles must alternate') }}"
    with pytest.raises(RequestRefused) as e:
        render_chat_text(tok, chat)
    assert (e.value.status, e.value.param) == (400, "messages")
    assert "Conversation roles must alternate" in e.value.message
    tok.chat_template = "{{ messages[0]['content'].frobnicate() }}"
    with pytest.raises(RequestRefused) as e:
        render_chat_text(tok, chat)
    assert e.value.param == "messages" and "frobnicate" not in e.value.message


def test_template_kwargs_may_not_set_the_renderers_own_arguments(tok):
    chat = [{"role": "user", "content": "hi"}]
    assert render_chat_text(tok, chat, template_kwargs={"enable_thinking": False})
    for reserved in ("tokenize", "add_generation_prompt", "chat_template"):
        with pytest.raises(RequestRefused) as e:
            render_chat_text(tok, chat, template_kwargs={reserved: True})
        assert (e.value.status, e.value.param) == (400, "chat_template_kwargs")
