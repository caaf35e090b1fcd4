"""The per-request latency histograms (vLLM's names), fed by hand-made step outputs: each phase
is measured between the timestamps it names, once per request."""

from __future__ import annotations

import time

import pytest

from kvfleet.engine.config import EngineArgs
from kvfleet.engine.metrics import EngineMetrics
from kvfleet.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput


def _sum_count(metrics: EngineMetrics, name: str) -> tuple[float, float]:
    labels = {"model_name": "m"}
    total = metrics.registry.get_sample_value(f"{name}_sum", labels)
    count = metrics.registry.get_sample_value(f"{name}_count", labels)
    assert total is not None and count is not None, name
    return total, count


def test_each_phase_is_observed_once_between_its_timestamps(monkeypatch):
    metrics = EngineMetrics(EngineArgs(model="unused"), "m")
    t0 = 1000.0
    timing = RequestMetrics(arrival_time=t0, first_scheduled_time=t0 + 0.5, first_token_time=t0 + 2)
    clock = iter([t0 + 3, t0 + 4, t0 + 7])
    monkeypatch.setattr(time, "monotonic", lambda: next(clock))

    def step(finished: bool) -> list[RequestOutput]:
        done = CompletionOutput(index=0, finish_reason="length" if finished else None)
        return [RequestOutput("r", [1, 2], [done], finished=finished, metrics=timing)]

    metrics.on_step(step(False))  # first token delivered at t0 + 3
    metrics.on_step(step(False))
    metrics.on_step(step(True))  # last at t0 + 7
    expected = {
        "vllm:time_to_first_token_seconds": 3.0,
        "vllm:request_queue_time_seconds": 0.5,
        "vllm:request_prefill_time_seconds": 1.5,
        "vllm:request_decode_time_seconds": 5.0,
        "vllm:request_inference_time_seconds": 6.5,
        "vllm:e2e_request_latency_seconds": 7.0,
    }
    for name, seconds in expected.items():
        assert _sum_count(metrics, name) == pytest.approx((seconds, 1.0)), name
