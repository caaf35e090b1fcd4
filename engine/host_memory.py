"""Host memory this process may still take: the kernel's estimate of what is available, bounded
by the memory cgroup it runs in (a container's limit), which the kernel's figure ignores; and
the CPU engine's default KV-cache budget, a share of it.

In a pod, /proc/meminfo describes the node: a cache sized from it alone would be OOM-killed at
the container's limit long before the node ran short. Torch-free: the command line's help
states the share."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

PROC_MEMINFO = Path("/proc/meminfo")
CGROUP_ROOT = Path("/sys/fs/cgroup")


def meminfo_available(text: str) -> int | None:
    """MemAvailable of /proc/meminfo's text, in bytes."""
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name == "MemAvailable":
            kib, _, unit = value.strip().partition(" ")
            return int(kib) * 1024 if unit == "kB" else int(kib)
    return None


def cgroup_headroom(limit: str, usage: str) -> int | None:
    """Bytes left under a cgroup's limit given the text of its limit and usage files; None when
    it has none ("max" in cgroup v2, a page-rounded 2**63 in v1)."""
    limit = limit.strip()
    if limit == "max" or int(limit) >= 1 << 60:
        return None
    return max(int(limit) - int(usage.strip()), 0)


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _levels(mount: Path, path: str) -> list[Path]:
    """A cgroup's directory under its controller's mount and each ancestor up to the mount."""
    directory = mount / path.strip().lstrip("/")
    return [directory, *(p for p in directory.parents if p.is_relative_to(mount))]


def _cgroup_headroom(root: Path, own: str) -> int | None:
    """The least headroom of the process's cgroup and its ancestors, from /proc/self/cgroup's
    text: the v2 line ("0::/path", memory.max) and the v1 memory controller's ("N:memory:/path",
    memory.limit_in_bytes). Inside a container the paths may not exist below the mount, whose
    root then holds the container's own files."""
    files = {
        "": (root, "memory.max", "memory.current"),
        "memory": (root / "memory", "memory.limit_in_bytes", "memory.usage_in_bytes"),
    }
    headrooms: list[int] = []
    for line in own.splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers not in files:
            continue
        mount, limit_file, usage_file = files[controllers]
        for level in _levels(mount, path):
            limit, usage = _read(level / limit_file), _read(level / usage_file)
            if limit is not None and usage is not None:
                headroom = cgroup_headroom(limit, usage)
                if headroom is not None:
                    headrooms.append(headroom)
    return min(headrooms) if headrooms else None


@dataclass(frozen=True)
class Available:
    """Bytes of memory this process may still take, and whether a memory cgroup's limit (a
    container's) is what bounds them rather than the host's free memory."""

    bytes: int
    under_limit: bool


def available_memory(meminfo: Path = PROC_MEMINFO, cgroup_root: Path = CGROUP_ROOT) -> Available:
    """What the kernel estimates is available (MemAvailable; where it gives none, not on
    Linux, the free physical pages), bounded by the headroom of the process's memory cgroups."""
    text = _read(meminfo)
    host = meminfo_available(text) if text is not None else None
    if host is None:
        host = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    headroom = _cgroup_headroom(cgroup_root, _read(Path("/proc/self/cgroup")) or "")
    if headroom is not None and headroom < host:
        return Available(headroom, under_limit=True)
    return Available(host, under_limit=False)


# The CPU path serves development machines, whose memory a browser and an IDE share: by default
# its KV cache takes a small share of the memory available at start, more only when asked
# (--kv-cache-memory-bytes). In a container whose memory limit is the bound, the limit was sized
# for the engine: the cache takes half the headroom left after the weights, the other half for
# activations, request buffers and the grammar workers.
CPU_KV_SHARE = 1 / 64
CPU_KV_SHARE_UNDER_LIMIT = 1 / 2


def cpu_kv_budget(available: Available, sequence_bytes: int, max_num_seqs: int) -> int:
    """The CPU's default KV-cache bytes: a share of the available memory, but at least one
    sequence at max_model_len (so every admissible request fits) and at most max_num_seqs of
    them (what the configuration can use)."""
    share = CPU_KV_SHARE_UNDER_LIMIT if available.under_limit else CPU_KV_SHARE
    return min(max_num_seqs * sequence_bytes, max(sequence_bytes, int(available.bytes * share)))
