"""bench/gil_contention.py: a row per engine-thread load (no engine thread first), and its
arguments checked."""

from __future__ import annotations

import re

import pytest

from tests.support.scripts import load_bench_script

gil_contention = load_bench_script("gil_contention")


def test_one_row_per_load_after_the_idle_baseline(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--busy", "1", "3", "--period", "5", "--wakeups", "5", "--switch-interval", "1"]
    assert gil_contention.main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("switch interval 1 ms, step 5 ms"), out
    rows = re.findall(r"^\| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|$", out, re.M)
    assert [r[0] for r in rows] == ["0", "1", "3"], out


def test_a_busy_time_longer_than_the_step_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        gil_contention.main(["--busy", "8", "--period", "7.3"])
    assert exc.value.code == 2
    assert "between 0 and --period" in capsys.readouterr().err
