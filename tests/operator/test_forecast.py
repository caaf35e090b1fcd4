"""Scaling ahead by the engine start time: the start time learned from the pods, the trend of
the requests in flight, and what the decision makes of them (operator/forecast.py,
scaling_policy.decide), without a cluster."""

from __future__ import annotations

import datetime
from pathlib import Path

import pytest
import yaml
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kvfleet.operator.autoscaler import load_starts, policy_of, status_update
from kvfleet.operator.forecast import (
    CYCLE_S,
    MAX_START_S,
    MIN_SAMPLE_GAP_S,
    MIN_SPAN_S,
    START_SAMPLES,
    WINDOW_S,
    EngineStart,
    Sample,
    cycle_top,
    learn,
    pod_start,
    projection,
    remember,
    start_estimate,
)
from kvfleet.operator.scaling_policy import (
    Observation,
    PodMetrics,
    Recommendation,
    ScalingMemory,
    ScalingPolicy,
    decide,
)
from kvfleet.operator.spec import parse_spec

T0 = 1_750_000_000.0
ROOT = Path(__file__).resolve().parents[2]


def rfc3339(seconds: float) -> str:
    return datetime.datetime.fromtimestamp(seconds, datetime.UTC).isoformat()


def pod(uid: str, created: float, ready: float | None, restarts: int = 0) -> dict:
    conditions = [{"type": "PodScheduled", "status": "True"}]
    if ready is not None:
        conditions.append({"type": "Ready", "status": "True", "lastTransitionTime": rfc3339(ready)})
    return {
        "metadata": {
            "name": f"llm-engine-{uid}",
            "uid": uid,
            "creationTimestamp": rfc3339(created),
        },
        "status": {
            "conditions": conditions,
            "containerStatuses": [{"name": "engine", "restartCount": restarts}],
        },
    }


# -- the start time ----------------------------------------------------------------------------


def test_a_start_is_creation_to_first_ready_and_only_of_a_clean_start():
    assert pod_start(pod("a", T0, T0 + 17.5)) == EngineStart(T0 + 17.5, 17.5)
    assert pod_start(pod("a", T0, None)) is None  # never Ready: no start to learn
    assert pod_start(pod("a", T0, T0 + 90, restarts=1)) is None  # its crash would count
    assert pod_start(pod("a", T0, T0 - 5)) is None  # clock skew
    assert pod_start(pod("a", T0, T0 + 7200)).seconds == MAX_START_S  # Pending for hours
    assert pod_start({"metadata": {}, "status": {}}) is None
    broken = pod("a", T0, T0 + 1)
    broken["metadata"]["creationTimestamp"] = "yesterday"
    assert pod_start(broken) is None
    unready = pod("a", T0, T0 + 1)
    unready["status"]["conditions"][-1]["status"] = "False"
    assert pod_start(unready) is None


def test_each_pod_counts_once_also_after_an_operator_restart():
    pods = [pod("a", T0, T0 + 20), pod("b", T0, T0 + 22), pod("c", T0 + 100, None)]
    starts, seen = learn((), pods, None)
    assert [s.seconds for s in starts] == [20, 22] and seen == {"a", "b"}
    assert learn(starts, pods, seen) == (starts, seen)
    # Pod a turns Ready again after a spell unready: its first start was counted already.
    pods[0] = pod("a", T0, T0 + 500)
    assert learn(starts, pods, seen)[0] == starts
    # Within a process, a pod Ready in the same second as the newest start still counts.
    pods.append(pod("d", T0 + 2, T0 + 22))
    assert [s.seconds for s in learn(starts, pods, seen)[0]] == [20, 22, 20]
    # A restarted operator has seen nothing, but knows the newest start it counted.
    pods = [pod("a", T0, T0 + 20), pod("b", T0, T0 + 22), pod("c", T0 + 100, T0 + 130)]
    again, seen = learn(starts, pods, None)
    assert [s.seconds for s in again] == [20, 22, 30]
    # Pods gone are forgotten.
    assert learn(again, pods[2:], seen)[1] == {"c"}


def test_the_estimate_is_the_median_of_the_last_few_so_one_odd_start_does_not_move_it():
    pods = [pod(str(i), T0 + i, T0 + i + 18 + i % 3) for i in range(8)]
    pods.append(pod("slow", T0 + 9, T0 + 9 + 1000))
    starts, _ = learn((), pods, None)
    assert len(starts) == START_SAMPLES and starts[-1].seconds == 1000
    assert start_estimate(starts) == 19
    assert start_estimate(()) is None


# -- the trend --------------------------------------------------------------------------------


def ramp(slope: float, base: float = 4.0, every: float = 5.0, n: int = 7) -> tuple[Sample, ...]:
    return tuple(Sample(T0 + i * every, base + slope * i * every) for i in range(n))


def test_a_steady_rise_projects_one_horizon_ahead():
    samples = ramp(0.2)
    now = samples[-1].time
    p = projection(samples, now, horizon=20, max_rise=100)
    assert p is not None
    assert p.slope == pytest.approx(0.2) and p.value == pytest.approx(10.0)
    assert p.projected == pytest.approx(14.0)
    # The rise is capped by the caller.
    assert projection(samples, now, 20, max_rise=1.5).projected == pytest.approx(11.5)


@pytest.mark.parametrize(
    "samples, why",
    [
        (ramp(0.0), "flat"),
        (ramp(-0.2), "falling"),
        (ramp(0.2, n=3), "too few samples"),
        (ramp(0.2, every=1.0, n=10), "too short a span"),
        (tuple(Sample(T0 + 5 * i, v) for i, v in enumerate([4, 9, 3, 8, 4, 10, 5])), "noise"),
    ],
)
def test_no_projection_without_a_significant_rise(samples, why):
    assert projection(samples, samples[-1].time, 20, 100) is None, why


def test_samples_older_than_the_window_do_not_count():
    # A rise long ago, flat since.
    old = ramp(1.0, n=5)
    flat = tuple(Sample(T0 + 200 + 5 * i, 24.0) for i in range(8))
    assert projection(old + flat, flat[-1].time, 20, 100) is None


def test_a_step_that_levelled_off_is_no_trend():
    # A line through a step rises for a window after it, but the load no longer does once it
    # has held its level for MIN_SPAN_S.
    step = series([4] * 5 + [12] * 4)
    assert projection(step, step[-1].time, 20, 100) is None
    assert projection(step[:-1], step[-2].time, 20, 100) is not None  # 10 s after: not yet
    # A ramp that stopped a sample ago still rises over the last MIN_SPAN_S; one that stopped
    # MIN_SPAN_S ago does not.
    assert projection(series([4, 5, 6, 7, 8, 8]), T0 + 25, 20, 100) is not None
    assert projection(series([4, 5, 6, 7, 8, 8, 8, 8]), T0 + 35, 20, 100) is None


# -- the load's cycle --------------------------------------------------------------------------


def series(values, every: float = 5.0, start: float = T0) -> tuple[Sample, ...]:
    return tuple(Sample(start + i * every, float(v)) for i, v in enumerate(values))


def test_a_cycles_top_is_the_highest_level_the_load_fell_from_by_more_than_a_fall():
    assert cycle_top(series([4, 8, 12, 4, 6, 9]), 1.0) == 12
    assert cycle_top(series([4, 12, 4, 10, 7, 9]), 1.0) == 12  # 10 fell too, 12 is higher
    assert cycle_top(series([4, 8, 12, 13]), 0.0) is None  # never fell
    assert cycle_top(series([4, 8, 12, 11.5, 13]), 1.0) is None  # by no more than the noise
    assert cycle_top((), 1.0) is None


def test_the_memory_keeps_a_cycle_at_most_one_sample_a_second():
    samples: tuple[Sample, ...] = ()
    for i in range(300):
        samples = remember(samples, Sample(T0 + 5 * i, i))
    assert samples[-1].time - samples[0].time == CYCLE_S and len(samples) == CYCLE_S / 5 + 1
    # Decisions closer together than MIN_SAMPLE_GAP_S (a clock that did not move) weigh as one,
    # the newest value kept.
    now = samples[-1].time
    assert remember(samples, Sample(now, 7.0)) == (*samples[:-1], Sample(now, 7.0))
    soon = Sample(now + MIN_SAMPLE_GAP_S / 2, 8.0)
    assert remember(samples, soon) == (*samples[1:-1], soon)  # the oldest one out of memory
    later = Sample(now + MIN_SAMPLE_GAP_S, 9.0)
    assert remember(samples, later) == (*samples[1:], later)


# A sawtooth sampled every 5 s: from 4 up to 12 over 40 s, back to 4, then up again at 0.1/s
# (to 15), so that the second rise fills a whole window.
FIRST = series([4, 5, 6, 7, 8, 9, 10, 11, 12])
AGAIN = series([4 + 0.5 * i for i in range(23)], start=FIRST[-1].time + 5)


def saw(until: float) -> tuple[Sample, ...]:
    """The sawtooth's samples until the second rise reaches `until`."""
    return FIRST + tuple(s for s in AGAIN if s.value <= until)


def test_a_rise_back_towards_a_top_the_load_fell_from_projects_nothing():
    samples = saw(11)
    now = samples[-1].time
    # The window alone (the last minute, all of it after the fall) is as steady as a ramp.
    window = tuple(s for s in samples if now - s.time <= WINDOW_S)
    assert window[0].time > FIRST[-1].time
    assert projection(window, now, 20, 100) is not None
    assert projection(samples, now, 20, 100) is None
    assert projection(saw(12), now + 10, 20, 100) is None  # at the top again


def test_past_the_top_a_rise_projects_as_far_again_until_it_is_a_horizons_rise_beyond():
    # Rising 0.1/s, 2 in 20 s. Half a request past the top of 12: half a request more at most.
    samples = saw(12.5)
    p = projection(samples, samples[-1].time, 20, 100)
    assert p is not None and (p.value, p.projected, p.top) == (12.5, 13.0, 12.0)
    # Three past it: as far again would be more than the trend's own 2, which stands.
    samples = saw(15)
    p = projection(samples, samples[-1].time, 20, 100)
    assert p is not None and p.top is None and p.projected == pytest.approx(17.0)


def test_a_top_older_than_the_cycle_memory_does_not_count():
    late = tuple(Sample(s.time + CYCLE_S, s.value) for s in AGAIN if s.value <= 11)
    assert late[-1].time - FIRST[-1].time > CYCLE_S
    assert projection(FIRST + late, late[-1].time, 20, 100) is not None


# -- the decision ------------------------------------------------------------------------------

AHEAD = ScalingPolicy(min_replicas=1, max_replicas=8, target_queue_depth=4, scale_ahead=True)
PLAIN = ScalingPolicy(min_replicas=1, max_replicas=8, target_queue_depth=4)


def engines(n: int, in_flight: float) -> list[PodMetrics]:
    return [PodMetrics(f"p{i}", in_flight / n, 0.0, 0.1) for i in range(n)]


def first_scale_up(policy: ScalingPolicy, load, every: float, start: float | None) -> float:
    """When a load rising from T0 first makes a decision scale past one replica."""
    samples: tuple[Sample, ...] = ()
    for i in range(1000):
        now = T0 + i * every
        seen = Observation(1, engines(1, load(now - T0)), start_seconds=start)
        d = decide(policy, seen, ScalingMemory(load=samples), now)
        if d.replicas > 1:
            return now - T0
        samples = d.memory.load
    raise AssertionError("never scaled up")


def test_a_steady_ramp_scales_up_one_start_time_earlier_and_says_why():
    def load(t: float) -> float:
        return 1 + 0.1 * t

    # Without the forecast: 4.4 in flight (target 4, 10% tolerance) at t = 34 s, seen at 35.
    assert first_scale_up(PLAIN, load, 5.0, 20.0) == 35
    assert first_scale_up(AHEAD, load, 5.0, None) == 35  # no start time learned yet
    # With it: 4.4 projected 20 s (the start time) ahead at t = 14 s, seen at 15.
    assert first_scale_up(AHEAD, load, 5.0, 20.0) == 15
    samples = tuple(Sample(T0 + t, load(t)) for t in (0, 5, 10))
    d = decide(
        AHEAD,
        Observation(1, engines(1, load(15)), start_seconds=20),
        ScalingMemory(load=samples),
        T0 + 15,
    )
    assert (d.replicas, d.signal) == (2, "forecast")
    assert d.reason.startswith("forecast: 2.50 requests in flight rising 0.1/s, 4.50 in 20s")
    assert d.signals["forecast_horizon"] == 20
    assert d.signals["forecast_in_flight"] == pytest.approx(4.5)


@settings(max_examples=60, deadline=None)
@given(
    start=st.floats(5.0, 300.0),
    every=st.sampled_from([1.0, 2.0, 5.0, 10.0]),
    lead=st.floats(0.0, 200.0),
    share=st.floats(0.1, 1.0),
)
def test_a_ramp_scales_up_earlier_by_about_slope_times_start_time(start, every, lead, share):
    # A ramp whose projection crosses the threshold (4.4 in flight: target 4, 10% tolerance)
    # `lead` seconds after the first sample, with enough history by then to trust the trend,
    # and whose rise in one start time is within the cap (the capacity: 4 per replica).
    lead += max(MIN_SPAN_S, 3 * every) + every
    slope = 4.4 * share / (lead + start)
    assume(slope * start <= 4)

    def load(t: float) -> float:
        return 4.4 * (1 - share) + slope * t

    plain = first_scale_up(PLAIN, load, every, start)
    ahead = first_scale_up(AHEAD, load, every, start)
    assert plain - ahead == pytest.approx(start, abs=every + 1e-6)


loads = st.lists(st.floats(0.0, 200.0), min_size=1, max_size=15)


@settings(max_examples=200, deadline=None)
@given(
    values=loads,
    every=st.sampled_from([1.0, 2.0, 5.0, 10.0]),
    current=st.integers(1, 8),
    start=st.floats(1.0, 600.0),
    starting=st.integers(0, 2),
)
def test_the_forecast_never_lowers_a_decision_nor_passes_max_replicas(
    values, every, current, start, starting
):
    samples = tuple(Sample(T0 + i * every, v) for i, v in enumerate(values[:-1]))
    now = T0 + (len(values) - 1) * every
    ready = max(1, current - starting)
    seen = Observation(
        current, engines(ready, values[-1]), starting=current - ready, start_seconds=start
    )
    plain = decide(PLAIN, seen, ScalingMemory(load=samples), now)
    ahead = decide(AHEAD, seen, ScalingMemory(load=samples), now)
    assert plain.replicas <= ahead.replicas <= AHEAD.max_replicas
    if ahead.replicas != plain.replicas:
        assert ahead.signal == "forecast" and ahead.replicas > plain.replicas


@settings(max_examples=200, deadline=None)
@given(values=loads, every=st.sampled_from([1.0, 5.0]), current=st.integers(1, 8))
def test_a_flat_or_falling_load_adds_nothing(values, every, current):
    values = sorted(values, reverse=True)
    samples = tuple(Sample(T0 + i * every, v) for i, v in enumerate(values[:-1]))
    now = T0 + (len(values) - 1) * every
    seen = Observation(current, engines(current, values[-1]), start_seconds=60)
    plain = decide(PLAIN, seen, ScalingMemory(load=samples), now)
    ahead = decide(AHEAD, seen, ScalingMemory(load=samples), now)
    assert (ahead.replicas, ahead.reason, ahead.signal) == (
        plain.replicas,
        plain.reason,
        plain.signal,
    )


@settings(max_examples=200, deadline=None)
@given(
    rise=st.lists(st.floats(0.0, 1.0), min_size=4, max_size=13),
    top=st.floats(1.0, 200.0),
    ago=st.floats(0.0, CYCLE_S - WINDOW_S - 15),
    current=st.integers(1, 8),
)
def test_a_load_rising_back_towards_a_level_it_fell_from_gets_nothing_from_the_forecast(
    rise, top, ago, current
):
    # Any rise in the last minute, however steady, below half a level the load reached before
    # it and fell from (so the fall is more than three times the spread of anything in the
    # window about its line).
    now = T0 + 1000
    window = [Sample(now - 5 * i, top / 2 * v) for i, v in enumerate(sorted(rise, reverse=True))]
    then = now - WINDOW_S - 10 - ago
    samples = (Sample(then, top), Sample(then + 5, 0.0), *reversed(window))
    seen = Observation(current, engines(current, samples[-1].value), start_seconds=60)
    plain = decide(PLAIN, seen, ScalingMemory(load=samples[:-1]), now)
    ahead = decide(AHEAD, seen, ScalingMemory(load=samples[:-1]), now)
    assert (ahead.replicas, ahead.signal) == (plain.replicas, plain.signal)
    assert "forecast_slope" not in ahead.signals


def test_the_forecast_keeps_to_the_scale_up_window_and_step():
    samples = tuple(Sample(T0 + t, 1 + 0.1 * t) for t in (0, 5, 10))
    windowed = ScalingPolicy(max_replicas=8, target_queue_depth=4, scale_ahead=True,
                             scale_up_stabilization_s=60)  # fmt: skip
    # The service was at 1 replica within the window: the forecast's 2 waits, as any signal.
    seen = Observation(1, engines(1, 2.5), start_seconds=20)
    d = decide(windowed, seen, ScalingMemory((Recommendation(T0, 1),), load=samples), T0 + 15)
    assert d.replicas == 1 and "scale-up held" in d.reason and d.signal == "forecast"
    # A steep rise projected far ahead is capped (at double the capacity), and so is the step.
    steep = tuple(Sample(T0 + t, 1 + 10 * t) for t in (0, 5, 10))
    d = decide(
        AHEAD,
        Observation(1, engines(1, 151), start_seconds=600),
        ScalingMemory(load=steep),
        T0 + 15,
    )
    assert d.signals["forecast_in_flight"] == pytest.approx(302)
    assert d.replicas == 5  # queue depth asks for 38 -> at most 1 + 4 per step anyway


def test_a_forecast_the_cycle_held_back_says_so_and_the_decision_keeps_the_cycle():
    # One request past the top of 12 the load fell from: 14 projected, not the trend's 15.
    samples = saw(13)
    now, before = samples[-1].time, ScalingMemory(load=samples[:-1])
    d = decide(AHEAD, Observation(3, engines(3, 13), start_seconds=20), before, now)
    assert (d.replicas, d.signal) == (4, "forecast")
    assert d.reason == (
        "forecast: 13.00 requests in flight rising 0.1/s, 14.00 in 20s (the engine start time; "
        "no further past 12.00, the top the load fell from, than it is now), target 4 per replica"
    )
    # The next decision gets the whole cycle back, not just the trend's window.
    assert d.memory.load == samples and samples[-1].time - samples[0].time > WINDOW_S


def test_replicas_still_starting_hold_the_forecast():
    samples = tuple(Sample(T0 + t, 1 + 0.1 * t) for t in (0, 5, 10))
    seen = Observation(2, engines(1, 2.5), starting=1, start_seconds=20)
    d = decide(AHEAD, seen, ScalingMemory(load=samples), T0 + 15)
    assert d.replicas == 2 and d.signal != "forecast"
    assert "forecast_slope" in d.signals  # still reported


# -- spec and status --------------------------------------------------------------------------


def test_scale_ahead_is_on_by_default_and_can_be_turned_off():
    assert policy_of(parse_spec("llm", {}).autoscaling).scale_ahead is True
    off = parse_spec("llm", {"autoscaling": {"scaleAhead": False}})
    assert policy_of(off.autoscaling).scale_ahead is False
    with pytest.raises(ValueError, match="scaleAhead"):
        parse_spec("llm", {"autoscaling": {"scaleAhead": "sometimes"}})


def test_the_learned_start_time_is_persisted_when_learned_and_read_back():
    starts = (EngineStart(T0 - 100, 18.0), EngineStart(T0 - 50, 22.0))
    d = decide(AHEAD, Observation(1, engines(1, 1.0)), ScalingMemory(), T0)
    status = {"desiredReplicas": 1}
    patch = status_update(status, 1, d, {}, T0, starts)
    assert patch["autoscaling"]["engineStarts"] == [[T0 - 100, 18.0], [T0 - 50, 22.0]]
    assert patch["autoscaling"]["engineStartSeconds"] == 20.0
    assert load_starts(patch) == starts
    status |= patch
    # Unchanged: no write. A new start: written at once, though nothing else changed.
    assert status_update(status, 1, d, {}, T0 + 10, starts) == {}
    more = (*starts, EngineStart(T0 + 5, 30.0))
    assert (
        status_update(status, 1, d, {}, T0 + 10, more)["autoscaling"]["engineStartSeconds"] == 22.0
    )


def test_a_forecast_decision_names_its_signal_and_metrics_in_status():
    samples = tuple(Sample(T0 + t, 1 + 0.1 * t) for t in (0, 5, 10))
    d = decide(
        AHEAD,
        Observation(1, engines(1, 2.5), start_seconds=20),
        ScalingMemory(load=samples),
        T0 + 15,
    )
    last = status_update({}, 1, d, {}, T0 + 15)["lastScaleDecision"]
    assert last["signal"] == "forecast"
    assert last["metrics"]["forecastHorizonSeconds"] == 20
    assert last["metrics"]["forecastSlope"] == pytest.approx(0.1)
    assert last["metrics"]["forecastInFlight"] == pytest.approx(4.5)


def test_the_crd_holds_what_the_autoscaler_writes():
    crd = yaml.safe_load((ROOT / "crds" / "inferenceservices.kvfleet.dev.yaml").read_text())
    status = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]
    memory = status["properties"]["autoscaling"]["properties"]
    assert memory["engineStarts"]["maxItems"] == START_SAMPLES
    assert f"capped at {MAX_START_S:g}" in memory["engineStarts"]["description"]
    decision = status["properties"]["lastScaleDecision"]["properties"]
    assert "forecast" in decision["signal"]["enum"]
    for name in ("forecastSlope", "forecastHorizonSeconds", "forecastInFlight"):
        assert name in decision["metrics"]["description"]
