"""The CPU engine's default KV cache: a small share of the host's available memory, or half of
what a container's memory limit leaves, never less than one full-length sequence, never more
than the configuration can use (issue 37: a 135M model's first run held a 4 GiB cache)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvfleet.engine import host_memory, model_runner
from kvfleet.engine.host_memory import (
    CPU_KV_SHARE,
    CPU_KV_SHARE_UNDER_LIMIT,
    Available,
    available_memory,
    cgroup_headroom,
    cpu_kv_budget,
    meminfo_available,
)
from kvfleet.engine.llm import LLM

GIB = 1 << 30
MEMINFO = "MemTotal:       24000000 kB\nMemFree:  1000 kB\nMemAvailable:   20971520 kB\n"


def test_meminfo_gives_the_kernels_available_estimate():
    assert meminfo_available(MEMINFO) == 20 * GIB
    assert meminfo_available("MemTotal: 1 kB\n") is None


@pytest.mark.parametrize(
    ("limit", "usage", "headroom"),
    [
        ("4294967296\n", "1073741824\n", 3 * GIB),
        ("max\n", "1073741824\n", None),
        ("9223372036854771712\n", "5\n", None),  # v1's "no limit"
        ("1073741824\n", "2147483648\n", 0),
    ],
)
def test_cgroup_headroom_is_the_limit_less_usage(limit, usage, headroom):
    assert cgroup_headroom(limit, usage) == headroom


def write_tree(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def test_a_containers_limit_bounds_what_the_node_has(tmp_path, monkeypatch):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(MEMINFO)
    cgroups = tmp_path / "cgroup"
    # v2 with the pod's limit one level above the process's own cgroup, which has none.
    write_tree(
        cgroups,
        {
            "kubepods/pod1/memory.max": f"{4 * GIB}\n",
            "kubepods/pod1/memory.current": f"{GIB}\n",
            "kubepods/pod1/engine/memory.max": "max\n",
            "kubepods/pod1/engine/memory.current": f"{GIB}\n",
        },
    )
    monkeypatch.setattr(host_memory, "_read", _reader_with_cgroup("0::/kubepods/pod1/engine\n"))
    assert available_memory(meminfo, cgroups) == Available(3 * GIB, under_limit=True)
    # v1's memory controller, as a container sees it at the mount's root.
    v1 = tmp_path / "v1"
    write_tree(
        v1,
        {"memory/memory.limit_in_bytes": f"{2 * GIB}\n", "memory/memory.usage_in_bytes": "0\n"},
    )
    monkeypatch.setattr(host_memory, "_read", _reader_with_cgroup("4:memory:/docker/abc\n"))
    assert available_memory(meminfo, v1) == Available(2 * GIB, under_limit=True)
    # No limit anywhere: the node's estimate.
    monkeypatch.setattr(host_memory, "_read", _reader_with_cgroup("0::/\n"))
    assert available_memory(meminfo, tmp_path / "none") == Available(20 * GIB, False)


def _reader_with_cgroup(own: str):
    def read(path: Path) -> str | None:
        if path == Path("/proc/self/cgroup"):
            return own
        try:
            return path.read_text()
        except OSError:
            return None

    return read


def test_the_budget_is_a_share_between_one_sequence_and_all_of_them():
    seq = 100 << 20
    host = Available(20 * GIB, under_limit=False)
    assert cpu_kv_budget(host, seq, 256) == int(20 * GIB * CPU_KV_SHARE)
    pod = Available(2 * GIB, under_limit=True)  # a container's limit leaves 2 GiB
    assert cpu_kv_budget(pod, seq, 256) == int(2 * GIB * CPU_KV_SHARE_UNDER_LIMIT)
    assert cpu_kv_budget(Available(GIB, False), seq, 256) == seq  # max_model_len still fits
    assert cpu_kv_budget(Available(1024 * GIB, False), seq, 4) == 4 * seq  # max_num_seqs's worth
    # The default model on this 24 GB machine: SmolLM2-135M in float32 (30 layers x 3 KV
    # heads x 64 dims x K and V x 4 bytes) at 8192 tokens is 360 MiB a sequence, against ~1 GiB
    # of weights and runtime: under the 1.5 GB the issue allows.
    smollm2 = 8192 * 30 * 3 * 64 * 2 * 4
    assert cpu_kv_budget(Available(22 * GIB, False), smollm2, 256) < 500 * 10**6


@pytest.mark.parametrize("under_limit", [False, True])
def test_a_cpu_engine_sizes_its_cache_by_the_available_memory(
    under_limit, model_dirs, monkeypatch, caplog
):
    available = Available(16 << 20, under_limit)
    monkeypatch.setattr(model_runner, "available_memory", lambda: available)
    with caplog.at_level("INFO", logger="kvfleet.engine.model_runner"):
        llm = LLM(str(model_dirs["llama"]), max_model_len=64, skip_tokenizer_init=True)
    runner = llm.engine.runner
    expected = cpu_kv_budget(available, 4 * runner.block_bytes, 256) // runner.block_bytes
    assert expected > 4
    assert runner.num_blocks == expected + 1  # plus the null block
    assert "--kv-cache-memory-bytes" in caplog.text
    llm.shutdown()


def test_a_machine_too_small_for_a_share_still_holds_one_sequence(model_dirs, monkeypatch):
    monkeypatch.setattr(model_runner, "available_memory", lambda: Available(0, False))
    llm = LLM(str(model_dirs["llama"]), max_model_len=64, skip_tokenizer_init=True)
    assert llm.engine.runner.num_blocks == 64 // 16 + 1
    llm.shutdown()
