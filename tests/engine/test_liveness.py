"""Liveness verdicts: a step within its size's bound is busy, one past it is stuck, a loop that
starts no step while requests wait is stuck; the allowance per token follows the machine's own
rate (learned from its big steps only)."""

from __future__ import annotations

import pytest

from kvfleet.engine.liveness import (
    RATE_MARGIN,
    RATE_MIN_TOKENS,
    RunningStep,
    StepRate,
    default_seconds_per_token,
    stall_verdict,
    step_bound,
)

STALL = 60.0


def test_a_long_step_within_its_bound_is_busy_and_says_so() -> None:
    # A 4,000-token prefill at 0.05 s a token is allowed 60 + 200 s.
    bound = step_bound(4000, STALL, 0.05, learned_rate=0.0)
    assert bound == pytest.approx(260.0)
    verdict = stall_verdict(
        1067.0,
        step=RunningStep(1000.0, 4000, bound),
        last_progress=1000.0,
        waiting=True,
        stall_timeout=STALL,
    )
    assert verdict.healthy
    assert verdict.reason == "a step of 4000 tokens has run 67.0 s of its 260.0 s bound"


def test_a_step_past_its_bound_is_stuck_whether_or_not_requests_wait() -> None:
    step = RunningStep(1000.0, 10, step_bound(10, STALL, 0.05, 0.0))
    for waiting in (True, False):
        verdict = stall_verdict(
            1061.0, step=step, last_progress=1000.0, waiting=waiting, stall_timeout=STALL
        )
        assert not verdict.healthy
        assert verdict.reason == (
            "engine loop is stuck: a step of 10 tokens has run 61.0 s, past its bound of 60.5 s"
        )


def test_between_steps_the_loop_is_stuck_only_with_requests_waiting() -> None:
    def verdict(now: float, waiting: bool):
        return stall_verdict(
            now, step=None, last_progress=1000.0, waiting=waiting, stall_timeout=STALL
        )

    assert verdict(5000.0, waiting=False).healthy  # idle for an hour: nothing to do
    assert verdict(1059.0, waiting=True).healthy
    stuck = verdict(1061.0, waiting=True)
    assert not stuck.healthy
    assert stuck.reason == (
        "engine loop is not making progress: no step for 61.0 s with requests waiting "
        "(bound 60.0 s)"
    )


def test_the_allowance_per_token_is_the_default_or_the_learned_rate_times_the_margin() -> None:
    assert default_seconds_per_token("cpu") > 10 * default_seconds_per_token("cuda")
    assert step_bound(1000, STALL, 0.001, learned_rate=0.0) == pytest.approx(61.0)
    # A machine four times slower than the default assumes gets the time its steps take.
    slow = 0.01
    assert step_bound(1000, STALL, 0.001, learned_rate=slow) == pytest.approx(
        STALL + 1000 * RATE_MARGIN * slow
    )
    assert step_bound(0, STALL, 0.001, learned_rate=slow) == STALL


def test_the_rate_is_learned_from_big_steps_only_as_a_moving_average() -> None:
    rate = StepRate()
    assert rate.seconds_per_token == 0.0
    # A decode step's time is its fixed cost: no rate per token to learn from it.
    rate.observe(0.05, 1)
    rate.observe(0.5, RATE_MIN_TOKENS - 1)
    assert rate.seconds_per_token == 0.0
    rate.observe(2.0, 1000)
    assert rate.seconds_per_token == pytest.approx(0.002)
    rate.observe(12.0, 1000)  # the machine slows down: the rate follows, not at once
    assert 0.002 < rate.seconds_per_token < 0.012
    for _ in range(50):
        rate.observe(12.0, 1000)
    assert rate.seconds_per_token == pytest.approx(0.012, rel=1e-3)
