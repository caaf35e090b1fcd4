"""The server's LoRA surface: adapters named by a request's `model`, listed by /v1/models with
their parent, loaded and unloaded at run time (vLLM's endpoints, behind
--enable-runtime-lora-updating) with OpenAI error JSON for what it refuses, an adapter whose
folder breaks after loading failing its own requests alone, and the adapters' metrics."""

from __future__ import annotations

import json
import shutil
import time

import pytest

from kvfleet.engine.config import EngineArgs
from kvfleet.engine.lora_adapter import WEIGHTS_FILE
from kvfleet.engine.server.settings import ServerSettings
from tests.support.lora_adapters import write_peft_adapter
from tests.support.net import http_call
from tests.support.servers import engine_server

BASE = "tiny"
PROMPT = [5, 17, 99, 3, 250, 42, 7, 311, 64, 12]


@pytest.fixture(scope="module")
def adapter_dirs(model_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("server-adapters")
    base = model_dirs["llama"]
    return [write_peft_adapter(base, root / f"a{i}", rank=4, seed=i) for i in range(2)]


@pytest.fixture(scope="module")
def server(model_dirs, adapter_dirs):
    args = EngineArgs(model=str(model_dirs["llama"]), dtype="float32", max_num_seqs=4,
                      enable_lora=True, lora_modules=[f"first={adapter_dirs[0]}"])  # fmt: skip
    settings = ServerSettings(host="127.0.0.1", port=0, served_model_name=[BASE],
                              enable_runtime_lora_updating=True)  # fmt: skip
    with engine_server(args, settings) as srv:
        yield srv


def _complete(server, model: str) -> tuple[int, dict]:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    status, _, raw = http_call(server.url + "/v1/completions", body)
    return status, json.loads(raw)


def _post(server, path: str, body: dict) -> tuple[int, bytes]:
    status, _, raw = http_call(server.url + path, body)
    return status, raw


def test_an_adapter_is_a_model(server, adapter_dirs):
    status, _, raw = http_call(server.url + "/v1/models")
    assert status == 200
    cards = {c["id"]: c for c in json.loads(raw)["data"]}
    assert cards["first"]["parent"] == BASE and cards["first"]["root"] == str(adapter_dirs[0])
    assert cards[BASE]["parent"] is None
    status, base = _complete(server, BASE)
    assert status == 200
    status, tuned = _complete(server, "first")
    assert status == 200, tuned
    assert tuned["model"] == "first"
    assert tuned["choices"][0]["text"] != base["choices"][0]["text"]
    status, missing = _complete(server, "nobody")
    assert status == 404 and missing["error"]["code"] == "model_not_found"


def test_adapters_load_and_unload_at_run_time(server, adapter_dirs, tmp_path):
    status, raw = _post(server, "/v1/load_lora_adapter",
                        {"lora_name": "second", "lora_path": str(adapter_dirs[1])})  # fmt: skip
    assert status == 200 and b"second" in raw
    status, out = _complete(server, "second")
    assert status == 200, out
    status, raw = _post(server, "/v1/load_lora_adapter",
                        {"lora_name": "second", "lora_path": str(adapter_dirs[1])})  # fmt: skip
    assert status == 400 and b"already been loaded" in raw
    (tmp_path / "adapter_config.json").write_text('{"r": 4, "use_dora": true}')
    status, raw = _post(server, "/v1/load_lora_adapter",
                        {"lora_name": "dora", "lora_path": str(tmp_path)})  # fmt: skip
    error = json.loads(raw)["error"]
    assert status == 400 and "DoRA" in error["message"] and error["param"] == "lora_path"
    status, raw = _post(server, "/v1/load_lora_adapter", {"lora_name": "x"})
    assert status == 400 and json.loads(raw)["error"]["type"] == "invalid_request_error"
    status, raw = _post(server, "/v1/unload_lora_adapter", {"lora_name": "second"})
    assert status == 200
    assert _complete(server, "second")[0] == 404
    status, _, raw = http_call(server.url + "/v1/models")
    assert "second" not in {c["id"] for c in json.loads(raw)["data"]}
    # The engine forgets it between steps: its series leave /metrics.
    deadline = time.monotonic() + 10
    while b'lora_name="second"' in http_call(server.url + "/metrics")[2]:
        assert time.monotonic() < deadline, "the unloaded adapter is still exported"
        time.sleep(0.05)
    status, raw = _post(server, "/v1/unload_lora_adapter", {"lora_name": "second"})
    assert status == 400 and b"cannot be found" in raw


def _load_copy(server, source, root, name: str):
    """A copy of the adapter folder `source`, loaded under `name`."""
    path = shutil.copytree(source, root / name)
    body = {"lora_name": name, "lora_path": str(path)}
    status, raw = _post(server, "/v1/load_lora_adapter", body)
    assert status == 200, raw
    return path


def _answers(server) -> dict[str, list]:
    """The base model's and the adapter "first"'s greedy choices."""
    answers = {}
    for model in (BASE, "first"):
        status, out = _complete(server, model)
        assert status == 200, out
        answers[model] = out["choices"]
    return answers


def _assert_failed(status: int, out: dict, *parts: str) -> None:
    error = out["error"]
    assert status == 500 and error["type"] == "server_error", out
    assert error["code"] == "request_failed", out
    for part in parts:
        assert part in error["message"], out


def test_an_adapter_whose_weights_go_after_loading_fails_its_requests_alone(
    server, adapter_dirs, tmp_path
):
    """One that has served (and left host memory since), and one that has not: the first is
    read again before its request is scheduled, the second checked as its request is queued;
    either fails that request alone, and the engine serves the others as before."""
    served = _load_copy(server, adapter_dirs[1], tmp_path, "served")
    assert _complete(server, "served")[0] == 200
    before = _answers(server)  # "served" leaves host memory for "first"
    fresh = _load_copy(server, adapter_dirs[1], tmp_path, "fresh")
    for path in (served, fresh):
        (path / WEIGHTS_FILE).unlink()
    missing = f"no {WEIGHTS_FILE}: it is missing"
    _assert_failed(*_complete(server, "served"), "reading LoRA adapter 'served' failed", missing)
    _assert_failed(*_complete(server, "fresh"), str(fresh), missing)
    assert _answers(server) == before
    assert http_call(server.url + "/health")[0] == 200
    for name in ("served", "fresh"):
        assert _post(server, "/v1/unload_lora_adapter", {"lora_name": name})[0] == 200


def test_the_adapters_metrics(server):
    assert _complete(server, "first")[0] == 200
    status, _, raw = http_call(server.url + "/metrics")
    assert status == 200
    text = raw.decode()
    assert 'kvfleet_engine_lora_requests_total{lora_name="first",model_name="tiny"}' in text
    assert 'kvfleet_engine_lora_resident{lora_name="first",model_name="tiny",tier="gpu"} 1.0' in (
        text
    )
    assert 'max_lora="1"' in text and "vllm:lora_requests_info{" in text
    assert "kvfleet_engine_lora_load_seconds_count" in text
