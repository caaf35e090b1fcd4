"""Structural tags over HTTP with the real default model: vLLM's two request shapes (the
structured_outputs extra as JSON text on completions, response_format on chat, streamed), a
triggered call held to its schema while the same prompt unconstrained, in the same batch,
breaks it, and each bad tag a 400 naming the problem."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jsonschema
import pytest
from openai import BadRequestError, OpenAI

from tests.support.servers import DEFAULT_SERVED_NAME, openai_client

MODEL = DEFAULT_SERVED_NAME
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}},
    "required": ["city"],
    "additionalProperties": False,
}
TAG = {
    "type": "structural_tag",
    "structures": [
        {"begin": "<function=get_weather>", "schema": WEATHER, "end": "</function>"},
        {"begin": "<function=get_time>", "end": "</function>"},
    ],
    "triggers": ["<function="],
}
# Two examples whose calls use the key "town": greedy SmolLM2 copies it (a schema violation),
# unless the tag holds the call to WEATHER.
FEW_SHOT = "".join(
    f'Q: What is the weather in {city}?\nA: <function=get_weather>{{"town": "{city}"}}</function>\n'
    for city in ("Paris", "Rome")
)
PROMPT = FEW_SHOT + "Q: What is the weather in Berlin?\nA:"
CALL = re.compile(r"<function=(get_weather|get_time)>(.*?)</function>", re.S)


@pytest.fixture(scope="module")
def server(default_server):
    return default_server


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return openai_client(server.url)


def _calls(text: str) -> list[dict[str, Any]]:
    """Each call in the text, its JSON checked against its structure's schema."""
    calls = []
    for name, arguments in CALL.findall(text):
        value = json.loads(arguments)
        if name == "get_weather":
            jsonschema.validate(value, WEATHER)
        calls.append(value)
    return calls


def test_a_triggered_call_follows_its_schema_beside_free_requests(client: OpenAI) -> None:
    def complete(prompt: str, extra: dict[str, Any] | None) -> Any:
        return client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=24,
            temperature=0,
            stop=["\nQ:"],
            extra_body=extra,
        ).choices[0]

    # vLLM's extra takes the tag as JSON text; sent together, so the engine batches them.
    tagged = {"structured_outputs": {"structural_tag": json.dumps(TAG)}}
    jobs = [(PROMPT, tagged), (PROMPT, None), ("The capital of France is", None)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        constrained, free, other = pool.map(lambda job: complete(*job), jobs)
    assert constrained.finish_reason == "stop", constrained.text
    assert _calls(constrained.text) == [{"city": "Berlin"}], constrained.text
    # The same prompt unconstrained copies the examples' key: the tag made the difference.
    assert '{"town": "Berlin"}' in free.text, free.text
    assert other.text.strip(), other


def test_chat_response_format_structural_tag_streamed(client: OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[
            *(
                message
                for city in ("Paris", "Rome")
                for message in (
                    {"role": "user", "content": f"What is the weather in {city}?"},
                    {
                        "role": "assistant",
                        "content": f'<function=get_weather>{{"town": "{city}"}}</function>',
                    },
                )
            ),
            {"role": "user", "content": "What is the weather in Berlin?"},
        ],
        max_tokens=40,
        temperature=0,
        stream=True,
        response_format=TAG,  # type: ignore[arg-type]  # vLLM's type, not in the SDK's union
    )
    text, finish = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    assert finish in ("stop", "length"), finish
    calls = _calls(text)
    assert calls and all(set(c) == {"city"} for c in calls), text


def _tag(**changes: Any) -> dict[str, Any]:
    return {**TAG, **changes}


@pytest.mark.parametrize(
    "extra, param, message",
    [
        (
            {"response_format": _tag(triggers=["<tool>"])},
            "response_format",
            r"structures\[0\]\.begin '<function=get_weather>' starts with none of the triggers",
        ),
        ({"response_format": _tag(structures=[])}, "response_format.structures", "at least 1"),
        ({"response_format": {"type": "structural_tag"}}, "response_format", "needs structures"),
        (
            {"response_format": {"type": "json_object", "triggers": ["<f"]}},
            "response_format",
            'only allowed with type "structural_tag"',
        ),
        (
            {"response_format": {"type": "structural_tag", "format": {"type": "any_text"}}},
            "response_format",
            '"format" shape of structural tags is not supported',
        ),
        (
            {
                "response_format": _tag(
                    structures=[
                        {
                            "begin": "<function=f>",
                            "schema": {"type": "array", "uniqueItems": True},
                            "end": "</function>",
                        }
                    ]
                )
            },
            "response_format",
            r"structures\[0\]\.schema: .*unsupported features.*uniqueItems",
        ),
        (
            {"structured_outputs": {"structural_tag": "{oops"}},
            "structured_outputs.structural_tag",
            "not valid JSON",
        ),
        (
            {"structured_outputs": {"structural_tag": json.dumps(_tag(triggers=[]))}},
            "structured_outputs.structural_tag.triggers",
            "at least 1",
        ),
        (
            {
                "response_format": TAG,
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": "required",
            },
            "tool_choice",
            "cannot both constrain",
        ),
    ],
)
def test_bad_structural_tags_are_400s(client: OpenAI, extra, param, message) -> None:
    with pytest.raises(BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=4,
            extra_body=extra,
        )
    error = e.value.body
    assert re.search(message, error["message"]), error
    assert error["param"] == param, error
