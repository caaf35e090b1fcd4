"""spec.engine.cpuKvCacheBytes: the engine's host KV tier (--cpu-kv-cache-bytes), sized by the
operator from the pod's memory request unless given, off on the CPU and without prefix caching;
extraArgs may not set it."""

from __future__ import annotations

from typing import Any

import pytest

from kvfleet.engine.engine_args import EngineArgs
from kvfleet.operator.command_lines import engine_args
from kvfleet.operator.cpu_kv_cache import ENGINE_HOST_BYTES
from kvfleet.operator.spec import SpecError, parse_spec
from kvfleet.telemetry.ports import ENGINE_PORT

GI = 2**30


def _flag(raw: dict[str, Any]) -> int | None:
    args = engine_args(parse_spec("llm", raw), None, port=ENGINE_PORT)
    if "--cpu-kv-cache-bytes" not in args:
        return None
    value = args[args.index("--cpu-kv-cache-bytes") + 1]
    # The engine reads what the operator writes.
    read = EngineArgs.model_validate({"model": "m", "cpu_kv_cache_bytes": value, "device": "cpu"})
    assert read.cpu_kv_cache_bytes == int(value)
    return int(value)


def test_half_the_memory_request_the_engine_leaves_on_gpus() -> None:
    assert _flag({"resources": {"memory": "40Gi"}}) == (40 * GI - ENGINE_HOST_BYTES) // 2
    # With tensor parallelism /dev/shm counts against the request too.
    tp = {"memory": "64Gi", "gpus": 2, "sharedMemory": "4Gi"}
    assert (
        _flag({"resources": tp, "engine": {"tensorParallelSize": 2}})
        == ((64 - 4) * GI - ENGINE_HOST_BYTES) // 2
    )
    assert _flag({"resources": {"memory": "9Gi"}}) is None  # under 1Gi left: not worth pinning
    assert _flag({"resources": {"gpus": 0}}) is None  # the CPU's cache is in host memory
    assert _flag({"engine": {"enablePrefixCaching": False}}) is None


def test_the_spec_overrides_or_turns_it_off_and_extra_args_cannot() -> None:
    assert _flag({"engine": {"cpuKvCacheBytes": "100Gi"}}) == 100 * GI
    assert _flag({"engine": {"cpuKvCacheBytes": 0}}) is None
    with pytest.raises(SpecError, match="needs enablePrefixCaching"):
        parse_spec("llm", {"engine": {"cpuKvCacheBytes": "1Gi", "enablePrefixCaching": False}})
    with pytest.raises(SpecError, match="a flag the operator manages"):
        parse_spec("llm", {"engine": {"extraArgs": ["--cpu-kv-cache-bytes=1"]}})
