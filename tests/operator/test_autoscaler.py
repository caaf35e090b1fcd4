"""The scale decision function: tables of the rules and hypothesis properties."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfleet.operator.autoscaler import (
    CLOCK_SKEW_TOLERANCE_S,
    clamp_future,
    clock_skew_state,
    load_memory,
    policy_of,
    status_update,
)
from kvfleet.operator.forecast import EngineStart
from kvfleet.operator.scaling_policy import (
    Observation,
    PodMetrics,
    Recommendation,
    ScalingMemory,
    ScalingPolicy,
    compact_history,
    decide,
)
from kvfleet.operator.spec import parse_spec

POLICY = ScalingPolicy(
    min_replicas=1,
    max_replicas=10,
    target_queue_depth=8,
    target_kv_cache_usage=0.8,
    scale_down_stabilization_s=300,
    scale_to_zero_delay_s=600,
)


def pods(*loads: float, kv: float = 0.1) -> list[PodMetrics]:
    return [
        PodMetrics(f"p{i}", running=x, waiting=0.0, kv_cache_usage=kv) for i, x in enumerate(loads)
    ]


@pytest.mark.parametrize(
    ("current", "metrics", "expected", "reason_part"),
    [
        (2, pods(8, 8), 2, "requests per replica"),  # on target
        (2, pods(8.5, 8.5), 2, "requests per replica"),  # inside the 10% band
        (2, pods(16, 16), 4, "requests per replica"),  # twice the target
        (2, pods(4, 4, kv=0.95), 3, "KV-cache"),  # KV pressure wins over a light queue
        (1, pods(200), 2, "step limited"),  # +max(4, 1) would be 5; 25 wanted, capped
        (4, pods(100, 100, 100, 100), 8, "step limited"),  # +max(4, 4)
        (9, pods(*[80] * 9), 10, "requests per replica"),  # clamped to max
    ],
)
def test_scale_up_table(current, metrics, expected, reason_part):
    if reason_part == "step limited" and current == 1:
        expected = 5
    d = decide(POLICY, Observation(current, metrics), ScalingMemory(), 1000.0)
    assert d.replicas == expected
    assert reason_part in d.reason


def test_scale_down_waits_for_the_window_then_follows_the_highest_recommendation():
    history: tuple[Recommendation, ...] = ()
    current, t = 4, 0.0
    # Busy at 4 replicas for a while, then the load drops to what 2 replicas carry.
    for _ in range(5):
        d = decide(POLICY, Observation(current, pods(8, 8, 8, 8)), ScalingMemory(history), t)
        history, t = d.memory.history, t + 10
        assert d.replicas == 4
    last_busy = t - 10
    while t < last_busy + 300:
        d = decide(POLICY, Observation(current, pods(4, 4, 4, 4)), ScalingMemory(history, t), t)
        history = d.memory.history
        assert d.replicas == 4, f"scaled down at t={t} inside the window"
        assert "window" in d.reason
        t += 10
    d = decide(POLICY, Observation(current, pods(4, 4, 4, 4)), ScalingMemory(history, t), t)
    assert d.replicas == 2


def test_a_window_shorter_than_the_interval_still_lets_a_scale_down_through():
    # Steps 10 s apart (the operator's default interval), a 5 s scale-down window: each step finds
    # the last one's recommendation already out of the window.
    policy = ScalingPolicy(min_replicas=1, max_replicas=4, target_queue_depth=8,
                           scale_down_stabilization_s=5)  # fmt: skip
    d = decide(policy, Observation(2, pods(8, 8)), ScalingMemory(), 0.0)
    assert d.replicas == 2
    d = decide(policy, Observation(2, pods(1, 1)), ScalingMemory(d.memory.history, 10.0), 10.0)
    assert d.replicas == 1
    # A service with no history at all still keeps its size for one whole window.
    d = decide(policy, Observation(2, pods(1, 1)), ScalingMemory(), 10.0)
    assert d.replicas == 2 and "window" in d.reason


def test_scale_up_follows_the_lowest_recommendation_of_its_window():
    # From the CRD field to the decision: spec.autoscaling.scaleUpStabilizationSeconds.
    spec = parse_spec("llm", {"autoscaling": {"maxReplicas": 10, "targetQueueDepth": 8,
                                              "scaleUpStabilizationSeconds": 60}})  # fmt: skip
    policy = policy_of(spec.autoscaling)
    assert policy.scale_up_stabilization_s == 60
    # On target: 2 is recommended at 0.
    d = decide(policy, Observation(2, pods(8, 8)), ScalingMemory(), 0.0)
    assert d.replicas == 2
    history, t = d.memory.history, 10.0
    # Twice the target asks for 4, but 2 was recommended less than 60 s ago.
    while t < 60:
        d = decide(policy, Observation(2, pods(16, 16)), ScalingMemory(history, t), t)
        history = d.memory.history
        assert d.replicas == 2, f"scaled up at t={t} inside the window"
        assert "scale-up held by the 60s window" in d.reason
        t += 10
    # The 2 of t=0 has left the window: every recommendation inside it is 4.
    d = decide(policy, Observation(2, pods(16, 16)), ScalingMemory(history, t), t)
    assert d.replicas == 4 and "held" not in d.reason
    # A dip inside the window bounds the step: the lowest recommendation wins, not the latest.
    dip = ScalingMemory((Recommendation(0.0, 2), Recommendation(50.0, 3)), 55.0)
    assert decide(policy, Observation(2, pods(16, 16)), dip, 70.0).replicas == 3
    # Without a window (the default), the same load scales up at once.
    assert policy_of(parse_spec("llm", {}).autoscaling).scale_up_stabilization_s == 0
    assert decide(POLICY, Observation(2, pods(16, 16)), dip, 70.0).replicas == 4


def test_scale_to_zero_only_after_the_idle_delay_and_back_on_held_requests():
    policy = ScalingPolicy(min_replicas=0, max_replicas=3, scale_down_stabilization_s=0,
                           scale_to_zero_delay_s=600)  # fmt: skip
    d = decide(policy, Observation(1, pods(0, kv=0.0)), ScalingMemory(last_active=0.0), 599.0)
    assert d.replicas == 1 and "idle" in d.reason
    d = decide(policy, Observation(1, pods(0, kv=0.0)), ScalingMemory(d.memory.history, 0.0), 601.0)
    assert d.replicas == 0
    d = decide(policy, Observation(0, []), ScalingMemory(d.memory.history, 0.0), 700.0)
    assert d.replicas == 0
    d = decide(
        policy, Observation(0, [], held_requests=3), ScalingMemory(d.memory.history, 0.0), 710.0
    )
    assert d.replicas == 1 and "held" in d.reason and d.memory.last_active == 710.0


def test_a_silent_pod_never_causes_a_scale_down():
    silent = [*pods(0, 0), PodMetrics("p2")]
    policy = ScalingPolicy(min_replicas=1, max_replicas=5, scale_down_stabilization_s=0)
    d = decide(policy, Observation(3, silent), ScalingMemory(), 10.0)
    assert d.replicas == 3 and d.unanswered == ("p2",)
    none_answered = Observation(3, [PodMetrics("a"), PodMetrics("b")])
    assert decide(policy, none_answered, ScalingMemory(), 10.0).replicas == 3


def test_restart_keeps_the_window_through_the_persisted_history():
    d1 = decide(POLICY, Observation(4, pods(8, 8, 8, 8)), ScalingMemory(), 0.0)
    persisted = tuple(Recommendation(r.time, r.replicas) for r in d1.memory.history)
    d2 = decide(POLICY, Observation(4, pods(0, 0, 0, 0)), ScalingMemory(persisted, 0.0), 60.0)
    assert d2.replicas == 4


# -- properties ----------------------------------------------------------------------------

policies = st.builds(
    lambda lo, span, q, kv, down, up: ScalingPolicy(
        min_replicas=lo,
        max_replicas=max(lo + span, 1),
        target_queue_depth=q,
        target_kv_cache_usage=kv,
        scale_down_stabilization_s=down,
        scale_up_stabilization_s=up,
    ),
    st.integers(0, 5),
    st.integers(0, 10),
    st.floats(0.5, 64),
    st.floats(0.1, 1.0),
    st.sampled_from([0.0, 60.0, 300.0]),
    st.sampled_from([0.0, 30.0]),
)
loads = st.lists(st.floats(0, 500, allow_nan=False), min_size=0, max_size=12)


@settings(max_examples=300, deadline=None)
@given(policies, st.integers(0, 16), loads, st.floats(0, 1), st.floats(0, 20))
def test_result_is_always_within_bounds(policy, current, load, kv, held):
    d = decide(
        policy,
        Observation(current, pods(*load, kv=kv), held_requests=held),
        ScalingMemory(),
        1000.0,
    )
    assert policy.min_replicas <= d.replicas <= policy.max_replicas


@settings(max_examples=300, deadline=None)
@given(policies, st.integers(1, 16), loads, st.floats(0, 50), st.floats(0, 1))
def test_monotonic_in_load(policy, current, load, extra, kv):
    base = pods(*load, kv=kv) if load else pods(0.0, kv=kv)
    more = [PodMetrics(p.pod, (p.running or 0) + extra, p.waiting, kv) for p in base]
    d_low = decide(policy, Observation(current, base), ScalingMemory(last_active=0.0), 1000.0)
    d_high = decide(policy, Observation(current, more), ScalingMemory(last_active=0.0), 1000.0)
    assert d_high.replicas >= d_low.replicas


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 8), st.lists(st.floats(-0.09, 0.09), min_size=20, max_size=60))
def test_noise_inside_the_tolerance_never_flaps(current, noise):
    history: tuple[Recommendation, ...] = ()
    for i, eps in enumerate(noise):
        per_pod = POLICY.target_queue_depth * (1 + eps)
        d = decide(
            POLICY,
            Observation(current, pods(*[per_pod] * current)),
            ScalingMemory(history, float(i)),
            float(i * 10),
        )
        history = d.memory.history
        assert d.replicas == current


@settings(max_examples=200, deadline=None)
@given(policies, st.integers(1, 12), st.integers(0, 12), loads)
def test_never_below_a_recommendation_inside_the_down_window(policy, current, earlier, load):
    earlier = min(max(earlier, policy.min_replicas), policy.max_replicas)
    history = (Recommendation(990.0, earlier),)
    d = decide(
        policy,
        Observation(current, pods(*load) if load else pods(0.0)),
        ScalingMemory(history, 999.0),
        1000.0,
    )
    if policy.scale_down_stabilization_s > 10 and d.replicas < current:
        assert d.replicas >= min(earlier, current)


def test_starting_replicas_count_as_idle_going_up_and_hold_going_down():
    policy = ScalingPolicy(min_replicas=1, max_replicas=20, target_queue_depth=8,
                           scale_down_stabilization_s=0)  # fmt: skip
    # 5 asked for, 1 ready with 40 in flight: once all 5 are up that is 8 each, on target.
    assert decide(policy, Observation(5, pods(40), starting=4), ScalingMemory(), 10.0).replicas == 5
    # Without knowing about the starting ones, it would climb as if one replica carried it all.
    assert decide(policy, Observation(5, pods(40)), ScalingMemory(), 10.0).replicas == 10
    d = decide(policy, Observation(5, pods(0), starting=4), ScalingMemory(), 10.0)
    assert d.replicas == 5 and "starting" in d.reason


def test_history_keeps_the_latest_entry_of_each_count():
    h = (Recommendation(0, 3), Recommendation(5, 4), Recommendation(9, 3), Recommendation(12, 2))
    assert compact_history(h) == (Recommendation(5, 4), Recommendation(9, 3), Recommendation(12, 2))
    history: tuple[Recommendation, ...] = ()
    for t in range(200):
        history = decide(
            POLICY, Observation(3, pods(8, 8, 8)), ScalingMemory(history), float(t)
        ).memory.history
    assert len(history) == 1


histories = st.lists(st.tuples(st.floats(0, 400), st.integers(0, 12)), min_size=0, max_size=30).map(
    lambda xs: tuple(Recommendation(t, n) for t, n in sorted(xs))
)


@settings(max_examples=300, deadline=None)
@given(policies, st.integers(0, 12), histories, loads, st.integers(0, 3))
def test_compaction_never_changes_a_decision(policy, current, history, load, starting):
    metrics = pods(*load) if load else pods(0.0)
    full = decide(
        policy,
        Observation(current, metrics, starting=starting),
        ScalingMemory(history, 100.0),
        400.0,
    )
    compact = decide(
        policy,
        Observation(current, metrics, starting=starting),
        ScalingMemory(compact_history(history), 100.0),
        400.0,
    )
    assert (full.replicas, full.reason) == (compact.replicas, compact.reason)
    assert full.memory.history == compact.memory.history


readings = st.floats(allow_nan=True, allow_infinity=True)


@settings(max_examples=300, deadline=None)
@given(policies, st.integers(0, 16), st.lists(st.tuples(readings, readings, readings), max_size=6),
       readings)  # fmt: skip
def test_any_reading_at_all_gives_a_decision_within_bounds(policy, current, raw, held):
    metrics = [PodMetrics(f"p{i}", r, w, kv) for i, (r, w, kv) in enumerate(raw)]
    d = decide(policy, Observation(current, metrics, held_requests=held), ScalingMemory(), 1000.0)
    assert policy.min_replicas <= d.replicas <= policy.max_replicas
    assert all(math.isfinite(v) for v in d.signals.values())
    assert set(d.unanswered) == set(d.problems) == {p.pod for p in metrics if not p.answered}


# -- times from the future in the memory read back ---------------------------------------------

T0 = 1_750_000_000.0
HOUR = 3600.0


def test_a_recommendation_from_the_future_holds_only_one_window_from_now():
    # Four replicas recommended "an hour from now" (a skewed clock, or a status written by
    # hand), then idle: the scale-down window of 300 s counts from now, not from then.
    future = ScalingMemory((Recommendation(T0 + HOUR, 4),), T0)
    memory, _, ahead = clamp_future(future, (), now=T0)
    assert memory.history == (Recommendation(T0, 4),) and set(ahead) == {"recommendations"}
    assert ahead["recommendations"] == pytest.approx(HOUR)
    idle = pods(0.5, 0.5, 0.5, 0.5)
    d = decide(POLICY, Observation(4, idle), memory, T0 + 290)
    assert d.replicas == 4 and "window" in d.reason
    d = decide(POLICY, Observation(4, idle), d.memory, T0 + 310)
    assert d.replicas == 1


def test_a_future_last_active_time_does_not_delay_scale_to_zero():
    policy = ScalingPolicy(min_replicas=0, max_replicas=2, scale_down_stabilization_s=60,
                           scale_to_zero_delay_s=600)  # fmt: skip
    memory, _, ahead = clamp_future(ScalingMemory(last_active=T0 + HOUR), (), now=T0)
    assert memory.last_active == T0 and set(ahead) == {"lastActiveTime"}
    idle = pods(0, kv=0.0)
    d = decide(policy, Observation(1, idle), memory, T0 + 590)
    assert d.replicas == 1 and "idle for 590s" in d.reason
    # Zero once the idle delay has passed and the last "1" left the 60 s window.
    d = decide(policy, Observation(1, idle), d.memory, T0 + 620)
    d = decide(policy, Observation(1, idle), d.memory, T0 + 660)
    assert d.replicas == 0 and "no work for 600s" in d.reason


def test_engine_starts_from_the_future_are_clamped_and_past_times_kept():
    starts = (EngineStart(T0 - 100, 20.0), EngineStart(T0 + HOUR, 30.0))
    history = (Recommendation(T0 - 50, 2), Recommendation(T0 - 10, 3))
    memory, clamped, ahead = clamp_future(ScalingMemory(history, T0 - 5), starts, now=T0)
    assert memory == ScalingMemory(history, T0 - 5)
    assert clamped == (EngineStart(T0 - 100, 20.0), EngineStart(T0, 30.0))
    assert set(ahead) == {"engineStarts"}


def test_skew_within_the_tolerance_is_clamped_without_a_report():
    small = CLOCK_SKEW_TOLERANCE_S / 2
    memory, _, ahead = clamp_future(
        ScalingMemory((Recommendation(T0 + small, 2),), T0 + small), (), now=T0
    )
    assert memory == ScalingMemory((Recommendation(T0, 2),), T0) and ahead == {}


def test_clamped_memory_is_rewritten_and_its_report_names_the_fields():
    state = {"recommendations": [[T0, 2]], "unreachablePods": [],
             "lastActiveTime": "2025-06-15T16:06:40Z"}  # fmt: skip
    old = {"desiredReplicas": 2, "autoscaling": state}
    memory, _, ahead = clamp_future(load_memory(old), (), now=T0 + 10)
    assert memory.last_active == T0 + 10 and set(ahead) == {"lastActiveTime"}
    d = decide(POLICY, Observation(2, pods(8, 8)), memory, T0 + 10)
    # Same content, written 10 s ago: only the rewrite replaces the time from the future.
    assert status_update(old, 2, d, {}, T0 + 10) == {}
    patch = status_update(old, 2, d, {}, T0 + 10, rewrite=True)
    assert patch["autoscaling"]["lastActiveTime"] == "2025-06-15T15:06:50Z"
    # Recommendations from the future make the state stale by themselves.
    future = {
        "desiredReplicas": 2,
        "autoscaling": {"recommendations": [[T0 + HOUR, 2]], "unreachablePods": []},
    }
    assert status_update(future, 2, d, {}, T0 + 10)["autoscaling"]["recommendations"] == [
        [T0 + 10, 2]
    ]
    skew = clock_skew_state({"recommendations": HOUR, "lastActiveTime": 3590.0}, T0)
    assert skew["reason"] == "ClockSkew"
    assert "lastActiveTime 3590s, recommendations 3600s" in skew["message"]
    assert skew["time"] == "2025-06-15T15:06:40Z"
