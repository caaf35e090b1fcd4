"""The forecast judged on shaped loads (bench/forecast_loads.py: the operator's decision and
policy driven over simulated time): it adds no replicas for a rise that falls back (a sawtooth,
a spike, noise) and still brings capacity forward for a rise that keeps on (a ramp, stairs);
and the table in docs/autoscaling.md is what the command prints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.scripts import load_bench_script

bench = load_bench_script("forecast_loads")
ROOT = Path(__file__).resolve().parents[2]
STARTS = (20.0, 60.0, 120.0)
# The loads' peaks are 2.8 targets' worth: 3 replicas, inside the 10 % tolerance.
PEAK_NEED = 3


def runs(name: str, start_s: float) -> tuple:
    load = next(load for load in bench.loads() if load.name == name)
    return tuple(
        bench.simulate(load, bench.service_policy(ahead), start_s=start_s)
        for ahead in (False, True)
    )


@pytest.mark.parametrize("start_s", STARTS)
def test_a_sawtooth_whose_peaks_need_3_replicas_never_gets_more_with_scale_ahead(start_s):
    plain, ahead = runs("sawtooth", start_s)
    assert plain.peak_replicas == PEAK_NEED
    assert ahead.peak_replicas == PEAK_NEED, ahead.replicas


@pytest.mark.parametrize("start_s", STARTS)
@pytest.mark.parametrize("name", ["sawtooth", "spike", "noise"])
def test_a_rise_that_falls_back_costs_at_most_one_replica_for_one_start_time(name, start_s):
    # The margin: a first rise cannot be told from a ramp's start (forecast.py), so the forecast
    # may bring that one scale-up forward by up to a start time; nothing more.
    plain, ahead = runs(name, start_s)
    assert ahead.replica_seconds <= plain.replica_seconds + start_s
    assert ahead.slo_miss_seconds <= plain.slo_miss_seconds


@pytest.mark.parametrize(("name", "start_s"), [("ramp", s) for s in STARTS] + [("stairs", 60.0)])
def test_a_rise_that_keeps_on_still_gets_its_capacity_earlier(name, start_s):
    plain, ahead = runs(name, start_s)
    assert ahead.peak_ready_s < plain.peak_ready_s
    assert ahead.slo_miss_seconds < plain.slo_miss_seconds


def test_a_held_step_gets_no_more_than_it_needs():
    # A step fits a rising line for a window after it; it is no longer rising.
    plain, ahead = runs("step", 20.0)
    assert ahead.peak_replicas == plain.peak_replicas == PEAK_NEED
    assert ahead.replica_seconds == plain.replica_seconds


def test_the_model_counts_what_it_says():
    """One replica, a load of twice its target from 100 s on, replicas ready 30 s after asked."""
    load = bench.Load("double", "", bench.step(2.0, 8.0, 100.0))
    run = bench.simulate(load, bench.service_policy(False), start_s=30.0, duration_s=300.0)
    # Seen at the decision at 100 s; ready at 130 s: 100..129 over the target.
    assert run.slo_miss_seconds == 30
    assert run.peak_ready_s == 130
    assert run.replica_seconds == 100 * 1 + 200 * 2
    assert run.replicas[99:101] == (1, 2)


def test_the_docs_table_is_the_commands_output(capsys):
    assert bench.main([]) == 0
    printed = capsys.readouterr().out.strip()
    docs = (ROOT / "docs" / "autoscaling.md").read_text()
    assert printed in docs
    assert "python bench/forecast_loads.py" in docs


def test_the_json_has_each_run_without_its_trace(tmp_path, capsys):
    out = tmp_path / "loads.json"
    assert bench.main(["--start-seconds", "30", "--result-json", str(out)]) == 0
    runs = json.loads(out.read_text())
    assert [(r["load"], r["scale_ahead"]) for r in runs[:2]] == [
        ("sawtooth", False),
        ("sawtooth", True),
    ]
    assert len(runs) == 2 * len(bench.loads()) and {r["start_seconds"] for r in runs} == {30}
    assert "replicas" not in runs[0] and runs[0]["peak_replicas"] == PEAK_NEED
    assert "| 30 | sawtooth |" in capsys.readouterr().out
