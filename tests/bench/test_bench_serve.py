"""bench/serve.py: the pure parts (dataset, arrival schedule, SSE parsing, aggregation) and one
end-to-end run of the CLI against a fake OpenAI-compatible streaming server."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.support.fake_openai import FakeServer, running, sse_chunk
from tests.support.scripts import load_bench_script

serve = load_bench_script("serve")

POOL = serve.token_pool(1000, excluded_ids=[0, 1, 2])


# --------------------------------------------------------------------------------------------
# Dataset
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ratio", [0.0, 0.1, 0.3, 0.5, 0.9])
def test_lengths_within_range(ratio: float) -> None:
    data = serve.generate_random_dataset(
        300, 100, 20, pool=POOL, range_ratio=ratio, prefix_len=0, seed=7
    )
    ins = np.array([s.prompt_len for s in data])
    outs = np.array([s.output_len for s in data])
    assert ins.min() >= 100 * (1 - ratio) - 1e-9 and ins.max() <= 100 * (1 + ratio) + 1e-9
    assert outs.min() >= max(1, 20 * (1 - ratio) - 1e-9) and outs.max() <= 20 * (1 + ratio)
    if ratio == 0.0:
        assert set(ins) == {100} and set(outs) == {20}
    else:
        # A uniform draw over a wide range should not collapse onto one value.
        assert len(set(ins)) > 5


def test_length_bounds_resist_float_noise() -> None:
    # 10 * (1 - 0.3) is 7.000000000000001 in floats; the bound must still be 7.
    assert serve.length_bounds(10, 0.3) == (7, 13)
    assert serve.length_bounds(100, 0.0) == (100, 100)


def test_ids_come_from_pool() -> None:
    pool = serve.token_pool(50, excluded_ids=[0, 1, 2, 49])
    data = serve.generate_random_dataset(20, 64, 4, pool=pool, prefix_len=8, seed=1)
    ids = {t for s in data for t in s.prompt_ids}
    assert ids <= set(range(3, 49))
    assert all(isinstance(t, int) for t in data[0].prompt_ids)  # JSON-serialisable ints


def test_same_seed_same_dataset() -> None:
    kw: dict[str, Any] = {"pool": POOL, "range_ratio": 0.2, "prefix_len": 16}
    a = serve.generate_random_dataset(50, 64, 16, seed=3, **kw)
    b = serve.generate_random_dataset(50, 64, 16, seed=3, **kw)
    c = serve.generate_random_dataset(50, 64, 16, seed=4, **kw)
    assert a == b
    assert a != c
    # Warmup prompts are taken from the tail, so asking for more must not change the first ones.
    assert serve.generate_random_dataset(60, 64, 16, seed=3, **kw)[:50] == a


def test_shared_prefix_present() -> None:
    data = serve.generate_random_dataset(30, 40, 8, pool=POOL, prefix_len=25, seed=5)
    prefix = data[0].prompt_ids[:25]
    for s in data:
        assert s.prefix_len == 25
        assert s.prompt_ids[:25] == prefix
        assert s.prompt_len == 25 + 40
    # The parts after the prefix are each request's own.
    assert len({tuple(s.prompt_ids[25:]) for s in data}) == len(data)


def test_chat_text_decodes_prefix_separately() -> None:
    class Tok:
        def decode(self, ids: list[int]) -> str:
            return "|".join(map(str, ids)) + ";"

    s = serve.SampleRequest([1, 2, 3, 4], output_len=2, prefix_len=2)
    assert serve.chat_text(s, Tok()) == "1|2;3|4;"


def test_build_payload() -> None:
    s = serve.SampleRequest([5, 6, 7], output_len=9)
    p = serve.build_payload(s, "completions", "m", extra_body={"top_k": 1})
    assert p["prompt"] == [5, 6, 7] and p["max_tokens"] == 9 and p["model"] == "m"
    assert p["ignore_eos"] is True and p["temperature"] == 0.0 and p["top_k"] == 1
    assert p["stream"] is True and p["stream_options"] == {"include_usage": True}
    c = serve.build_payload(s, "chat", "m", ignore_eos=False, prompt_text="hi")
    assert c["messages"] == [{"role": "user", "content": "hi"}]
    assert c["max_completion_tokens"] == 9
    assert "ignore_eos" not in c and "prompt" not in c and "max_tokens" not in c
    with pytest.raises(ValueError):
        serve.build_payload(s, "chat", "m")
    text = serve.build_payload(s, "completions", "m", prompt_text="Tell me")
    assert text["prompt"] == "Tell me" and text["max_tokens"] == 9


# --------------------------------------------------------------------------------------------
# Arrival schedule
# --------------------------------------------------------------------------------------------


def test_poisson_schedule_mean_interarrival() -> None:
    rate = 20.0
    times = np.array(serve.arrival_times(50_001, rate, seed=11))
    gaps = np.diff(times)
    assert times[0] == 0.0 and np.all(gaps >= 0)
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.02)
    # Exponential gaps: standard deviation equals the mean (a fixed pace would give 0).
    assert gaps.std() == pytest.approx(1 / rate, rel=0.03)
    assert serve.arrival_times(100, rate, seed=11) == times[:100].tolist()


def test_infinite_rate_sends_all_at_once() -> None:
    assert serve.arrival_times(7, math.inf) == [0.0] * 7
    assert serve.arrival_times(0, 5.0) == []
    with pytest.raises(ValueError):
        serve.arrival_times(3, 0.0)


# --------------------------------------------------------------------------------------------
# SSE parsing and per-stream bookkeeping
# --------------------------------------------------------------------------------------------


def test_parse_sse_line() -> None:
    assert serve.parse_sse_line('data: {"a": 1}') == '{"a": 1}'
    assert serve.parse_sse_line('data:{"a": 1}\r\n') == '{"a": 1}'
    assert serve.parse_sse_line("data: [DONE]") == "[DONE]"
    assert serve.parse_sse_line("") is None
    assert serve.parse_sse_line(": keep-alive") is None
    assert serve.parse_sse_line("event: message") is None


def test_sse_buffer_across_every_split_point() -> None:
    text = 'data: {"t": "é€"}\r\n\r\n: ping\n\ndata: {"t": "x"}\n\ndata: [DONE]'
    raw = text.encode()
    expected = ['{"t": "é€"}', '{"t": "x"}', "[DONE]"]
    for cut in range(len(raw) + 1):
        buf = serve.SSELineBuffer()
        # The cut may fall inside a line or inside a multi-byte character.
        got = buf.feed(raw[:cut]) + buf.feed(raw[cut:]) + buf.flush()
        assert got == expected, cut
    buf = serve.SSELineBuffer()
    assert buf.feed(b"data: [DO") == []
    assert buf.feed(b"NE]\n") == ["[DONE]"]
    assert buf.flush() == []


def test_stream_state_timings_and_usage() -> None:
    st = serve.StreamState(start=10.0)
    st.on_data(json.dumps({"choices": [{"index": 0, "delta": {"role": "assistant"}}]}), 10.1)
    st.on_data(sse_chunk("", chat=True), 10.2)  # empty content: not a token yet
    st.on_data(sse_chunk("a", chat=True), 10.5)
    st.on_data(sse_chunk("b", chat=True), 10.7)
    st.on_data(sse_chunk("c", chat=True), 11.0)
    st.on_data(
        json.dumps({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 4}}), 11.1
    )
    st.on_data("[DONE]", 11.1)
    rec = st.finish(11.2, prompt_len=99, bench_start=9.0)
    assert rec.success and rec.error == ""
    assert rec.ttft == pytest.approx(0.5)
    assert rec.itl == pytest.approx([0.2, 0.3])
    assert rec.e2e == pytest.approx(1.2) and rec.start == pytest.approx(1.0)
    # Usage wins over the chunk count (a chunk may carry several tokens).
    assert rec.output_tokens == 4 and rec.prompt_len == 5


def test_stream_state_without_usage_counts_chunks() -> None:
    st = serve.StreamState(start=0.0)
    for i, t in enumerate(["x", "y", "z"]):
        st.on_data(sse_chunk(t), 0.1 * (i + 1))
    st.on_data("[DONE]", 0.4)
    rec = st.finish(0.4, prompt_len=12, bench_start=0.0)
    assert rec.success and rec.output_tokens == 3 and rec.prompt_len == 12


def test_stream_state_failures() -> None:
    st = serve.StreamState(start=0.0)
    st.on_data(sse_chunk("x"), 0.1)
    rec = st.finish(0.2, prompt_len=1, bench_start=0.0)
    assert not rec.success and "[DONE]" in rec.error

    st = serve.StreamState(start=0.0)
    st.on_data(json.dumps({"error": {"message": "boom", "code": 500}}), 0.1)
    st.on_data("[DONE]", 0.1)
    rec = st.finish(0.2, prompt_len=1, bench_start=0.0)
    assert not rec.success and "boom" in rec.error

    st = serve.StreamState(start=0.0)
    st.on_data("{not json", 0.1)
    st.on_data("[DONE]", 0.1)
    assert not st.finish(0.2, prompt_len=1, bench_start=0.0).success


# --------------------------------------------------------------------------------------------
# Aggregation
# --------------------------------------------------------------------------------------------


def test_latency_stats_match_numpy() -> None:
    rng = np.random.default_rng(0)
    for n in (1, 2, 7, 100, 1001):
        v = rng.gamma(2.0, 0.05, size=n)
        stats = serve.latency_stats(v.tolist(), (50, 90, 99, 99.9))
        assert stats["mean"] == pytest.approx(v.mean() * 1000)
        for p in (50, 90, 99, 99.9):
            assert stats[f"p{p:g}"] == pytest.approx(np.percentile(v, p) * 1000)
    assert serve.latency_stats([]) == {"mean": None, "p50": None, "p90": None, "p99": None}


def test_compute_metrics() -> None:
    rng = np.random.default_rng(1)
    records = []
    for i in range(40):
        n_out = int(rng.integers(1, 30))
        itl = rng.uniform(0.005, 0.02, size=n_out - 1).tolist()
        ttft = float(rng.uniform(0.01, 0.2))
        records.append(
            serve.RequestRecord(
                success=True,
                prompt_len=100 + i,
                output_tokens=n_out,
                ttft=ttft,
                e2e=ttft + sum(itl),
                itl=itl,
            )
        )
    failed = [
        serve.RequestRecord(error="HTTP 500: x", prompt_len=7, output_tokens=3, e2e=9.0),
        serve.RequestRecord(error="HTTP 500: x"),
        serve.RequestRecord(error="stream ended without [DONE]"),
    ]
    m = serve.compute_metrics(records + failed, duration_s=4.0)

    assert m.successful_requests == 40 and m.failed_requests == 3
    assert m.errors == {"HTTP 500: x": 2, "stream ended without [DONE]": 1}
    tot_in = sum(r.prompt_len for r in records)
    tot_out = sum(r.output_tokens for r in records)
    assert (m.total_input_tokens, m.total_output_tokens) == (tot_in, tot_out)
    assert m.request_throughput == pytest.approx(10.0)
    assert m.output_throughput == pytest.approx(tot_out / 4.0)
    assert m.total_token_throughput == pytest.approx((tot_in + tot_out) / 4.0)

    ttft = np.array([r.ttft for r in records]) * 1000
    tpot = np.array(
        [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in records if r.output_tokens > 1]
    )
    itl = np.concatenate([r.itl for r in records]) * 1000
    e2e = np.array([r.e2e for r in records]) * 1000
    for stats, ref in (
        (m.ttft_ms, ttft),
        (m.tpot_ms, tpot * 1000),
        (m.itl_ms, itl),
        (m.e2e_ms, e2e),
    ):
        assert stats["mean"] == pytest.approx(ref.mean())
        for p in (50, 90, 99):
            assert stats[f"p{p}"] == pytest.approx(np.percentile(ref, p))

    report = serve.format_report(m)
    for label in ("Successful requests:", "Failed requests:", "P99 ITL (ms):", "HTTP 500: x"):
        assert label in report

    empty = serve.compute_metrics([], duration_s=0.0)
    assert empty.request_throughput is None and empty.ttft_ms["p50"] is None
    assert "n/a" in serve.format_report(empty)


# --------------------------------------------------------------------------------------------
# End to end against a fake server
# --------------------------------------------------------------------------------------------


def test_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    server = FakeServer()
    out = tmp_path / "result.json"
    with running(server) as url:
        rc = serve.main(
            [
                *("--base-url", url, "--model", "fake", "--vocab-size", "500"),
                *("--num-prompts", "12", "--input-len", "20", "--output-len", "8"),
                *("--range-ratio", "0.25", "--prefix-len", "5", "--warmup", "2"),
                *("--request-rate", "400", "--max-concurrency", "4", "--api-key", "sekrit"),
                *("--result-json", str(out), "--save-detailed"),
            ]
        )
    assert rc == 0
    assert len(server.bodies) == 14  # 2 warmup + 12 measured
    assert server.max_in_flight <= 4
    assert set(server.auth) == {"Bearer sekrit"}
    for body in server.bodies:
        assert body["model"] == "fake" and body["ignore_eos"] is True
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        assert all(isinstance(t, int) and 0 <= t < 500 for t in body["prompt"])
        assert body["prompt"][:5] == server.bodies[0]["prompt"][:5]
        assert 6 <= body["max_tokens"] <= 10

    report = capsys.readouterr().out
    assert "Serving Benchmark Result" in report and "Mean TTFT (ms):" in report

    doc = json.loads(out.read_text())
    assert doc["args"]["request_rate"] == 400.0 and "api_key" not in doc["args"]
    m = doc["metrics"]
    assert m["successful_requests"] == 12 and m["failed_requests"] == 0 and m["errors"] == {}
    measured = server.bodies[2:]  # the warmup goes out first
    assert m["total_output_tokens"] == sum(b["max_tokens"] for b in measured)
    assert m["total_input_tokens"] == sum(len(b["prompt"]) for b in measured)
    assert m["ttft_ms"]["mean"] > 0 and m["tpot_ms"]["p50"] > 0 and m["itl_ms"]["p99"] > 0
    assert m["e2e_ms"]["p50"] >= m["ttft_ms"]["p50"]
    assert m["request_throughput"] > 0 and m["output_throughput"] > 0
    assert len(doc["requests"]) == 12
    for r in doc["requests"]:
        assert r["success"] and len(r["itl"]) == r["output_tokens"] - 1


def test_end_to_end_counts_failures(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    server = FakeServer(faulty=True)
    out = tmp_path / "result.json"
    with running(server) as url:
        rc = serve.main(
            [
                *("--base-url", url, "--model", "fake", "--vocab-size", "500"),
                *("--num-prompts", "10", "--input-len", "8", "--output-len", "4"),
                *("--no-ignore-eos", "--result-json", str(out)),
            ]
        )
    assert rc == 0
    assert all("ignore_eos" not in b for b in server.bodies)
    m = json.loads(out.read_text())["metrics"]
    # Requests 0 and 5 get HTTP 500; 1 and 6 lose their [DONE].
    assert (m["successful_requests"], m["failed_requests"]) == (6, 4)
    assert sum(m["errors"].values()) == 4
    assert any(e.startswith("HTTP 500") and "injected" in e for e in m["errors"])
    assert m["errors"].get("stream ended without [DONE]") == 2
    assert m["total_output_tokens"] == 6 * 4
    report = capsys.readouterr().out
    assert "Failed requests:" in report and "HTTP 500" in report


def test_end_to_end_chat_and_unreachable_server(tmp_path: Path) -> None:
    from tests.support.tiny_model import build_tokenizer

    tok_dir = tmp_path / "tok"
    build_tokenizer(tok_dir)
    server = FakeServer()
    with running(server) as url:
        rc = serve.main(
            [
                *("--base-url", url, "--model", "fake", "--endpoint", "chat"),
                *("--tokenizer", str(tok_dir), "--num-prompts", "4", "--input-len", "16"),
                *("--output-len", "3", "--prefix-len", "8"),
            ]
        )
    assert rc == 0 and len(server.bodies) == 4
    contents = [b["messages"][0]["content"] for b in server.bodies]
    assert all(isinstance(c, str) and c for c in contents)
    assert all(b["max_completion_tokens"] == 3 for b in server.bodies)

    # The server is gone now: every request must come back as a counted failure.
    out = tmp_path / "dead.json"
    rc = serve.main(
        [
            *("--base-url", url, "--model", "fake", "--vocab-size", "100"),
            *("--num-prompts", "3", "--input-len", "4", "--output-len", "2"),
            *("--result-json", str(out)),
        ]
    )
    m = json.loads(out.read_text())["metrics"]
    assert rc == 1 and m["failed_requests"] == 3 and m["successful_requests"] == 0
    assert all("Connect" in e for e in m["errors"])


# --------------------------------------------------------------------------------------------
# Closed-loop users
# --------------------------------------------------------------------------------------------


def test_in_window_keeps_requests_inside_both_edges() -> None:
    def rec(start: float, e2e: float) -> Any:
        return serve.RequestRecord(success=True, start=start, e2e=e2e)

    inside = [rec(0.0, 1.0), rec(2.0, 1.0), rec(9.5, 0.5)]
    cut = [rec(-0.1, 1.0), rec(9.5, 0.6), rec(-1.0, 12.0), rec(10.0, 0.1)]
    assert serve.in_window(inside + cut, 10.0) == inside


def test_closed_loop_users_count_only_requests_inside_the_window(tmp_path: Path) -> None:
    server = FakeServer(delay_s=0.005)
    out = tmp_path / "users.json"
    with running(server) as url:
        rc = serve.main(
            [
                *("--base-url", url, "--model", "fake", "--endpoint", "chat"),
                *("--prompt", "Explain RAG in 3 sentences", "--output-len", "6"),
                *("--users", "3", "--warmup-duration", "0.4", "--duration", "0.8"),
                *("--result-json", str(out)),
            ]
        )
    assert rc == 0
    # A closed loop: never more requests in flight than users, and all of them busy.
    assert server.max_in_flight == 3
    assert {b["messages"][0]["content"] for b in server.bodies} == {"Explain RAG in 3 sentences"}
    assert all(b["max_completion_tokens"] == 6 for b in server.bodies)

    doc = json.loads(out.read_text())
    assert doc["requests_sent"] == len(server.bodies)
    counted = doc["requests"]
    m = doc["metrics"]
    assert m["successful_requests"] == len(counted) > 0 and m["failed_requests"] == 0
    assert all(r["start"] >= 0 and r["start"] + r["e2e"] <= 0.8 for r in counted)
    # Sent but not counted: each user's last request, which ends after the window closed, and
    # at least the first user's first one, sent as the warm-up began.
    assert doc["requests_sent"] >= len(counted) + 3 + 1
    assert m["duration_s"] == 0.8
    assert m["output_throughput"] == pytest.approx(6 * len(counted) / 0.8)
    assert m["total_input_tokens"] == len(counted) * (3 + len("Explain RAG in 3 sentences"))
    assert m["tpot_ms"]["p99"] > 0 and m["ttft_ms"]["p50"] > 0


def test_closed_loop_arguments() -> None:
    base = ["--model", "fake", "--vocab-size", "100"]
    for bad in (
        ["--users", "2"],  # no --duration
        ["--users", "2", "--duration", "1", "--request-rate", "5"],
        ["--users", "0", "--duration", "1"],
        ["--duration", "1"],  # no --users
        ["--prompt", "hi", "--prefix-len", "4"],
        ["--prompt", ""],
    ):
        with pytest.raises(SystemExit):
            serve.parse_args(base + bad)
    # A fixed prompt needs no vocabulary, even for chat.
    args = serve.parse_args(["--model", "fake", "--endpoint", "chat", "--prompt", "hi"])
    assert args.prompt == "hi" and args.tokenizer is None
