"""Which engine a scale-down removes: the coldest, idlest one.

The ReplicaSet deletes the Ready pods with the lowest ``controller.kubernetes.io/pod-deletion-cost``
first, so just before a scale-down the autoscaler ranks the engines by what deleting each would
lose (requests in flight, then cached prompt blocks; a pod whose metrics did not come lowest)
and writes the ranks, on the pods whose rank moved. Ranks, not raw numbers: every change is a
pod update, and Kubernetes asks that the annotation not follow a metric.
docs/autoscaling.md#which-engine-a-scale-down-removes is the reference.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from kvfleet.operator.scaling_policy import PodMetrics

DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"


def deletion_costs(metrics: Iterable[PodMetrics]) -> dict[str, int]:
    """Each pod's cost, 0 for the one to delete first; ties keep the order of the pods' names, so
    equal pods get stable ranks from one step to the next."""
    metrics = list(metrics)
    answered = [m for m in metrics if m.answered]
    # Engines that do not export cached blocks (an older version mid-upgrade): KV-cache usage is
    # the nearest sign of warmth, for all of them, so one unit is compared with itself.
    by_blocks = all(m.cached_blocks is not None for m in answered)

    def warmth(m: PodMetrics) -> tuple[int, float, float]:
        if not m.answered:
            return (0, 0.0, 0.0)
        cached = m.cached_blocks if by_blocks else m.kv_cache_usage
        return (1, (m.running or 0.0) + (m.waiting or 0.0), cached or 0.0)

    ranked = sorted(metrics, key=lambda m: (warmth(m), m.pod))
    return {m.pod: rank for rank, m in enumerate(ranked)}


def cost_patches(
    pods: Iterable[Mapping[str, Any]], costs: Mapping[str, int]
) -> dict[str, dict[str, Any]]:
    """The merge patch for each pod whose annotation differs from its cost, by pod name."""
    patches = {}
    for pod in pods:
        meta = pod.get("metadata") or {}
        name = meta.get("name")
        if not isinstance(name, str) or name not in costs:
            continue
        value = str(costs[name])
        if (meta.get("annotations") or {}).get(DELETION_COST) != value:
            patches[name] = {"metadata": {"annotations": {DELETION_COST: value}}}
    return patches
