"""The CPUs the engine sizes its thread pools by: the affinity mask bounded by a cgroup CPU quota
(a Kubernetes CPU limit), in cgroup v2 and v1 layouts."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvfleet.engine.host_cpus import usable_cpus
from kvfleet.engine.structured_output import mask_threads

AFFINITY = len(os.sched_getaffinity(0))


def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


@pytest.fixture
def many_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    # A 64-core node, as a pod sees it.
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))


@pytest.mark.usefixtures("many_cpus")
@pytest.mark.parametrize(
    ("files", "cpus"),
    [
        ({"cpu.max": "400000 100000\n"}, 4),  # v2: limits.cpu: 4
        ({"cpu.max": "150000 100000\n"}, 2),  # 1.5 CPUs: a second thread still gets half
        ({"cpu.max": "50000 100000\n"}, 1),
        ({"cpu.max": "max 100000\n"}, 64),  # no limit
        ({"cpu/cpu.cfs_quota_us": "800000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 8),  # v1
        ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, 64),
        ({"cpu.max": "garbage\n"}, 64),
        ({}, 64),  # no cgroup filesystem
    ],
)
def test_a_cpu_quota_bounds_the_cores_a_pod_sees(
    tmp_path: Path, files: dict[str, str], cpus: int
) -> None:
    assert usable_cpus(_write(tmp_path, files)) == cpus


def test_a_quota_never_raises_the_affinity_mask(tmp_path: Path) -> None:
    root = _write(tmp_path, {"cpu.max": f"{(AFFINITY + 8) * 100000} 100000"})
    assert usable_cpus(root) == AFFINITY


@pytest.mark.parametrize(("cpus", "threads"), [(1, 1), (2, 1), (8, 2), (16, 4), (64, 8)])
def test_bitmask_threads_are_a_quarter_of_the_usable_cpus_within_bounds(
    cpus: int, threads: int
) -> None:
    assert mask_threads(cpus) == threads
