"""The CPUs this process can really use, for sizing its thread pools: the affinity mask, bounded
by a cgroup CPU quota. A pod with a Kubernetes CPU limit still sees every core of its node in
os.cpu_count(), and a pool sized by that is throttled by the quota instead of running faster."""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def _quota(root: Path) -> float | None:
    """The cgroup's CPU quota in CPUs, None when unlimited or unreadable (v2, then v1)."""
    try:
        limit, period = (root / "cpu.max").read_text().split()[:2]
        return None if limit == "max" else int(limit) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None


def usable_cpus(cgroup_root: Path = CGROUP_ROOT) -> int:
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cpus = cpus or 1
    quota = _quota(cgroup_root)
    if quota is not None:
        cpus = min(cpus, max(1, math.ceil(quota)))
    return cpus
