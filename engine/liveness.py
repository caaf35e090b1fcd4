"""Liveness: whether the engine loop is busy or stuck. A step is allowed time in proportion to its
size, so a long prefill on a slow machine (a minute or more on a small CPU) is busy, not stuck;
one that runs past its allowance, or a loop that starts no step while requests wait, is stuck.
Pure decision logic: the engine thread publishes when its step started and how many tokens it
computes; /health and the shutdown path ask for a verdict."""

from __future__ import annotations

from dataclasses import dataclass

# Seconds per token a step is allowed at least, whatever the engine has learned of its own rate:
# a few times what a small model takes on two busy CPU cores (a larger model on a small CPU pod
# takes more, and teaches the engine so); tens of times what an 8B model takes on one H100.
CPU_SECONDS_PER_TOKEN = 0.05
GPU_SECONDS_PER_TOKEN = 0.001
# A step is allowed this many times the rate of the steps finished lately: a chunk late in a
# long prompt attends to more context (costs more per token) than the chunks before it.
RATE_MARGIN = 4.0
# Steps of fewer tokens teach nothing of the rate: their time is mostly their fixed cost.
RATE_MIN_TOKENS = 64
# The weight of the newest such step in the moving average of the rate.
RATE_WEIGHT = 0.2


def default_seconds_per_token(device_type: str) -> float:
    return CPU_SECONDS_PER_TOKEN if device_type == "cpu" else GPU_SECONDS_PER_TOKEN


class StepRate:
    """Seconds per token of the recent steps of RATE_MIN_TOKENS tokens or more (a moving
    average), so that a machine slower than the default allowance assumes is not called stuck:
    the allowance follows what its own steps take."""

    def __init__(self) -> None:
        self.seconds_per_token = 0.0  # until such a step has finished

    def observe(self, seconds: float, tokens: int) -> None:
        if tokens < RATE_MIN_TOKENS:
            return
        rate = seconds / tokens
        if self.seconds_per_token == 0.0:
            self.seconds_per_token = rate
        else:
            self.seconds_per_token += RATE_WEIGHT * (rate - self.seconds_per_token)


def step_bound(
    tokens: int, stall_timeout: float, seconds_per_token: float, learned_rate: float
) -> float:
    """The seconds a step of `tokens` tokens may run before it counts as stuck: the stall timeout,
    plus each token's allowance (at least `seconds_per_token`, more on a machine whose recent
    steps were slower)."""
    return stall_timeout + tokens * max(seconds_per_token, RATE_MARGIN * learned_rate)


@dataclass(frozen=True, slots=True)
class RunningStep:
    started: float  # time.monotonic() when the step began
    tokens: int  # tokens it computes
    bound: float  # seconds it may run (step_bound)


@dataclass(frozen=True, slots=True)
class Verdict:
    healthy: bool
    reason: str  # what the loop is doing, or why it is stuck


def stall_verdict(
    now: float,
    *,
    step: RunningStep | None,
    last_progress: float,
    waiting: bool,
    stall_timeout: float,
) -> Verdict:
    """Busy or stuck. `step`: the step running now, if any; `last_progress`: when the loop last
    finished a step or found nothing to do; `waiting`: whether requests wait for it."""
    if step is not None:
        running = now - step.started
        what = f"a step of {step.tokens} tokens has run {running:.1f} s"
        if running > step.bound:
            return Verdict(False, f"engine loop is stuck: {what}, past its bound of "
                                  f"{step.bound:.1f} s")  # fmt: skip
        return Verdict(True, f"{what} of its {step.bound:.1f} s bound")
    if not waiting:
        return Verdict(True, "idle")
    idle = now - last_progress
    if idle > stall_timeout:
        return Verdict(False, f"engine loop is not making progress: no step for {idle:.1f} s "
                              f"with requests waiting (bound {stall_timeout:.1f} s)")  # fmt: skip
    return Verdict(True, "between steps")
