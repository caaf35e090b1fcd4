"""The request rate a routing policy serves at a TTFT SLO, read from a rate sweep of the fleet
harness: the rate where the policy's p90 TTFT crosses the SLO. Between two swept rates the p90 is
interpolated linearly in its logarithm (a queue's wait grows about exponentially past the knee),
as the RESULTS plots draw it on a log scale."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Capacity:
    policy: str  # a series_name
    # None: even the lowest swept rate missed the SLO.
    rate: float | None
    # False: every swept rate met the SLO, so ``rate`` (the highest swept) is a lower bound.
    crossed: bool
    swept: tuple[float, ...]

    def describe(self) -> str:
        if self.rate is None:
            return f"< {min(self.swept):g}"
        return f"{self.rate:.1f}" if self.crossed else f">= {self.rate:g}"


def series_name(run: dict[str, Any]) -> str:
    """A run's policy, with its router replicas where there were more than one (``precise x3``):
    runs of one policy through different numbers of routers are series of their own."""
    routers = run.get("routers") or 0
    return f"{run['policy']} x{routers}" if routers > 1 else run["policy"]


def hit_rate(run: dict[str, Any]) -> float | None:
    """The share of a run's prompt tokens that no engine computed: found in the device's prefix
    cache or copied back from the host KV tier. vllm:prefix_cache_hits counts the device's
    alone (as vLLM's does), so prefix_cache_hit_rate by itself understates a run with a host
    tier by its host_cache_hit_rate. (A result older than hit_rate, or a printed table's
    row, says it in other keys.)"""
    if "hit_rate" in run:
        return run["hit_rate"]
    device = run.get("prefix_cache_hit_rate")
    if device is None:
        return None
    return device + (run.get("host_cache_hit_rate") or 0.0)


def fixed_rate(load: str) -> float | None:
    """The rate of a one-phase load such as ``40x12``; None for a ramp."""
    phases = load.split(",")
    return float(phases[0].partition("x")[2]) if len(phases) == 1 else None


def rate_at_slo(policy: str, points: Iterable[tuple[float, float]], slo_s: float) -> Capacity:
    """``points``: (request rate, p90 TTFT in seconds) of one policy's runs; the first crossing
    of the SLO from below, going up in rate."""
    ordered = sorted(points)
    if not ordered:
        raise ValueError(f"{policy}: no fixed-rate runs to read a rate at the SLO from")
    swept = tuple(rate for rate, _ in ordered)
    if ordered[0][1] > slo_s:
        return Capacity(policy, None, True, swept)
    for (r0, p0), (r1, p1) in itertools.pairwise(ordered):
        if p1 > slo_s:
            # p0 <= slo < p1, both > 0 where a request answered at all.
            lo, hi = math.log(max(p0, 1e-6)), math.log(p1)
            return Capacity(
                policy, r0 + (r1 - r0) * (math.log(slo_s) - lo) / (hi - lo), True, swept
            )
    return Capacity(policy, ordered[-1][0], False, swept)


def capacities(runs: Sequence[dict[str, Any]], slo_s: float) -> list[Capacity]:
    """The rate at the SLO of each policy in ``runs`` (the harness's result runs, or the rows of
    its printed table), per series_name in the order they first appear; ramps are left out."""
    points: dict[str, list[tuple[float, float]]] = {}
    for r in runs:
        rate = fixed_rate(r["load"])
        series = points.setdefault(series_name(r), [])
        if rate is not None and (p90 := slo_p90_s(r)) is not None:
            series.append((rate, p90))
    return [rate_at_slo(policy, p, slo_s) for policy, p in points.items() if p]


def slo_p90_s(run: dict[str, Any]) -> float | None:
    """A run's p90 TTFT as the SLO judges it: a failed request counts as over any SLO (the
    nearest-rank p90 of every request's TTFT, a failure's infinite), so a policy that fails
    requests does not look fast. A printed table has no per-request samples: its p90 of the
    answered requests."""
    if not run.get("samples"):
        p90_ms = run.get("ttft_p90_ms")
        return None if p90_ms is None else p90_ms / 1000
    ttfts = sorted(s[1] if s[3] and s[1] is not None else math.inf for s in run["samples"])
    return ttfts[math.ceil(0.9 * len(ttfts)) - 1]
