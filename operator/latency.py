"""A latency quantile of the whole service over the last interval, from the engines' cumulative
Prometheus histograms, for the autoscaler's optional latency target.

Each engine exports cumulative bucket counts since it started. The quantile of the last interval
comes from the difference between two scrapes of the same pod, summed over pods, and is then
interpolated within its bucket as Prometheus' histogram_quantile does. A pod seen for the first
time, or whose counts went down (it restarted), has no interval yet and is left out: its next
scrape gives one. Pure: the autoscaler keeps the previous scrape of each pod.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Iterable, Mapping

from kvfleet.telemetry.metric_names import REQUEST_QUEUE_TIME, TIME_TO_FIRST_TOKEN

# (upper bound, cumulative count), by increasing bound, the last one +Inf.
Buckets = tuple[tuple[float, float], ...]

# The engine's histogram of each spec.autoscaling.latencyTarget.metric.
LATENCY_METRICS = {"ttft": TIME_TO_FIRST_TOKEN, "queueTime": REQUEST_QUEUE_TIME}


def interval(previous: Buckets | None, current: Buckets) -> Buckets | None:
    """The counts added between two scrapes of one pod; None when there is no interval to
    measure (a first scrape, a restart, or buckets that changed) or the counts are no cumulative
    histogram (one that falls from a bucket to the next is broken, and would interpolate to
    any latency at all)."""
    if previous is None or [le for le, _ in previous] != [le for le, _ in current]:
        return None
    if not (_cumulative(previous) and _cumulative(current)):
        return None
    pairs = zip(previous, current, strict=True)
    delta = tuple((le, now - before) for (le, before), (_, now) in pairs)
    return None if any(count < 0 for _, count in delta) else delta


def _cumulative(buckets: Buckets) -> bool:
    return all(a[1] <= b[1] for a, b in itertools.pairwise(buckets))


def merge(histograms: Iterable[Buckets]) -> Buckets | None:
    """The pods' intervals summed. Engines of different versions may bucket differently (mid
    upgrade): only those with the most common bucket bounds are summed."""
    histograms = [h for h in histograms if h]
    if not histograms:
        return None
    layouts = Counter(tuple(le for le, _ in h) for h in histograms)
    layout = layouts.most_common(1)[0][0]
    totals = [0.0] * len(layout)
    for h in histograms:
        if tuple(le for le, _ in h) == layout:
            for i, (_, count) in enumerate(h):
                totals[i] += count
    return tuple(zip(layout, totals, strict=True))


def quantile(q: float, buckets: Buckets) -> float | None:
    """The q-quantile (0 < q < 1) of a cumulative histogram; None with no observations. A rank
    in the +Inf bucket answers the highest finite bound, as Prometheus does."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if math.isinf(le):
                return lower
            if count == below:
                return le
            return lower + (le - lower) * (rank - below) / (count - below)
        lower, below = le, count
    return lower


def service_quantile(
    q: float, previous: Mapping[str, Buckets], current: Mapping[str, Buckets]
) -> float | None:
    """The q-quantile over every pod's last interval; None when no request finished in it."""
    merged = merge(
        d for pod, now in current.items() if (d := interval(previous.get(pod), now)) is not None
    )
    return quantile(q, merged) if merged is not None else None
