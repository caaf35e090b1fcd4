"""The operator's gauges of each InferenceService it serves, for alerts and dashboards.

One series per service and gauge, labelled ``inferenceservice="<namespace>/<name>"``: one label
rather than a ``namespace`` label, which Prometheus would rename ``exported_namespace`` on the
operator pod's scrape (the target's own namespace wins). The reconciler sets the replica counts
from the status it computes, the built-in autoscaler what its signals ask for against the
bound; a service that is deleted, or leaves the built-in autoscaler, loses its series.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

from prometheus_client import Gauge

LABEL = "inferenceservice"

DESIRED = Gauge(
    "kvfleet_operator_desired_replicas",
    "Engine replicas the service is to run (status.desiredReplicas).",
    [LABEL],
)
READY = Gauge(
    "kvfleet_operator_ready_replicas",
    "Engine replicas ready (status.readyReplicas).",
    [LABEL],
)
WANTED = Gauge(
    "kvfleet_operator_wanted_replicas",
    "Engine replicas the built-in autoscaler's signals ask for, before autoscaling.minReplicas "
    "and maxReplicas bound them.",
    [LABEL],
)
MAX = Gauge(
    "kvfleet_operator_max_replicas",
    "autoscaling.maxReplicas of a service the built-in autoscaler scales.",
    [LABEL],
)


def label(key: tuple[str, str]) -> str:
    namespace, name = key
    return f"{namespace}/{name}"


def _remove(gauge: Gauge, key: tuple[str, str]) -> None:
    with contextlib.suppress(KeyError):  # never set
        gauge.remove(label(key))


def record_status(key: tuple[str, str], status: Mapping[str, Any]) -> None:
    """The replica counts of a status the reconciler computed; desired is left as it was while
    no spec has been applied (status.desiredReplicas still unknown)."""
    if (desired := status.get("desiredReplicas")) is not None:
        DESIRED.labels(label(key)).set(desired)
    READY.labels(label(key)).set(status.get("readyReplicas") or 0)


def forget_status(key: tuple[str, str]) -> None:
    for gauge in (DESIRED, READY):
        _remove(gauge, key)


def record_decision(key: tuple[str, str], wanted: int, max_replicas: int) -> None:
    WANTED.labels(label(key)).set(wanted)
    MAX.labels(label(key)).set(max_replicas)


def forget_decision(key: tuple[str, str]) -> None:
    for gauge in (WANTED, MAX):
        _remove(gauge, key)
