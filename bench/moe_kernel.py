"""The fused mixture-of-experts kernel (kernels.fused_moe) on the GPU, at Qwen3-30B-A3B's and
Mixtral-8x7B's expert shapes, bf16 and fp8 (W8A16) weights, from decode to prefill token counts:

- against its twin, the per-expert PyTorch loop (reference.fused_experts, eager: it reads each
  expert's token count on the host, so it cannot be captured), and against one dense bf16 GEMM of
  the same FLOPs ([tokens * top_k, hidden] x [hidden, 3 * intermediate]);
- with ``--sweep``, every candidate tile at each token count, the best printed and written as a
  ``TILES`` table to paste into kernels/fused_moe.py.

The fused kernel and the dense GEMM are captured in CUDA graphs and replayed (GPU time, as the
engine runs them); the replays cycle through eight routings, so that the experts a call reads are
not all in L2 from the call before, and the dense GEMM through copies of its weight that overflow
L2. Results go to OUT_DIR/moe_kernel.json (and moe_kernel_sweep.json).

    python bench/moe_kernel.py --out-dir /tmp/moe
    python bench/moe_kernel.py --out-dir /tmp/moe --sweep --models qwen3-30b-a3b --dtypes bf16
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import triton
from common import device_name, git_commit
from fp8_linear_bench import copies, graph_time
from latency import copy_bandwidth

from kvfleet.engine.layers.fp8 import quantize_rows
from kvfleet.engine.layers.moe import route
from kvfleet.kernels import fused_moe, reference

# name: (hidden, moe intermediate, experts, top_k)
MODELS = {"qwen3-30b-a3b": (2048, 768, 128, 8), "mixtral-8x7b": (4096, 14336, 8, 2)}
TOKENS = (1, 16, 256, 4096)
# The sweep's token counts: each bucket's largest (the tile it gets), 1 and 4,096.
SWEEP_TOKENS = (1, 32, 128, 512, 2048, 4096)
ROUTINGS = 8

Experts = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]


def experts_weights(hidden: int, inter: int, experts: int, dtype: str) -> Experts:
    """Random experts (gate_up, down, and for fp8 their scales per output channel), made one
    expert at a time so that Mixtral's fp32 values never hold all eight."""
    fp8 = dtype == "fp8"
    kind = reference.FP8 if fp8 else torch.bfloat16
    gate_up = torch.empty(experts, 2 * inter, hidden, device="cuda", dtype=kind)
    down = torch.empty(experts, hidden, inter, device="cuda", dtype=kind)
    gate_up_scale = torch.empty(experts, 2 * inter, device="cuda")
    down_scale = torch.empty(experts, hidden, device="cuda")
    for w, scale in ((gate_up, gate_up_scale), (down, down_scale)):
        for e in range(experts):
            values = torch.randn(w.shape[1:], device="cuda") / w.shape[-1] ** 0.5
            if fp8:
                q, s = quantize_rows(values)
                w[e].copy_(q)
                scale[e].copy_(s)
            else:
                w[e].copy_(values)
    return (gate_up, down, gate_up_scale, down_scale) if fp8 else (gate_up, down, None, None)


def routings(tokens: int, hidden: int, experts: int, top_k: int) -> list[tuple[torch.Tensor, ...]]:
    """ROUTINGS inputs (x, weights, ids), each routed by a random router's softmax top-k."""
    out = []
    for _ in range(ROUTINGS):
        x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
        weights, ids = route(torch.randn(tokens, experts, device="cuda"), top_k, True)
        out.append((x, weights, ids))
    return out


def fused_call(
    experts: Experts, inputs: list[tuple[torch.Tensor, ...]], tile: fused_moe.MoeTile | None
) -> Callable[[], torch.Tensor]:
    gate_up, down, gate_up_scale, down_scale = experts
    cycle = itertools.cycle(inputs)

    def call() -> torch.Tensor:
        x, weights, ids = next(cycle)
        return fused_moe.fused_experts(
            x, gate_up, down, weights, ids, "silu", gate_up_scale, down_scale, tile=tile
        )

    return call


def twin_time(experts: Experts, inputs: list[tuple[torch.Tensor, ...]]) -> float:
    """Microseconds per call of the PyTorch loop, eager, the median over the routings."""
    gate_up, down, gate_up_scale, down_scale = experts

    def call(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return reference.fused_experts(
            x, gate_up, down, weights, ids, "silu", gate_up_scale, down_scale
        )

    call(*inputs[0])
    times = []
    for x, weights, ids in inputs * 2:
        torch.cuda.synchronize()
        start = time.perf_counter()
        call(x, weights, ids)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times)


def dense_time(pairs: int, hidden: int, inter: int) -> float:
    """One bf16 GEMM of the experts' FLOPs: [pairs, hidden] x [hidden, 3 * inter]."""
    a = torch.randn(pairs, hidden, device="cuda", dtype=torch.bfloat16)
    weights = copies(torch.randn(3 * inter, hidden, device="cuda", dtype=torch.bfloat16))
    return graph_time(lambda: torch.nn.functional.linear(a, *next(weights)))


def weight_bytes(experts: Experts, inputs: list[tuple[torch.Tensor, ...]]) -> float:
    """The expert weights (and scales) a call reads, averaged over the routings."""
    gate_up, down, gate_up_scale, down_scale = experts
    per_expert = gate_up[0].nbytes + down[0].nbytes
    if gate_up_scale is not None and down_scale is not None:
        per_expert += gate_up_scale[0].nbytes + down_scale[0].nbytes
    active = [int(torch.unique(ids[ids >= 0]).numel()) for _, _, ids in inputs]
    return per_expert * statistics.mean(active)


def compare(models: list[str], dtypes: list[str], tokens: list[int], bandwidth: float) -> list:
    sys.stdout.write(
        "model          dtype tokens  fused us  twin us  dense us  twin/fused  fused/dense"
        "  TFLOP/s  weights floor us  tile\n"
    )
    rows: list[dict[str, Any]] = []
    for name in models:
        hidden, inter, num_experts, top_k = MODELS[name]
        for dtype in dtypes:
            experts = experts_weights(hidden, inter, num_experts, dtype)
            for t in tokens:
                inputs = routings(t, hidden, num_experts, top_k)
                check(experts, inputs[0])
                tile = fused_moe.tile_for(t)
                fused = graph_time(fused_call(experts, inputs, None), replays=16)
                twin = twin_time(experts, inputs)
                dense = dense_time(t * top_k, hidden, inter)
                flops = 6 * t * top_k * hidden * inter
                floor = weight_bytes(experts, inputs) / bandwidth * 1e6
                row = dict(
                    model=name, dtype=dtype, tokens=t, fused_us=fused, twin_us=twin,
                    dense_us=dense, twin_over_fused=twin / fused, fused_over_dense=fused / dense,
                    fused_tflops=flops / fused / 1e6, weight_floor_us=floor,
                    tile=asdict(tile),
                )  # fmt: skip
                rows.append(row)
                sys.stdout.write(
                    f"{name:14s} {dtype:5s} {t:6d} {fused:9.1f} {twin:8.1f} {dense:9.1f} "
                    f"{twin / fused:11.1f} {fused / dense:12.2f} {flops / fused / 1e6:8.1f} "
                    f"{floor:17.1f}  {tile}\n"
                )
            del experts
            torch.cuda.empty_cache()
    return rows


def check(experts: Experts, inputs: tuple[torch.Tensor, ...]) -> None:
    """The kernel against its twin before it is timed (a fast wrong kernel is no result)."""
    gate_up, down, gate_up_scale, down_scale = experts
    x, weights, ids = inputs
    args = (x, gate_up, down, weights, ids, "silu", gate_up_scale, down_scale)
    got, want = fused_moe.fused_experts(*args).float(), reference.fused_experts(*args).float()
    error = float((got - want).norm() / want.norm().clamp(min=1e-30))
    if error > 2e-2:
        raise SystemExit(f"the fused kernel is off its twin by {error:.3g} (relative norm)")


def sweep_tiles(tokens: int, top_k: int, num_experts: int) -> Iterator[fused_moe.MoeTile]:
    """Candidates: BLOCK_M up to twice an expert's average rows (more would be padding)."""
    rows = max(1, tokens * top_k // num_experts)
    block_ms = [m for m in (16, 32, 64, 128) if m <= max(16, 2 * triton.next_power_of_2(rows))]
    # Narrow column blocks only where few experts are active: they keep every SM streaming.
    block_ns = (32, 64, 128) if tokens <= 128 else (64, 128)
    for block_m, block_n, block_k, warps, stages in itertools.product(
        block_ms, block_ns, (64, 128), (4, 8), (3, 4)
    ):
        group_m = 1 if block_m == 16 and tokens <= 32 else 8
        yield fused_moe.MoeTile(block_m, block_n, block_k, group_m, warps, stages)


def sweep(models: list[str], dtypes: list[str], tokens: list[int]) -> dict[str, Any]:
    best: dict[str, Any] = {}
    for name in models:
        hidden, inter, num_experts, top_k = MODELS[name]
        for dtype in dtypes:
            experts = experts_weights(hidden, inter, num_experts, dtype)
            key = f"{name}/{dtype}"
            best[key] = {}
            for t in tokens:
                inputs = routings(t, hidden, num_experts, top_k)
                timed = []
                for tile in sweep_tiles(t, top_k, num_experts):
                    try:
                        timed.append((graph_time(fused_call(experts, inputs, tile), 8), tile))
                    except triton.runtime.errors.OutOfResources:
                        continue  # more shared memory or registers than an SM has
                timed.sort(key=lambda pair: pair[0])
                default = graph_time(fused_call(experts, inputs, None), 8)
                t_us, tile = timed[0]
                best[key][t] = dict(us=t_us, tile=asdict(tile), default_us=default)
                sys.stdout.write(
                    f"{key:20s} {t:5d} tokens  best {t_us:8.1f} us {tile}  "
                    f"(table's tile {default:.1f} us)\n"
                )
                for next_us, next_tile in timed[1:3]:
                    sys.stdout.write(f"{'':34s}next {next_us:8.1f} us {next_tile}\n")
            del experts
            torch.cuda.empty_cache()
        key = f"{name}/{dtypes[0]}"
        bounds = [bound for bound, _ in fused_moe.TILES]
        sys.stdout.write(f"TILES from {key} (each bucket's largest swept token count):\n")
        for bound, (_, current) in zip(bounds, fused_moe.TILES, strict=True):
            swept = [t for t in best[key] if t <= bound]
            tile = fused_moe.MoeTile(**best[key][max(swept)]["tile"]) if swept else current
            sys.stdout.write(f"    ({bound}, {tile}),\n")
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=list(MODELS))
    parser.add_argument("--dtypes", nargs="+", choices=["bf16", "fp8"], default=["bf16", "fp8"])
    parser.add_argument("--tokens", nargs="+", type=int, default=list(TOKENS))
    parser.add_argument("--sweep", action="store_true", help="time every candidate tile")
    parser.add_argument("--sweep-tokens", nargs="+", type=int, default=list(SWEEP_TOKENS))
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    meta = dict(device=device_name(), commit=git_commit(), torch=torch.__version__)
    sys.stdout.write(f"{meta}\n")
    if args.sweep:
        best = sweep(args.models, args.dtypes, args.sweep_tokens)
        (args.out_dir / "moe_kernel_sweep.json").write_text(json.dumps({**meta, "best": best}))
        return 0
    bandwidth = copy_bandwidth()
    sys.stdout.write(f"copy bandwidth: {bandwidth / 1e9:,.0f} GB/s\n")
    rows = compare(args.models, args.dtypes, args.tokens, bandwidth)
    result = {**meta, "copy_bandwidth": bandwidth, "rows": rows}
    (args.out_dir / "moe_kernel.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
