"""The fleet harness's scale-from-zero scenario (bench/fleet/scale_zero.py): a request's first
token split at its hand-overs, and the arguments the scenario needs. The scenario itself runs real
engines (minutes on the CPU): bench/RESULTS.md has its figures."""

from __future__ import annotations

import pytest

from tests.support.scripts import load_script

fleet = load_script("bench/fleet/run.py")
scale_zero = load_script("bench/fleet/scale_zero.py")


def test_the_first_token_is_split_at_each_hand_over_and_the_parts_add_up() -> None:
    decision = {"from": 0, "to": 1, "signal": "heldRequests", "reason": "1 requests held at zero"}
    trial = scale_zero.split(100.0, 101.2, 101.5, 101.6, 111.6, 112.5, 113.0, decision)
    assert (trial.decision, trial.reconcile, trial.pod_start) == (1.2, 0.3, 0.1)
    assert (trial.engine_start, trial.probe, trial.first_token) == (10.0, 0.9, 0.5)
    assert trial.total == 13.0
    parts = sum(getattr(trial, phase) for phase in scale_zero.PHASES)
    assert parts == pytest.approx(trial.total)
    assert (trial.signal, trial.reason) == ("heldRequests", "1 requests held at zero")


def test_hand_overs_out_of_order_are_a_broken_measurement() -> None:
    # Ready before started: a probe that reached another process, not a negative engine start.
    with pytest.raises(ValueError, match="out of order"):
        scale_zero.split(100.0, 101.0, 101.5, 103.0, 102.0, 102.5, 104.0, {})


def test_the_kubelet_sees_an_engine_up_at_the_next_tick_of_its_startup_probe() -> None:
    pods = load_script("bench/fleet/pods.py")
    # Started at 100, probed every 10 s: up at 117 is seen at 120, up at 120 at once.
    assert pods.kubelet_sees(100.0, 117.0, 10.0) == 120.0
    assert pods.kubelet_sees(100.0, 120.0, 10.0) == 120.0
    assert pods.kubelet_sees(100.0, 117.3, 1.0) == 118.0
    assert pods.kubelet_sees(100.0, 117.3, 0.0) == 117.3  # no startup probe


def test_the_scenario_needs_a_service_that_may_go_to_zero() -> None:
    ns = fleet.parse_args(
        ["--scenario", "scale-from-zero", "--min-replicas", "0", "--scale-to-zero-delay", "5"]
    )
    autoscaling = fleet.inference_service(ns)["spec"]["autoscaling"]
    assert (autoscaling["minReplicas"], autoscaling["scaleToZeroDelaySeconds"]) == (0, 5)
    assert ns.repeats == 3
    for bad in (["--min-replicas", "1"], ["--min-replicas", "0", "--repeats", "0"]):
        with pytest.raises(SystemExit):
            fleet.parse_args(["--scenario", "scale-from-zero", *bad])
