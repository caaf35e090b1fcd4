"""The optional latency signal: a quantile of the service over the last interval, from the
engines' cumulative histograms, beside queue depth and KV-cache usage; the decision names the
signal that set the count."""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from kvfleet.operator.autoscaler import policy_of, status_update
from kvfleet.operator.latency import interval, merge, quantile, service_quantile
from kvfleet.operator.metrics_scraper import histogram_buckets
from kvfleet.operator.scaling_policy import (
    Observation,
    PodMetrics,
    ScalingMemory,
    ScalingPolicy,
    decide,
)
from kvfleet.operator.spec import parse_spec
from kvfleet.telemetry.metrics_reader import parse_samples

TTFT = "vllm:time_to_first_token_seconds"
INF = math.inf
T0 = 1_750_000_000.0


def test_the_quantile_interpolates_within_its_bucket_as_prometheus_does():
    buckets = ((0.1, 10.0), (0.5, 50.0), (1.0, 90.0), (INF, 100.0))
    # Rank 90 of 100 is the last of the (0.5, 1.0] bucket.
    assert quantile(0.9, buckets) == pytest.approx(1.0)
    # Rank 50: the top of (0.1, 0.5].
    assert quantile(0.5, buckets) == pytest.approx(0.5)
    # Rank 30: halfway through (0.1, 0.5].
    assert quantile(0.3, buckets) == pytest.approx(0.3)
    # Rank 95 lies in +Inf: the highest finite bound.
    assert quantile(0.95, buckets) == 1.0
    assert quantile(0.9, ((0.1, 0.0), (INF, 0.0))) is None


def test_an_interval_needs_two_scrapes_of_one_engine_life():
    before = ((0.1, 5.0), (1.0, 8.0), (INF, 9.0))
    after = ((0.1, 5.0), (1.0, 18.0), (INF, 19.0))
    assert interval(None, after) is None  # first look
    assert interval(before, after) == ((0.1, 0.0), (1.0, 10.0), (INF, 10.0))
    assert interval(after, before) is None  # counts went down: the engine restarted
    assert interval(before, ((0.5, 9.0), (INF, 9.0))) is None  # other buckets
    # Counts that fall from one bucket to the next are no histogram: a hostile or broken pod.
    assert interval(before, ((0.1, 5.0), (1.0, 900.0), (INF, 19.0))) is None


def test_pods_are_summed_and_only_the_common_bucket_layout_counts():
    a = ((0.1, 1.0), (INF, 2.0))
    b = ((0.1, 3.0), (INF, 3.0))
    odd = ((0.2, 100.0), (INF, 100.0))
    assert merge([a, b, odd]) == ((0.1, 4.0), (INF, 5.0))
    assert merge([]) is None


def test_the_service_quantile_covers_the_last_interval_only():
    # Slow requests long ago, fast ones in the interval: the interval's p90 is fast.
    previous = {"a": ((0.1, 0.0), (2.0, 100.0), (INF, 100.0))}
    current = {
        "a": ((0.1, 50.0), (2.0, 100.0), (INF, 100.0)),  # restarted: left out
        "b": ((0.1, 10.0), (2.0, 10.0), (INF, 10.0)),  # first look: left out
    }
    assert service_quantile(0.9, previous, current) is None
    current = {"a": ((0.1, 50.0), (2.0, 150.0), (INF, 150.0))}
    previous["a"] = ((0.1, 0.0), (2.0, 100.0), (INF, 100.0))
    assert service_quantile(0.9, previous, current) == pytest.approx(0.09)


def test_buckets_are_read_from_a_real_exposition_summed_over_models():
    registry = CollectorRegistry()
    h = Histogram(TTFT.replace(":", "_"), "ttft", ["model_name"], buckets=(0.1, 1.0),
                  registry=registry)  # fmt: skip
    for model, seconds in (("a", 0.05), ("a", 0.5), ("b", 5.0)):
        h.labels(model).observe(seconds)
    text = generate_latest(registry).decode().replace(TTFT.replace(":", "_"), TTFT)
    values = parse_samples(text.splitlines(), (f"{TTFT}_bucket",))
    assert histogram_buckets(values, TTFT) == ((0.1, 1.0), (1.0, 2.0), (INF, 3.0))
    assert histogram_buckets({}, TTFT) is None
    # No +Inf bucket: a cut-off exposition, not a histogram.
    cut = {k: v for k, v in values.items() if "+Inf" not in k}
    assert histogram_buckets(cut, TTFT) is None


POLICY = ScalingPolicy(min_replicas=1, max_replicas=10, target_queue_depth=8,
                       latency_target_s=1.0, latency_name="p90 TTFT")  # fmt: skip


def pods(n: int, in_flight: float) -> list[PodMetrics]:
    return [PodMetrics(f"p{i}", in_flight, 0.0, 0.1) for i in range(n)]


def test_latency_over_target_scales_up_and_is_named():
    d = decide(POLICY, Observation(2, pods(2, 4.0), latency=2.5), ScalingMemory(), T0)
    assert (d.replicas, d.signal) == (5, "latency")
    assert d.reason == "p90 TTFT 2.5s, target 1s"
    assert d.signals["latency"] == 2.5


def test_the_largest_signal_wins_and_queue_depth_wins_ties():
    d = decide(POLICY, Observation(2, pods(2, 24.0), latency=1.5), ScalingMemory(), T0)
    assert (d.replicas, d.signal) == (6, "queueDepth")
    on_target = decide(POLICY, Observation(2, pods(2, 8.0), latency=1.0), ScalingMemory(), T0)
    assert on_target.signal == "queueDepth"
    low_latency = decide(POLICY, Observation(2, pods(2, 8.0), latency=0.01), ScalingMemory(), T0)
    assert (low_latency.replicas, low_latency.signal) == (2, "queueDepth")


def test_no_latency_reading_or_no_target_leaves_two_signals():
    d = decide(POLICY, Observation(2, pods(2, 4.0), latency=None), ScalingMemory(), T0)
    assert "latency" not in d.signals and d.signal != "latency"
    plain = ScalingPolicy(min_replicas=1, max_replicas=10)
    d = decide(plain, Observation(2, pods(2, 4.0), latency=9.0), ScalingMemory(), T0)
    assert "latency" not in d.signals


def test_latency_asks_for_no_more_while_replicas_are_still_starting():
    d = decide(POLICY, Observation(4, pods(2, 4.0), starting=2, latency=5.0), ScalingMemory(), T0)
    assert d.replicas == 4


def test_a_latency_target_in_the_spec_becomes_the_policy_and_the_status_names_the_signal():
    spec = parse_spec("llm", {"autoscaling": {"maxReplicas": 8, "latencyTarget": {
        "metric": "queueTime", "quantile": 0.95, "targetSeconds": 0.5}}})  # fmt: skip
    policy = policy_of(spec.autoscaling)
    assert (policy.latency_target_s, policy.latency_name) == (0.5, "p95 queue time")
    d = decide(policy, Observation(1, pods(1, 1.0), latency=1.0), ScalingMemory(), T0)
    patch = status_update({}, 1, d, {}, T0)
    assert patch["lastScaleDecision"]["signal"] == "latency"
    assert patch["lastScaleDecision"]["metrics"]["latencySeconds"] == 1.0
    with pytest.raises(ValueError, match="targetSeconds"):
        parse_spec("llm", {"autoscaling": {"latencyTarget": {"metric": "ttft"}}})
