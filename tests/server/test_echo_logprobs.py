"""Scoring a prompt through the completions API as lm-eval-harness does (echo, logprobs,
max_tokens 0) and vLLM's prompt_logprobs extension on completions and chat, through the
official openai client: the numbers are HF transformers' log_softmax of the same prompt."""

from __future__ import annotations

import json

import pytest
from openai import BadRequestError, OpenAI

from kvfleet.engine.config import EngineArgs
from kvfleet.engine.server.app import ServerSettings
from tests.support.engine import hf_prompt_logprobs
from tests.support.net import http_call
from tests.support.servers import engine_server

MODEL = "tiny"
PROMPT = [5, 17, 301, 42, 9, 77, 123, 250, 11, 64, 3, 400]
ATOL = 1e-4


@pytest.fixture(scope="module")
def server(model_dirs):
    settings = ServerSettings(host="127.0.0.1", port=0, served_model_name=[MODEL])
    args = EngineArgs(model=str(model_dirs["llama"]), dtype="float32", enable_prefix_caching=True)
    with engine_server(args, settings) as s:
        yield s


@pytest.fixture(scope="module")
def reference(model_dirs):
    return hf_prompt_logprobs(model_dirs["llama"], PROMPT)


@pytest.fixture
def client(server) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


def _check_prompt_part(logprobs, reference, top_n: int) -> None:
    assert logprobs.token_logprobs[0] is None
    assert logprobs.top_logprobs[0] is None
    assert logprobs.text_offset[0] == 0
    for pos in range(1, len(PROMPT)):
        want = reference[pos - 1, PROMPT[pos]].item()
        assert abs(logprobs.token_logprobs[pos] - want) < ATOL, pos
        # The prompt token plus the top N.
        assert 1 <= len(logprobs.top_logprobs[pos]) <= top_n + 1
        best = reference[pos - 1].max().item()
        assert abs(max(logprobs.top_logprobs[pos].values()) - best) < ATOL


def test_lm_eval_loglikelihood_request(client, reference) -> None:
    """echo + logprobs + max_tokens 0 + temperature 0, a token-id prompt: the prompt back as
    text, every token scored (the first null), nothing generated."""
    out = client.completions.create(
        model=MODEL, prompt=PROMPT, echo=True, logprobs=1, max_tokens=0, temperature=0
    )
    [choice] = out.choices
    assert choice.finish_reason == "length"
    assert len(choice.logprobs.tokens) == len(PROMPT)
    assert "".join(choice.logprobs.tokens) == choice.text
    _check_prompt_part(choice.logprobs, reference, 1)
    assert out.usage.completion_tokens == 0
    assert out.usage.prompt_tokens == len(PROMPT)


def test_echo_logprobs_then_generated_tokens(client, reference) -> None:
    """With max_tokens > 0: the prompt's entries, then the generated tokens' as without echo;
    text offsets run on across both; n = 2 choices each carry the prompt."""
    plain = client.completions.create(
        model=MODEL, prompt=PROMPT, logprobs=2, max_tokens=4, temperature=0
    )
    echoed = client.completions.create(
        model=MODEL, prompt=PROMPT, echo=True, logprobs=2, max_tokens=4, temperature=0, n=2
    )
    gen = plain.choices[0].logprobs
    for choice in echoed.choices:
        lp = choice.logprobs
        _check_prompt_part(lp, reference, 2)
        assert lp.tokens[len(PROMPT) :] == gen.tokens
        assert lp.token_logprobs[len(PROMPT) :] == pytest.approx(gen.token_logprobs, abs=ATOL)
        assert choice.text.endswith(plain.choices[0].text)
        offsets = lp.text_offset
        assert offsets == sorted(offsets)
        assert offsets[len(PROMPT)] == sum(len(t) for t in lp.tokens[: len(PROMPT)])


def test_streamed_echo_logprobs(server, client, reference) -> None:
    """The first chunk carries the echoed prompt with its logprobs; the rest stream as usual."""
    stream = client.completions.create(
        model=MODEL, prompt=PROMPT, echo=True, logprobs=1, max_tokens=3, temperature=0, stream=True
    )
    chunks = [c for c in stream if c.choices]
    first = chunks[0].choices[0].logprobs
    _check_prompt_part(first, reference, 1)
    tokens = [t for c in chunks for t in c.choices[0].logprobs.tokens]
    assert len(tokens) == len(PROMPT) + 3
    whole = client.completions.create(
        model=MODEL, prompt=PROMPT, echo=True, max_tokens=3, temperature=0
    )
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    # Scoring only, streamed: one chunk, the prompt alone.
    status, _, raw = http_call(
        server.url + "/v1/completions",
        {"prompt": PROMPT, "echo": True, "logprobs": 0, "max_tokens": 0, "stream": True},
    )
    assert status == 200
    data = [line[6:] for line in raw.decode().splitlines() if line.startswith("data: ")]
    events = [json.loads(d) for d in data if d != "[DONE]"]
    [event] = events
    assert event["choices"][0]["finish_reason"] == "length"
    assert len(event["choices"][0]["logprobs"]["tokens"]) == len(PROMPT)


def test_vllm_prompt_logprobs_field(client, reference) -> None:
    """prompt_logprobs (vLLM's extra body field) on completions and chat: per prompt token None
    or {token id: {logprob, decoded_token}}."""
    out = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=1, extra_body={"prompt_logprobs": 0}
    )
    entries = out.choices[0].model_extra["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(PROMPT)
    for pos in range(1, len(PROMPT)):
        got = entries[pos][str(PROMPT[pos])]["logprob"]
        assert abs(got - reference[pos - 1, PROMPT[pos]].item()) < ATOL
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hello there"}],
        max_tokens=1,
        extra_body={"prompt_logprobs": 3},
    )
    entries = chat.model_extra["prompt_logprobs"]
    assert entries[0] is None
    assert all(1 <= len(e) <= 4 for e in entries[1:])


def test_scoring_requests_refused_with_reasons(client) -> None:
    cases = [
        ({"prompt": PROMPT, "max_tokens": 0}, "max_tokens 0 needs echo"),
        ({"prompt": PROMPT, "echo": True, "logprobs": 6}, "logprobs"),
        ({"prompt": PROMPT, "extra_body": {"prompt_logprobs": 21}}, "prompt_logprobs"),
    ]
    for kwargs, message in cases:
        with pytest.raises(BadRequestError, match=message):
            client.completions.create(model=MODEL, **kwargs)
    with pytest.raises(BadRequestError, match="not available when stream is true"):
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            stream=True,
            extra_body={"prompt_logprobs": 1},
        )
