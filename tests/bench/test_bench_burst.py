"""bench/burst.py against the real servers it starts (the kvfleet engine and bench/hf_server.py,
a tiny GPT-2 on the CPU), its checks against fake servers, and the HF baseline's endpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer

from tests.support.fake_openai import FakeServer, running
from tests.support.scripts import load_bench_script

burst = load_bench_script("burst")
hf_server = load_bench_script("hf_server")


def test_burst_end_to_end(
    model_dirs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "burst.json"
    rc = burst.main(
        [
            *("--model", str(model_dirs["gpt2"]), "--dtype", "float32"),
            *("--num-requests", "4", "--max-tokens", "5", "--engine-args=--max-num-seqs 4"),
            *("--log-dir", str(tmp_path), "--result-json", str(out)),
        ]
    )
    assert rc == 0
    from transformers import AutoTokenizer

    prompt_len = len(AutoTokenizer.from_pretrained(model_dirs["gpt2"])(burst.PROMPT).input_ids)
    kv, hf = json.loads(out.read_text())["results"]
    assert (kv["name"], hf["name"]) == ("kvfleet", "hf-generate-sequential")
    for r in (kv, hf):
        assert r["requests"] == 4 and r["extra"]["failed_requests"] == 0
        assert r["output_tokens"] == 4 * 5 and r["prompt_tokens"] == 4 * prompt_len
        assert r["req_s"] > 0 and r["extra"]["e2e_ms"]["p99"] >= r["extra"]["e2e_ms"]["p50"] > 0
    assert "kvfleet / hf-generate-sequential:" in capsys.readouterr().out
    assert {"kvfleet.log", "hf_server.log"} <= {p.name for p in tmp_path.iterdir()}


@pytest.mark.parametrize(
    ("server", "rc"),
    [(FakeServer(), 0), (FakeServer(faulty=True), 1), (FakeServer(token_cap=2), 1)],
    ids=["healthy", "failures", "short-completions"],
)
def test_burst_fails_unless_every_request_gets_its_tokens(server: FakeServer, rc: int) -> None:
    with running(server) as url:
        args = ["--model", "unused", "--base-url", url, "--baseline-url", url]
        assert burst.main([*args, "--num-requests", "6", "--max-tokens", "3"]) == rc
    # Each of the two "servers": one warm-up request, then the burst.
    assert len(server.bodies) == 2 * (1 + 6)
    assert all(b["prompt"] == burst.PROMPT and b["ignore_eos"] is True for b in server.bodies)


@pytest.mark.asyncio
async def test_hf_server_completions(model_dirs: dict[str, Path]) -> None:
    gen = hf_server.HFGenerator(str(model_dirs["gpt2"]), "float32", "hf")
    prompt = "The scheduler decides"
    async with TestClient(TestServer(hf_server.build_app(gen))) as client:

        async def complete(**body) -> dict:
            r = await client.post("/v1/completions", json={"prompt": prompt, **body})
            assert r.status == 200, await r.text()
            return await r.json()

        full = await complete(max_tokens=6)
        assert full["usage"]["prompt_tokens"] == len(gen.tokenizer(prompt).input_ids)
        assert full["usage"]["completion_tokens"] == 6
        assert full["choices"][0]["finish_reason"] == "length"

        # Make the first greedy token an EOS: the model stops there unless ignore_eos.
        first = gen.generate(gen.tokenizer(prompt).input_ids, 1, ignore_eos=False)[0]
        gen.model.generation_config.eos_token_id = first
        gen.eos_ids = {first}
        stopped = await complete(max_tokens=6)
        assert stopped["usage"]["completion_tokens"] == 1
        assert stopped["choices"][0]["finish_reason"] == "stop"
        ignored = await complete(max_tokens=6, ignore_eos=True)
        assert ignored["usage"]["completion_tokens"] == 6

        r = await client.post(
            "/v1/completions",
            json={"prompt": [5, 6, 7], "max_tokens": 4, "ignore_eos": True, "stream": True,
                  "stream_options": {"include_usage": True}},
        )  # fmt: skip
        lines = [line for line in (await r.text()).splitlines() if line]
        assert lines[-1] == "data: [DONE]" and len(lines) == 3
        chunk, usage = (json.loads(line.removeprefix("data: ")) for line in lines[:2])
        assert isinstance(chunk["choices"][0]["text"], str)
        assert usage["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}

        r = await client.post("/v1/completions", json={"prompt": prompt, "temperature": 0.7})
        assert r.status == 400
