"""The CPU engine's default KV cache: a small share of the memory available to the process (a
container's cgroup limit included), never less than one full-length sequence, never more than
the configuration can use (issue 37: a 135M model's first run held a 4 GiB cache)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvfleet.engine import host_memory, model_runner
from kvfleet.engine.host_memory import available_bytes, cgroup_headroom, meminfo_available
from kvfleet.engine.llm import LLM
from kvfleet.engine.model_runner import CPU_KV_SHARE, cpu_kv_budget

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
    assert available_bytes(meminfo, cgroups) == 3 * GIB
    # v1's memory controller, as a container sees it at the mount's root.
    v1 = tmp_path / "v1"
    write_tree(
        v1,
        {"memory/memory.limit_in_bytes": f"{2 * GIB}\n", "memory/memory.usage_in_bytes": "0\n"},
    )
    monkeypatch.setattr(host_memory, "_read", _reader_with_cgroup("4:memory:/docker/abc\n"))
    assert available_bytes(meminfo, v1) == 2 * GIB
    # No limit anywhere: the node's estimate.
    monkeypatch.setattr(host_memory, "_read", _reader_with_cgroup("0::/\n"))
    assert available_bytes(meminfo, tmp_path / "none") == 20 * GIB


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
    assert cpu_kv_budget(20 * GIB, seq, 256) == int(20 * GIB * CPU_KV_SHARE)
    assert cpu_kv_budget(GIB, seq, 256) == seq  # a small machine still serves max_model_len
    assert cpu_kv_budget(1024 * GIB, seq, 4) == 4 * seq  # no more than max_num_seqs can use
    # The default model on this 24 GB machine: SmolLM2-135M in float32 (30 layers x 3 KV
    # heads x 64 dims x K and V x 4 bytes) at 8192 tokens is 360 MiB a sequence, against ~1 GiB
    # of weights and runtime: under the 1.5 GB the issue allows.
    smollm2 = 8192 * 30 * 3 * 64 * 2 * 4
    assert cpu_kv_budget(22 * GIB, smollm2, 256) < 500 * 10**6


def test_a_cpu_engine_sizes_its_cache_by_the_available_memory(model_dirs, monkeypatch, caplog):
    monkeypatch.setattr(model_runner, "available_bytes", lambda: 64 << 20)
    with caplog.at_level("INFO", logger="kvfleet.engine.model_runner"):
        llm = LLM(str(model_dirs["llama"]), max_model_len=64, skip_tokenizer_init=True)
    runner = llm.engine.runner
    share = int((64 << 20) * CPU_KV_SHARE) // runner.block_bytes
    assert runner.num_blocks == share + 1  # plus the null block
    assert "--kv-cache-memory-bytes" in caplog.text
    llm.shutdown()
    # A machine too small for a share of one sequence still gets one (and the null block).
    monkeypatch.setattr(model_runner, "available_bytes", lambda: 0)
    llm = LLM(str(model_dirs["llama"]), max_model_len=64, skip_tokenizer_init=True)
    assert llm.engine.runner.num_blocks == 64 // 16 + 1
    llm.shutdown()
