"""POST /v1/embeddings, live: the official openai SDK (floats, base64, dimensions) and
LangChain's OpenAIEmbeddings against a tiny embedding model, the vectors HF transformers'
pooled hidden states; OpenAI-shaped refusals of bad inputs; metrics; the request's span with
the GenAI conventions' embeddings attributes; and each runner refusing the other's endpoints."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
import torch
from openai import BadRequestError
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from kvfleet.engine.config import EngineArgs
from kvfleet.engine.server.app import ServerSettings
from kvfleet.engine.server.embeddings import MAX_EMBEDDING_INPUTS
from kvfleet.telemetry.tracing import Tracing
from tests.support.engine import hf_embeddings
from tests.support.net import http_call
from tests.support.servers import assert_engine_idle, engine_server, metric, openai_client
from tests.support.tiny_model import build_tiny_embedding_model

MODEL = "tiny-embed"
ATOL = 1e-5


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("embedding-server")
    return build_tiny_embedding_model(root / "qwen3-embedding", "lasttoken", is_matryoshka=True)


@pytest.fixture(scope="module")
def spans() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture(scope="module")
def server(model_dir, spans):
    settings = ServerSettings(host="127.0.0.1", port=0, served_model_name=[MODEL])
    args = EngineArgs(model=str(model_dir), device="cpu", dtype="float32")
    with engine_server(args, settings, Tracing.to(spans, "engine", batch=False)) as s:
        yield s


def post(server, path: str, body: dict) -> tuple[int, dict]:
    status, _, raw = http_call(server.url + path, body)
    return status, json.loads(raw)


def test_sdk_floats_and_base64_equal_hf(server, model_dir):
    client = openai_client(server.url)
    texts = ["the quick brown fox", "jumps over the lazy dog again and again"]
    tokenizer = server.srv.engine.tokenizer
    want = hf_embeddings(model_dir, [tokenizer(t).input_ids for t in texts], "lasttoken")
    floats = client.embeddings.create(model=MODEL, input=texts, encoding_format="float")
    # The SDK asks for base64 unless told otherwise, and decodes it.
    decoded = client.embeddings.create(model=MODEL, input=texts)
    assert floats.model == MODEL and [d.index for d in floats.data] == [0, 1]
    for f, b, ref in zip(floats.data, decoded.data, want, strict=True):
        assert (torch.tensor(f.embedding) - ref).abs().max() < ATOL
        assert b.embedding == pytest.approx(f.embedding, abs=1e-7)
    num_tokens = sum(len(tokenizer(t).input_ids) for t in texts)
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == num_tokens

    # Token ids embed as their text does; base64 is little-endian float32.
    ids = tokenizer(texts[0]).input_ids
    status, body = post(server, "/v1/embeddings",
                        {"input": [ids], "encoding_format": "base64", "user": "u"})  # fmt: skip
    assert status == 200, body
    raw = np.frombuffer(base64.b64decode(body["data"][0]["embedding"]), dtype="<f4")
    assert np.abs(raw - np.array(floats.data[0].embedding)).max() < 1e-6


def test_dimensions_truncate_and_renormalise(server):
    client = openai_client(server.url)
    full = client.embeddings.create(model=MODEL, input="hello", encoding_format="float")
    short = client.embeddings.create(model=MODEL, input="hello", dimensions=8,
                                     encoding_format="float")  # fmt: skip
    head = torch.tensor(full.data[0].embedding[:8])
    assert len(short.data[0].embedding) == 8
    assert (torch.tensor(short.data[0].embedding) - head / head.norm()).abs().max() < 1e-6


def test_span_carries_the_genai_embeddings_attributes(server, spans):
    spans.clear()
    client = openai_client(server.url)
    # The SDK asks for base64 by default.
    out = client.embeddings.create(model=MODEL, input=["one", "two three"], dimensions=8)
    # The span ends, and is exported, before the response is written.
    (span,) = [s for s in spans.get_finished_spans() if s.kind == SpanKind.SERVER]
    attrs = span.attributes or {}
    assert span.name == f"embeddings {MODEL}"
    assert attrs["gen_ai.operation.name"] == "embeddings"
    assert attrs["gen_ai.request.model"] == attrs["gen_ai.response.model"] == MODEL
    assert tuple(attrs["gen_ai.request.encoding_formats"]) == ("base64",)
    assert attrs["gen_ai.embeddings.dimension.count"] == 8
    assert attrs["gen_ai.usage.input_tokens"] == out.usage.prompt_tokens > 2
    # The model's own width when the request names none; floats asked for.
    client.embeddings.create(model=MODEL, input="one", encoding_format="float")
    last = spans.get_finished_spans()[-1].attributes or {}
    assert last["gen_ai.embeddings.dimension.count"] == 64
    assert tuple(last["gen_ai.request.encoding_formats"]) == ("float",)


def test_langchain_openai_embeddings(server):
    from langchain_openai import OpenAIEmbeddings
    from pydantic import SecretStr

    # check_embedding_ctx_length=False: LangChain otherwise splits texts with tiktoken, whose
    # encodings are downloaded on first use (none here), and sends OpenAI's token ids rather
    # than the text; the engine tokenizes with its own tokenizer, as vLLM's docs advise.
    emb = OpenAIEmbeddings(model=MODEL, base_url=server.url + "/v1", api_key=SecretStr("unused"),
                           check_embedding_ctx_length=False, max_retries=0)  # fmt: skip
    docs = emb.embed_documents(["first document", "second document"])
    query = emb.embed_query("first document")
    assert len(docs) == 2 and len(docs[0]) == 64
    assert np.abs(np.array(docs[0]) - np.array(query)).max() < 1e-6


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"input": ""}, "input", "must not be empty"),
        ({"input": []}, "input", "must not be empty"),
        ({"input": ["a", ""]}, "input", "must not be empty"),
        ({"input": ["a"] * (MAX_EMBEDDING_INPUTS + 1)}, "input", "at most 2048 inputs"),
        ({"input": [[1] * 1025]}, "input", "maximum context length"),
        ({"input": [[600]]}, "input", "outside the vocabulary"),
        ({"input": "a", "dimensions": 65}, "dimensions", "between 1 and"),
        ({"input": "a", "encoding_format": "int8"}, "encoding_format", "float"),
        ({"input": "a", "stream": True}, "stream", "Unrecognized"),
        ({"input": "a", "model": "other"}, "model", "does not exist"),
        ({"input": "a", "max_tokens": 2}, "max_tokens", "Unrecognized"),
    ],
)
def test_bad_inputs_get_openai_errors(server, body, param, says):
    status, answer = post(server, "/v1/embeddings", body)
    assert status in (400, 404), answer
    error = answer["error"]
    assert error["param"] == param and says in error["message"], error


def _stopped(server) -> float:
    """Requests finished with reason stop, as /metrics counts them."""
    _, _, raw = http_call(server.url + "/metrics")
    for line in raw.decode().splitlines():
        if line.startswith("vllm:request_success_total{") and 'reason="stop"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_metrics_count_embeddings_and_completions_are_refused(server):
    before = _stopped(server)
    prompt_before = metric(server, "vllm:prompt_tokens_total")
    client = openai_client(server.url)
    out = client.embeddings.create(model=MODEL, input=["one", "two three"])
    assert _stopped(server) == before + 2
    assert metric(server, "vllm:prompt_tokens_total") == prompt_before + out.usage.prompt_tokens
    with pytest.raises(BadRequestError, match="embedding model") as e:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert e.value.body["param"] == "model"  # type: ignore[index]
    assert_engine_idle(server)


def test_a_generative_model_refuses_embeddings(model_dirs):
    settings = ServerSettings(host="127.0.0.1", port=0, served_model_name=["gen"])
    args = EngineArgs(model=str(model_dirs["llama"]), device="cpu", dtype="float32")
    with engine_server(args, settings) as s:
        status, answer = post(s, "/v1/embeddings", {"input": "hi"})
    assert status == 400 and answer["error"]["code"] == "model_not_supported", answer
    assert "--runner pooling" in answer["error"]["message"]
