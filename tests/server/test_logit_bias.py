"""logit_bias, OpenAI's shape ({"token id": bias in [-100, 100]}, at most 300), on completions
and chat: +100 forces a token, -100 bans one, mixed with unbiased requests in one batch; bad
values are 400s naming logit_bias."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from openai import OpenAI

from kvfleet.engine.config import EngineArgs
from kvfleet.engine.request import Request
from kvfleet.engine.sampler import Sampler
from kvfleet.engine.sampling_params import SamplingParams
from kvfleet.engine.server.app import ServerSettings
from kvfleet.router.proxy import Router, RouterSettings, build_runner
from tests.support.net import http_call
from tests.support.servers import engine_server, runner_in_thread
from tests.support.tiny_model import tiny_model_path

MODEL = "tiny"
PROMPT = [11, 12, 13, 14, 15]


@pytest.fixture(scope="module")
def server():
    settings = ServerSettings(host="127.0.0.1", port=0, served_model_name=[MODEL])
    with engine_server(EngineArgs(model=str(tiny_model_path()), dtype="float32"), settings) as s:
        yield s


@pytest.fixture
def client(server) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _post(server, path: str, body: dict) -> dict:
    status, _, raw = http_call(server.url + path, body)
    assert status == 200, raw[:300]
    return json.loads(raw)


def _tokens(server, **extra) -> list[str]:
    """The texts of the greedy completion's tokens."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "logprobs": 0}
    return _post(server, "/v1/completions", {**body, **extra})["choices"][0]["logprobs"]["tokens"]


def _text(server, token_id: int) -> str:
    return _post(server, "/detokenize", {"tokens": [token_id]})["prompt"]


def _id(server, text: str) -> int:
    (token_id,) = _post(server, "/tokenize", {"prompt": text, "add_special_tokens": False})[
        "tokens"
    ]
    return token_id


def test_plus_100_forces_a_token_and_minus_100_bans_one(server) -> None:
    free = _tokens(server)
    assert _tokens(server, logit_bias={"42": 100}) == [_text(server, 42)] * 6
    first = _id(server, free[0])
    banned = _tokens(server, logit_bias={str(first): -100})
    assert banned[0] != free[0] and free[0] not in banned
    # sampling too: a +100 token wins whatever the temperature
    hot = _tokens(server, logit_bias={"7": 100}, temperature=1.5, seed=3)
    assert hot == [_text(server, 7)] * 6


def test_chat_takes_logit_bias_through_the_sdk(client: OpenAI, server) -> None:
    resp = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        temperature=0,
        logit_bias={"65": 100},
        logprobs=True,
    )
    assert [t.token for t in resp.choices[0].logprobs.content] == [_text(server, 65)] * 4


def test_biased_and_free_requests_share_a_batch(server) -> None:
    free = _tokens(server)
    forced = [_text(server, 42)] * 6
    bodies = [{"logit_bias": {"42": 100}}, {}] * 4
    with ThreadPoolExecutor(len(bodies)) as pool:
        results = list(pool.map(lambda extra: _tokens(server, **extra), bodies))
    for body, tokens in zip(bodies, results, strict=True):
        assert tokens == (forced if body else free)


def test_logit_bias_through_the_router(server) -> None:
    router = Router(RouterSettings(hold_timeout=5.0), None)
    router.set_endpoints([server.url.removeprefix("http://")])
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "temperature": 0, "logprobs": 0,
            "logit_bias": {"42": 100}}  # fmt: skip
    with runner_in_thread(build_runner(router)) as front:
        status, _, raw = http_call(front.url + "/v1/completions", body)
        assert status == 200, raw[:300]
        assert json.loads(raw)["choices"][0]["logprobs"]["tokens"] == [_text(server, 42)] * 3
        status, _, raw = http_call(front.url + "/v1/completions", {**body, "logit_bias": {"x": 1}})
    assert status == 400 and json.loads(raw)["error"]["param"].startswith("logit_bias")


def test_the_sampler_biases_each_row_alone_and_skips_failed_rows(monkeypatch) -> None:
    def req(rid: str, **sp) -> Request:
        return Request(rid, [5], SamplingParams(**sp), frozenset({1}), max_tokens=16)

    sampler = Sampler(vocab_size=6, device=torch.device("cpu"), seed=0)
    reqs = [
        req("biased", temperature=0, logit_bias={2: 100.0, 4: -100.0}),
        req("free", temperature=0),
        req("broken", temperature=0, logit_bias={3: 100.0}),
        req("banned", temperature=0, logit_bias={4: -100.0}),
    ]
    prepare = sampler._prepare

    def failing(r: Request, row: torch.Tensor):
        if r.request_id == "broken":
            raise RuntimeError("this request's own failure")
        return prepare(r, row)

    monkeypatch.setattr(sampler, "_prepare", failing)
    logits = torch.tensor([[0.0, 1.0, 0.5, 0.2, 9.0, 0.3]] * 4)
    batch = sampler.sample(logits, reqs)
    token_ids, _ = batch.read()
    assert token_ids[0] == 2 and token_ids[1] == 4 and token_ids[3] == 1
    assert list(batch.failed) == [2]


BAD = [
    ("too many", {str(i): 1 for i in range(301)}),
    ("above 100", {"5": 100.5}),
    ("below -100", {"5": -101}),
    ("not a token id", {"five": 1}),
    ("negative id", {"-5": 1}),
    ("outside the vocabulary", {"1024": 1}),
    ("not a number", {"5": "1"}),
]


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("bias", [b for _, b in BAD], ids=[n for n, _ in BAD])
def test_bad_logit_bias_is_a_400(server, endpoint: str, bias: dict) -> None:
    body = {"model": MODEL, "max_tokens": 2, "logit_bias": bias}
    body.update(
        {"prompt": PROMPT}
        if endpoint == "/v1/completions"
        else {"messages": [{"role": "user", "content": "x"}]}
    )
    status, _, raw = http_call(server.url + endpoint, body)
    assert status == 400, raw[:300]
    error = json.loads(raw)["error"]
    assert error["param"].startswith("logit_bias"), error
