"""bench/structured.py: its schemas and requests, the goal ratios, one run of the CLI against a
fake streaming server (the bench's own machinery), and a smoke run against a real engine on the
tiny model (seconds)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from jsonschema import Draft202012Validator

from kvfleet.engine.config import EngineArgs
from kvfleet.engine.server.app import ServerSettings
from tests.support.fake_openai import FakeServer, running
from tests.support.scripts import load_bench_script
from tests.support.servers import engine_server

structured = load_bench_script("structured")


def _record(tag: str, k: int) -> dict:
    return {"id": k, f"label_{tag}": "bolt", "tags": [f"{tag}-red"], "score": 0.5, "active": True}


def test_each_tag_is_its_own_schema_of_the_same_size() -> None:
    a, b = structured.records_schema("a", 5), structured.records_schema("b", 5)
    assert a != b and len(json.dumps(a)) == len(json.dumps(b))
    Draft202012Validator.check_schema(a)
    validator = Draft202012Validator(a)
    assert validator.is_valid({"records": [_record("a", k) for k in range(5)]})
    # Fewer records than asked for: a grammar cannot end the answer early.
    assert not validator.is_valid({"records": [_record("a", k) for k in range(4)]})
    assert not validator.is_valid({"records": [_record("b", k) for k in range(5)]})
    one = Draft202012Validator(structured.records_schema("c", 1, 1))
    assert not one.is_valid({"records": [_record("c", 0), _record("c", 1)]})


def test_requests_per_mode() -> None:
    free, cached, new = (structured.Requests(m, "m", 32, 8) for m in structured.MODES)
    assert free[0]["ignore_eos"] is True and "structured_outputs" not in free[0]
    assert free[0]["max_completion_tokens"] == cached[5]["max_completion_tokens"] == 32
    assert all("ignore_eos" not in r[3] for r in (cached, new))
    assert cached[0]["structured_outputs"] == cached[7]["structured_outputs"]
    assert new[0]["structured_outputs"] != new[1]["structured_outputs"]
    assert new[0]["structured_outputs"]["disable_any_whitespace"] is True
    # Same prompt, each request its own tag at the start (no cross-mode prefix-cache hits).
    prompts = [r[k]["messages"][0]["content"] for r in (free, cached, new) for k in (0, 1)]
    assert len(set(prompts)) == 6 and all(p.endswith(structured.PROMPT) for p in prompts)
    assert len(new) > 10**9
    # A later round repeats neither a prompt nor a new schema.
    later = structured.Requests("new_schema", "m", 32, 8, 1)
    assert later[0]["structured_outputs"] != new[0]["structured_outputs"]
    assert later[0]["messages"] != new[0]["messages"]
    with pytest.raises(ValueError, match="unknown mode"):
        structured.Requests("fast", "m", 1, 1)


def test_the_cli_refuses_bad_arguments() -> None:
    bad = (["--modes", "fast"], ["--modes", "new_schema,new_schema"], ["--users", "0"],
           ["--duration", "0"], ["--rounds", "0"])  # fmt: skip
    for argv in bad:
        with pytest.raises(SystemExit):
            structured.parse_args(["--model", "m", *argv])


def test_end_to_end_against_a_fake_server(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    async def followed(*args: object) -> None:
        # The fake streams whatever it is asked: it follows no schema.
        pass

    monkeypatch.setattr(structured, "check_schema_followed", followed)
    server = FakeServer(delay_s=0.005)
    out = tmp_path / "structured.json"
    with running(server) as url:
        rc = structured.main(
            [
                *("--base-url", url, "--model", "fake", "--users", "3", "--max-tokens", "6"),
                *("--warmup-duration", "0.3", "--duration", "0.6", "--rounds", "2"),
                *("--result-json", str(out)),
            ]
        )
    assert rc == 0
    doc = json.loads(out.read_text())
    assert list(doc["modes"]) == list(structured.MODES)
    for mode in doc["modes"].values():
        assert mode["successful_requests"] > 3 and mode["failed_requests"] == 0
        assert mode["short"] == 0 and mode["tpot_ms"]["p50"] > 0
    assert set(doc["ratios"]) == {
        f"{m}_{s}_{p}_ratio"
        for m in ("cached_schema", "new_schema")
        for s in ("tpot", "ttft")
        for p in ("p50", "p90")
    }
    schemas = [json.dumps(b.get("structured_outputs")) for b in server.bodies]
    assert len(set(schemas)) == 2 + sum("label_r" in s for s in schemas)  # none, cached, new
    report = capsys.readouterr().out
    assert "TPOT cached schema / unconstrained" in report and "goal <= 1.2" in report


def test_smoke_against_the_engine(model_dirs, tmp_path: Path) -> None:
    settings = ServerSettings(host="127.0.0.1", port=0, served_model_name=["tiny"])
    out = tmp_path / "structured.json"
    args = EngineArgs(model=str(model_dirs["llama"]), dtype="float32")
    with engine_server(args, settings) as srv:
        rc = structured.main(
            [
                *("--base-url", srv.url, "--model", "tiny", "--users", "4"),
                *("--max-tokens", "12", "--items", "8", "--warmup-duration", "1"),
                *("--duration", "1", "--result-json", str(out)),
            ]
        )
    assert rc == 0
    doc = json.loads(out.read_text())
    for mode in doc["modes"].values():
        assert mode["successful_requests"] > 0 and mode["failed_requests"] == 0
        assert mode["short"] == 0
    # The engine's histograms saw every request the client timed, and its share is the smaller.
    for mode, phases in doc["engine_phases"].items():
        (engine_s, engine_n), (client_s, client_n) = phases["engine_ttft"], doc["client_ttft"][mode]
        assert engine_n == client_n > 0
        assert 0 < engine_s < client_s
        assert phases["queue"][0] + phases["prefill"][0] <= engine_s


def test_no_verdict_without_measurements() -> None:
    empty = structured.compute_metrics([], 1.0)
    modes = structured.MODES
    report = structured.format_report({m: empty for m in modes}, dict.fromkeys(modes, 0), 8)
    assert "n/a" in report and "met" not in report and "MISSED" not in report


def test_engine_phases_are_the_histograms_increase_between_scrapes() -> None:
    before = {"engine_ttft": (1.0, 2.0), "queue": (0.5, 2.0)}
    after = {"engine_ttft": (4.0, 5.0), "queue": (0.8, 5.0), "prefill": (2.0, 3.0)}
    added = structured.phase_means(before, after)
    assert added == {"engine_ttft": (3.0, 3.0), "queue": pytest.approx((0.3, 3.0))}
    table = structured.format_phases(
        {"unconstrained": added}, {"unconstrained": (4.5, 3.0)}
    )  # client 1.5 s a request, engine 1.0 s: 500 ms outside it
    assert "| unconstrained | 1500.00 | 1000.00 | 100.00 | n/a | 500.00 |" in table
    assert structured.format_phases({"unconstrained": {}}, {}) == ""
