"""How much host memory an engine's KV cache gets as its host tier (--cpu-kv-cache-bytes), from
the pod's memory request: the tier takes a share of what the engine process leaves. Pure."""

from __future__ import annotations

from kvfleet.operator.drift import parse_quantity
from kvfleet.operator.spec import InferenceServiceSpec

# Host memory a GPU engine needs for itself: the Python process with torch and the CUDA
# context, the tokenizer, the grammar workers, checkpoint reads in flight and the step's
# host-side buffers.
ENGINE_HOST_BYTES = 8 * 2**30
# Of the memory request left after that (and /dev/shm, which counts against it), the share the
# tier takes: the rest is headroom for what the estimate misses (the page cache of the weights,
# LoRA adapters in host memory), so the pod is not OOM-killed at its limit.
CPU_KV_CACHE_SHARE = 0.5
# Below this the tier is not worth its pinned allocation.
MIN_CPU_KV_CACHE_BYTES = 2**30


def cpu_kv_cache_bytes(spec: InferenceServiceSpec) -> int:
    """engine.cpuKvCacheBytes when given (0: off); else, for an engine on GPUs with prefix
    caching, CPU_KV_CACHE_SHARE of resources.memory after ENGINE_HOST_BYTES and /dev/shm, in
    whole MiB, or 0 when that is under MIN_CPU_KV_CACHE_BYTES. A CPU engine's KV cache is in
    host memory already: no tier."""
    e, r = spec.engine, spec.resources
    if e.cpu_kv_cache_bytes is not None:
        return int(parse_quantity(e.cpu_kv_cache_bytes))
    if r.gpus == 0 or not e.enable_prefix_caching:
        return 0
    shm = parse_quantity(r.shared_memory) if r.gpus > 1 else 0
    left = parse_quantity(r.memory) - shm - ENGINE_HOST_BYTES
    size = int(int(left) * CPU_KV_CACHE_SHARE) // 2**20 * 2**20
    return size if size >= MIN_CPU_KV_CACHE_BYTES else 0
