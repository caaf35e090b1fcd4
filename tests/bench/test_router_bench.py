"""bench/router_bench.py at its smallest on the CPU: real engine processes, routers started as
production starts them, the stub upstream; every run answers and the result has its fields. And
the guard that keeps a benchmark from running on against a server that died."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.scripts import load_bench_script

router_bench = load_bench_script("router_bench")
common = load_bench_script("common")


def test_router_bench_runs_each_policy_and_the_added_latency(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "router.json"
    rc = router_bench.main(
        [
            *("--engines", "1", "--conversations", "2", "--turns", "2", "--system-prompts", "1"),
            *("--system-words", "20", "--user-words", "10", "--max-tokens", "4"),
            *("--hidden-size", "64", "--layers", "1", "--kv-blocks", "64", "--think-time", "0"),
            *("--latency-requests", "20", "--rate", "100", "--cache-dir", str(tmp_path)),
            *("--latency-engines", "2", "--latency-prompts", "4", "--latency-prompt-words", "60"),
            *("--result-json", str(out)),
        ]
    )
    assert rc == 0
    doc = json.loads(out.read_text())
    policies = [r["policy"] for r in doc["affinity"]]
    assert policies == [
        "round robin",
        "router, session header",
        "router, prefix key (128 tokens)",
        "router, precise",
    ]
    for r in doc["affinity"]:
        assert r["requests"] == 2 * 2 and 0 <= r["hit_rate"] <= 1
        assert 0 < r["ttft_p50_ms"] <= r["ttft_p90_ms"]
    round_robin, *routed = doc["affinity"]
    assert round_robin["spilled"] is None
    assert all(isinstance(r["spilled"], int) for r in routed)
    assert [r["path"] for r in doc["latency"]] == ["direct", "router", "router, precise"]
    for r in doc["latency"]:
        assert r["requests"] == 20 and 0 < r["total_p50_ms"] <= r["total_p99_ms"]
    direct, plain, precise = doc["latency"]
    assert direct["added_p99_ms"] is None and plain["added_p50_ms"] is not None
    assert precise["added_p99_ms"] == pytest.approx(
        precise["total_p99_ms"] - direct["total_p99_ms"]
    )
    # Direct goes to the first stub engine, which holds half the prompts; the precise router
    # sends every request to the engine whose KV events name its prompt's blocks.
    assert direct["on_holding_engine"] == 0.5
    assert precise["on_holding_engine"] == 1.0
    assert "| router, session header |" in capsys.readouterr().out


def _exits_soon(status: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", f"import sys; sys.exit({status})"])


def test_a_server_that_exits_midway_fails_the_benchmark_by_name() -> None:
    proc = _exits_soon(3)
    running_out = pytest.raises(RuntimeError, match="exited with status 3 while the benchmark ran")
    with running_out, common.watched([proc]):
        proc.wait()
    # A failure of the body is said as the exit that caused it.
    proc = _exits_soon(4)
    with pytest.raises(RuntimeError, match="status 4") as info, common.watched([proc]):
        proc.wait()
        raise ConnectionRefusedError
    assert isinstance(info.value.__cause__, ConnectionRefusedError)
    # While every process runs, the body's own error passes through unchanged.
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        with pytest.raises(ConnectionRefusedError), common.watched([alive]):
            raise ConnectionRefusedError
    finally:
        common.stop([alive])


def test_the_router_entry_point_stays_up(tmp_path: Path) -> None:
    port = common.free_port()
    proc = common.start_router(["127.0.0.1:9"], port, tmp_path / "router.log")
    try:
        common.wait_ready([f"http://127.0.0.1:{port}"], "/health", timeout_s=30, procs=[proc])
        time.sleep(0.5)
        assert proc.poll() is None
    finally:
        assert common.stop([proc]) == []
    assert proc.returncode == 0  # SIGTERM: a clean shutdown
