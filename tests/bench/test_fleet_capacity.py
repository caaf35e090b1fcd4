"""The rate a policy serves at the TTFT SLO, read from a fleet harness rate sweep
(bench/fleet/capacity.py): the crossing interpolated in log p90, the bounds at either end of the
sweep, and failed requests counted as over the SLO."""

from __future__ import annotations

import math

import pytest

from tests.support.scripts import load_script

capacity = load_script("bench/fleet/capacity.py")


def test_the_crossing_lies_between_the_swept_rates_on_a_log_scale() -> None:
    # p90 0.5 s at 20 req/s, 2 s at 30: 1 s is halfway in log p90, so 25 req/s.
    c = capacity.rate_at_slo("prefix", [(30, 2.0), (10, 0.2), (20, 0.5), (40, 9.0)], 1.0)
    assert c.crossed and c.rate == pytest.approx(25.0) and c.swept == (10, 20, 30, 40)
    assert c.describe() == "25.0"
    # The first crossing counts: a later rate back under the SLO (noise) does not raise it.
    c = capacity.rate_at_slo("prefix", [(10, 0.2), (20, 2.0), (30, 0.9)], 1.0)
    assert c.rate is not None and 10 < c.rate < 20


def test_a_sweep_that_never_or_always_crosses_says_so() -> None:
    always = capacity.rate_at_slo("precise", [(10, 0.1), (20, 0.4)], 1.0)
    assert (always.rate, always.crossed, always.describe()) == (20, False, ">= 20")
    never = capacity.rate_at_slo("round-robin", [(10, 1.5), (20, 4.0)], 1.0)
    assert (never.rate, never.describe()) == (None, "< 10")
    with pytest.raises(ValueError, match="no fixed-rate runs"):
        capacity.rate_at_slo("prefix", [], 1.0)


def _run(policy: str, load: str, ttfts: list[float | None]) -> dict:
    samples = [[i * 0.1, t, 1.0, t is not None] for i, t in enumerate(ttfts)]
    return {"policy": policy, "load": load, "ttft_p90_ms": 1.0, "samples": samples}


def test_failed_requests_count_as_over_the_slo() -> None:
    fast = [0.1] * 8
    # Two failures in ten: the nearest-rank p90 is a failure's, infinite.
    assert capacity.slo_p90_s(_run("p", "60x8", [*fast, None, None])) == math.inf
    assert capacity.slo_p90_s(_run("p", "60x8", [*fast, 0.1, None])) == pytest.approx(0.1)
    # A printed table's row has no samples: its p90 of the answered requests.
    assert capacity.slo_p90_s({"ttft_p90_ms": 250.0}) == 0.25
    runs = [
        _run("round-robin", "60x8", [0.1] * 10),
        _run("round-robin", "60x16", [*fast, None, None]),
        _run("precise", "60x8", [0.1] * 10),
        _run("precise", "60x16", [0.2] * 10),
        _run("precise", "30x2,30x16", [5.0] * 10),  # a ramp: no rate of its own
    ]
    rr, precise = capacity.capacities(runs, 1.0)
    assert (rr.policy, rr.rate, rr.crossed) == ("round-robin", 8, True)
    assert (precise.policy, precise.rate, precise.crossed, precise.swept) == (
        "precise", 16, False, (8, 16)
    )  # fmt: skip


def test_runs_through_more_routers_are_a_series_of_their_own() -> None:
    one, three = _run("precise", "60x8", [0.1] * 10), _run("precise", "60x8", [5.0] * 10)
    one["routers"], three["routers"] = 1, 3
    assert [capacity.series_name(r) for r in (one, three)] == ["precise", "precise x3"]
    assert capacity.series_name({"policy": "round-robin", "routers": 0}) == "round-robin"
    found = capacity.capacities([one, three], 1.0)
    assert [(c.policy, c.rate) for c in found] == [("precise", 8), ("precise x3", None)]
