"""bench/soak.py for a few seconds on the CPU: two engine processes and the router
(``kvfleet-router``'s own entry point) under good and hostile traffic; the run is clean and its
report has every count the issue asks for. And each kind of trouble fails a soak, and a server
that exits is counted and started again."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.support.scripts import load_bench_script

soak = load_bench_script("soak")


def test_a_short_soak_runs_clean_and_reports_what_it_saw(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    rc = soak.main(
        ["--duration", "5", "--clients", "2", "--out", str(out), "--log-dir", str(tmp_path)]
    )
    summary = json.loads(out.read_text())
    assert summary["failures"] == [], summary
    assert rc == 0
    # Traffic went through and was answered.
    assert summary["good_requests"] == summary["good_ok"] > 0
    assert summary["hostile_requests"] > 0
    assert summary["server_errors_5xx"] == summary["good_5xx"] + summary["hostile_5xx"] == 0
    assert summary["engine_exits"] == summary["router_exits"] == 0 and summary["exits"] == {}
    # Every server was probed all along, the router included.
    assert set(summary["health"]) == {"engine0", "engine1", "router"}
    for probe in summary["health"].values():
        assert probe["checks"] >= 10 and probe["failures"] == 0
        assert 0 < probe["p50_ms"] <= probe["p99_ms"] <= probe["max_ms"]
    assert summary["health_p99_ms"] < soak.HEALTH_P99_LIMIT_MS
    assert summary["nothing_held"] and summary["held"] == {
        "engines_not_idle": {},
        "open_client_connections": {},
        "killed_at_stop": [],
        "processes_left": [],
    }
    assert {"engine0.log", "engine1.log", "router.log"} <= {p.name for p in tmp_path.iterdir()}


def test_the_p99_is_the_nearest_rank() -> None:
    assert soak.p99([]) == 0.0
    assert soak.p99([5.0]) == 5.0
    assert soak.p99([float(i) for i in range(1, 101)]) == 99.0
    assert soak.p99([1.0] * 98 + [300.0, 400.0]) == 300.0


CLEAN = {
    "server_errors_5xx": 0,
    "engine_exits": 0,
    "router_exits": 0,
    "health": {"engine0": {"p99_ms": 12.0, "failures": 0}},
    "nothing_held": True,
    "held": {},
    "good_no_reply": 0,
    "good_broken_streams": 0,
    "good_ok": 10,
}


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"server_errors_5xx": 1}, "1 answers were 5xx"),
        ({"engine_exits": 1}, "engine_exits: 1"),
        ({"router_exits": 2}, "router_exits: 2"),
        ({"health": {"engine0": {"p99_ms": 250.0, "failures": 0}}}, "engine0 /health p99 250.0"),
        ({"health": {"engine0": {"p99_ms": 1.0, "failures": 3}}}, "engine0 /health failed 3"),
        ({"nothing_held": False, "held": {"processes_left": ["1 x"]}}, "held after"),
        ({"good_no_reply": 1}, "good_no_reply: 1"),
        ({"good_ok": 0}, "no good request was answered"),
    ],
)
def test_each_kind_of_trouble_fails_the_soak(change: dict[str, Any], reason: str) -> None:
    assert soak._failures(CLEAN) == []
    (failure,) = soak._failures({**CLEAN, **change})
    assert failure.startswith(reason)


def test_a_server_that_exits_is_counted_and_started_again(tmp_path: Path) -> None:
    server = soak.Server("engine0", [sys.executable, "-c", "pass"], 1, tmp_path / "e.log")
    first = server.proc
    first.wait()
    server.restart_if_exited(time.monotonic())
    assert server.exits and server.exits[0]["status"] == 0 and server.proc is not first
    server.proc.wait()
