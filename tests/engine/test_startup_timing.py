"""The phases of an engine's start (engine/startup_timing.py)."""

from __future__ import annotations

import logging

import pytest

from kvfleet.engine.startup_timing import AFTER_READY, StartupTimer, process_age

# /proc/<pid>/stat of a process whose name holds a space and a parenthesis; it started 250
# ticks (2.5 s at 100 Hz) after boot.
STAT = "4242 (py (x) y) S 1 4242 4242 0 -1 4194560 " + " ".join(["0"] * 12) + " 250 99 12"


def test_process_age_counts_fields_after_the_name():
    assert process_age(STAT, boot_seconds=10.0, ticks_per_second=100) == pytest.approx(7.5)
    assert process_age("garbage", 10.0, 100) is None
    assert process_age("1 (x) S 2 3", 10.0, 100) is None


def test_own_process_age_is_read():
    timer = StartupTimer()
    assert 0 < timer.seconds["process"] < 3600


def test_phases_add_up_and_after_ready_is_not_part_of_the_start(caplog):
    timer = StartupTimer(process_seconds=1.0)
    with timer.phase("weights"):
        pass
    timer.record("warm_up", 2.0)
    timer.record("warm_up", 0.5)
    timer.record(AFTER_READY, 9.0)
    assert timer.seconds["warm_up"] == 2.5
    assert timer.to_ready == pytest.approx(3.5 + timer.seconds["weights"])
    with caplog.at_level(logging.INFO, "kvfleet.engine.startup_timing"):
        timer.log_ready()
        timer.log_ready()
    [line] = [r.getMessage() for r in caplog.records]
    assert line.startswith("ready in 3.5") and "process 1.00s" in line
    assert line.index("weights") < line.index("warm_up 2.50s") and AFTER_READY not in line


def test_the_steps_of_a_phase_make_it_up_and_are_logged_with_it(caplog):
    timer = StartupTimer(process_seconds=1.0)
    with timer.step("config", "device"):
        pass
    with timer.step("config", "model_config"):
        pass
    timer.steps["config"] = {"device": 6.0, "model_config": 3.0}  # readable numbers below
    timer.seconds["config"] = 9.0
    assert set(timer.steps) == {"config"}
    with caplog.at_level(logging.INFO, "kvfleet.engine.startup_timing"):
        timer.log_ready()
    [line] = [r.getMessage() for r in caplog.records]
    assert "config 9.00s (device 6.00s, model_config 3.00s)" in line
    assert "process 1.00s," in line


def test_a_step_adds_to_its_phase():
    timer = StartupTimer(process_seconds=0.0)
    timer.record("config", 1.0)
    with timer.step("config", "device"):
        pass
    assert timer.seconds["config"] == pytest.approx(1.0 + timer.steps["config"]["device"], abs=1e-3)


def test_an_unknown_phase_is_refused():
    with pytest.raises(ValueError, match="unknown start-up phase"), StartupTimer().phase("nap"):
        pass
    timer = StartupTimer()
    with pytest.raises(ValueError, match="unknown start-up phase"), timer.step("nap", "x"):
        pass
    assert timer.steps == {}
