"""The fused mixture-of-experts kernel (kernels.fused_moe) on the GPU, at Qwen3-30B-A3B's and
Mixtral-8x7B's expert shapes, bf16 and fp8 weights, from decode to prefill token counts; fp8 in
both of the kernel's modes side by side, W8A16 (activations of the model dtype) and W8A8
(activations quantized per row, fp8 tensor cores):

- against its twin, the per-expert PyTorch loop (reference.fused_experts, eager: it reads each
  expert's token count on the host, so it cannot be captured), against one dense GEMM of the
  same FLOPs ([tokens * top_k, hidden] x [hidden, 3 * intermediate]; bf16, or for W8A8 the fp8
  linear as the engine serves it, its activations quantized per token), and the fp8 modes
  against bf16 at the same token count; each fp8 model's token counts where W8A8 beats W8A16
  are printed (engine.layers.moe.W8A8_MIN_TOKENS is the threshold to set from them);
- at decode token counts (up to ``BLOCK_TOKENS``), the engine's whole MoE block
  (layers.moe.SparseMoeBlock: router gate GEMM, routing, alignment, both grouped GEMMs and the
  combine), its kernel launches and time, with the routing and the alignment in one launch
  (expert_routing.route_and_align, where the token count allows) and in their own launches, and
  the block's time over the weight-read floor of its router and active experts;
- with ``--sweep``, every candidate tile at each token count, the best printed and written as a
  ``TILES`` table to paste into kernels/fused_moe.py (``--dtypes fp8``: W8A8's, ``W8A8_TILES``).

The fused kernel and the dense GEMM are captured in CUDA graphs and replayed (GPU time, as the
engine runs them); the replays cycle through eight routings, so that the experts a call reads are
not all in L2 from the call before, and the dense GEMM through copies of its weight that overflow
L2. Results go to OUT_DIR/moe_kernel.json (and moe_kernel_sweep.json).

    python bench/moe_kernel.py --out-dir /tmp/moe
    python bench/moe_kernel.py --out-dir /tmp/moe --sweep --models qwen3-30b-a3b --dtypes bf16
    python bench/moe_kernel.py --out-dir /tmp/moe --blocks --tokens 1 2 4 8 16 32 64
"""

from __future__ import annotations

import argparse
import contextlib
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

from kvfleet.engine.layers.fp8 import Fp8Config, fp8_linear, fp8_linear_layers, quantize_rows
from kvfleet.engine.layers.moe import SparseMoeBlock, route
from kvfleet.kernels import expert_routing, fused_moe, reference

# name: (hidden, moe intermediate, experts, top_k)
MODELS = {"qwen3-30b-a3b": (2048, 768, 128, 8), "mixtral-8x7b": (4096, 14336, 8, 2)}
TOKENS = (1, 16, 256, 4096)
# The sweep's token counts: each bucket's largest (the tile it gets), 1 and 4,096.
SWEEP_TOKENS = (1, 32, 128, 512, 2048, 4096)
ROUTINGS = 8
# The token counts up to which the whole block is timed too (decode batches).
BLOCK_TOKENS = 64
# The kernel's modes per weight dtype: (name, fp8_activations).
MODES = {"bf16": (("bf16", False),), "fp8": (("w8a16", False), ("w8a8", True))}

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
    experts: Experts,
    inputs: list[tuple[torch.Tensor, ...]],
    tile: fused_moe.MoeTile | None,
    fp8_activations: bool,
) -> Callable[[], torch.Tensor]:
    gate_up, down, gate_up_scale, down_scale = experts
    cycle = itertools.cycle(inputs)

    def call() -> torch.Tensor:
        x, weights, ids = next(cycle)
        return fused_moe.fused_experts(
            x, gate_up, down, weights, ids, "silu", gate_up_scale, down_scale, fp8_activations,
            tile=tile,
        )  # fmt: skip

    return call


def twin_time(
    experts: Experts, inputs: list[tuple[torch.Tensor, ...]], fp8_activations: bool
) -> float:
    """Microseconds per call of the PyTorch loop, eager, the median over the routings."""
    gate_up, down, gate_up_scale, down_scale = experts

    def call(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return reference.fused_experts(
            x, gate_up, down, weights, ids, "silu", gate_up_scale, down_scale, fp8_activations
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


def dense_time(pairs: int, hidden: int, inter: int, fp8: bool) -> float:
    """One GEMM of the experts' FLOPs: [pairs, hidden] x [hidden, 3 * inter], bf16, or the
    engine's fp8 linear (activations quantized per token, weight scaled per channel)."""
    a = torch.randn(pairs, hidden, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(3 * inter, hidden, device="cuda") / hidden**0.5
    if not fp8:
        weights = copies(w.to(torch.bfloat16))
        return graph_time(lambda: torch.nn.functional.linear(a, *next(weights)))
    fp8_weights = copies(*quantize_rows(w))

    def served() -> torch.Tensor:
        w_fp8, w_scale = next(fp8_weights)
        return fp8_linear(a, w_fp8, w_scale, None, None)

    return graph_time(served)


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
        "model          mode  tokens  fused us  twin us  dense us  twin/fused  fused/dense"
        "  bf16/fused  TFLOP/s  weights floor us  fused/floor  tile\n"
    )
    rows: list[dict[str, Any]] = []
    for name in models:
        hidden, inter, num_experts, top_k = MODELS[name]
        bf16_us: dict[int, float] = {}
        for dtype in dtypes:
            experts = experts_weights(hidden, inter, num_experts, dtype)
            for t in tokens:
                inputs = routings(t, hidden, num_experts, top_k)
                floor = weight_bytes(experts, inputs) / bandwidth * 1e6
                flops = 6 * t * top_k * hidden * inter
                for mode, a8 in MODES[dtype]:
                    check(experts, inputs[0], a8)
                    tile = fused_moe.tile_for(t, fused_moe.W8A8_TILES if a8 else fused_moe.TILES)
                    fused = graph_time(fused_call(experts, inputs, None, a8), replays=16)
                    twin = twin_time(experts, inputs, a8)
                    dense = dense_time(t * top_k, hidden, inter, fp8=a8)
                    if mode == "bf16":
                        bf16_us[t] = fused
                    vs_bf16 = bf16_us[t] / fused if t in bf16_us else None
                    row = dict(
                        model=name, dtype=dtype, mode=mode, tokens=t, fused_us=fused,
                        twin_us=twin, dense_us=dense, dense="fp8" if a8 else "bf16",
                        twin_over_fused=twin / fused, fused_over_dense=fused / dense,
                        bf16_over_fused=vs_bf16, fused_tflops=flops / fused / 1e6,
                        weight_floor_us=floor, fused_over_floor=fused / floor, tile=asdict(tile),
                    )  # fmt: skip
                    rows.append(row)
                    sys.stdout.write(
                        f"{name:14s} {mode:5s} {t:6d} {fused:9.1f} {twin:8.1f} {dense:9.1f} "
                        f"{twin / fused:11.1f} {fused / dense:12.2f} "
                        f"{'-' if vs_bf16 is None else f'{vs_bf16:.2f}':>11s} "
                        f"{flops / fused / 1e6:8.1f} {floor:17.1f} {fused / floor:12.2f}  {tile}\n"
                    )
            del experts
            torch.cuda.empty_cache()
        report_crossover(name, [r for r in rows if r["model"] == name])
    return rows


def moe_block(experts: Experts, top_k: int) -> SparseMoeBlock:
    """The engine's MoE block holding these experts, its router gate random (bf16)."""
    gate_up, down, gate_up_scale, down_scale = experts
    num_experts, two_inter, hidden = gate_up.shape
    fp8 = Fp8Config() if gate_up_scale is not None else None
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"), fp8_linear_layers(fp8):
            block = SparseMoeBlock(hidden, num_experts, top_k, two_inter // 2, "silu", True)
    finally:
        torch.set_default_dtype(previous)
    block.gate.weight.data.normal_(std=hidden**-0.5)
    moe = block.experts
    moe.gate_up_proj.data, moe.down_proj.data = gate_up, down
    if moe.gate_up_scale is not None and moe.down_scale is not None:
        assert gate_up_scale is not None and down_scale is not None
        moe.gate_up_scale.data, moe.down_scale.data = gate_up_scale, down_scale
    return block


@contextlib.contextmanager
def separate_routing() -> Iterator[None]:
    """The block routes and aligns in their own launches at every token count."""
    bound = expert_routing.ROUTE_ALIGN_MAX_PAIRS
    expert_routing.ROUTE_ALIGN_MAX_PAIRS = 0
    try:
        yield
    finally:
        expert_routing.ROUTE_ALIGN_MAX_PAIRS = bound


def launches(fn: Callable[[], object]) -> int:
    """Kernels (and copies) one call puts on the device, from the profiler's events."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = prof.events() or []
    return sum(1 for e in events if e.device_type == torch.profiler.DeviceType.CUDA)


def block_call(
    block: SparseMoeBlock, inputs: list[tuple[torch.Tensor, ...]]
) -> Callable[[], torch.Tensor]:
    xs = itertools.cycle([x for x, _, _ in inputs])
    return lambda: block(next(xs))


def block_rows(models: list[str], dtypes: list[str], tokens: list[int], bandwidth: float) -> list:
    """The whole MoE block per decode token count: launches and time, the routing and alignment
    in one launch where the engine takes it (`one`) and in their own (`apart`)."""
    sys.stdout.write(
        "model          dtype tokens  one us  launches  apart us  launches  floor us  "
        "one/floor  apart/one\n"
    )
    rows: list[dict[str, Any]] = []
    for name in models:
        hidden, inter, num_experts, top_k = MODELS[name]
        for dtype in dtypes:
            experts = experts_weights(hidden, inter, num_experts, dtype)
            block = moe_block(experts, top_k)
            for t in (t for t in tokens if t <= BLOCK_TOKENS):
                inputs = routings(t, hidden, num_experts, top_k)
                call = block_call(block, inputs)
                x = inputs[0][0]
                weights, ids = route(block.gate(x), top_k, True)
                args = (x, *experts[:2], weights, ids, "silu", *experts[2:])
                want = reference.fused_experts(*args, block.experts.fp8_activations(t)).float()
                got = block(x).float()
                if float((got - want).norm() / want.norm().clamp(min=1e-30)) > 2e-2:
                    raise SystemExit(f"{name} {dtype} {t}: the MoE block is off its twin")
                one_us, one_launches = graph_time(call, replays=16), launches(call)
                with separate_routing():
                    apart_us, apart_launches = graph_time(call, replays=16), launches(call)
                active = weight_bytes(experts, inputs) + block.gate.weight.nbytes
                floor = active / bandwidth * 1e6
                rows.append(
                    dict(
                        model=name, dtype=dtype, tokens=t, one_us=one_us,
                        one_launches=one_launches, apart_us=apart_us,
                        apart_launches=apart_launches, floor_us=floor,
                        one_over_floor=one_us / floor,
                        one_launch=expert_routing.routes_and_aligns_at_once(t, top_k),
                    )
                )  # fmt: skip
                sys.stdout.write(
                    f"{name:14s} {dtype:5s} {t:6d} {one_us:7.1f} {one_launches:9d} "
                    f"{apart_us:9.1f} {apart_launches:9d} {floor:9.1f} {one_us / floor:10.2f} "
                    f"{apart_us / one_us:10.2f}\n"
                )
            del experts, block
            torch.cuda.empty_cache()
    return rows


def report_crossover(name: str, rows: list[dict[str, Any]]) -> None:
    """The token counts at which W8A8 beats W8A16 (the engine's W8A8_MIN_TOKENS comes from
    them)."""
    by_mode = {(r["mode"], r["tokens"]): r["fused_us"] for r in rows}
    counts = sorted(t for mode, t in by_mode if mode == "w8a8" and ("w8a16", t) in by_mode)
    if not counts:
        return
    faster = [t for t in counts if by_mode["w8a8", t] < by_mode["w8a16", t]]
    ratios = ", ".join(f"{t}: {by_mode['w8a16', t] / by_mode['w8a8', t]:.2f}x" for t in counts)
    sys.stdout.write(f"{name}: W8A8 faster than W8A16 at {faster} tokens (W8A16/W8A8 {ratios})\n")


def check(experts: Experts, inputs: tuple[torch.Tensor, ...], fp8_activations: bool) -> None:
    """The kernel against its twin before it is timed (a fast wrong kernel is no result)."""
    gate_up, down, gate_up_scale, down_scale = experts
    x, weights, ids = inputs
    args = (x, gate_up, down, weights, ids, "silu", gate_up_scale, down_scale, fp8_activations)
    got, want = fused_moe.fused_experts(*args).float(), reference.fused_experts(*args).float()
    error = float((got - want).norm() / want.norm().clamp(min=1e-30))
    if error > 2e-2:
        raise SystemExit(f"the fused kernel is off its twin by {error:.3g} (relative norm)")


def sweep_tiles(
    tokens: int, top_k: int, num_experts: int, fp8_activations: bool
) -> Iterator[fused_moe.MoeTile]:
    """Candidates: BLOCK_M up to twice an expert's average rows (more would be padding)."""
    rows = max(1, tokens * top_k // num_experts)
    block_ms = [m for m in (16, 32, 64, 128) if m <= max(16, 2 * triton.next_power_of_2(rows))]
    # Narrow column blocks only where few experts are active: they keep every SM streaming.
    block_ns = (32, 64, 128) if tokens <= 128 else (64, 128)
    # fp8 packs twice the K into a tile's bytes.
    block_ks = (64, 128, 256) if fp8_activations else (64, 128)
    for block_m, block_n, block_k, warps, stages in itertools.product(
        block_ms, block_ns, block_ks, (4, 8), (3, 4)
    ):
        if fp8_activations and max(block_m, block_n) < fused_moe.FP8_MMA_ROWS:
            continue  # the swapped MMA's rows are the column block: fewer would not run on fp8
        group_m = 1 if block_m == 16 and tokens <= 32 else 8
        yield fused_moe.MoeTile(block_m, block_n, block_k, group_m, warps, stages)


def sweep(models: list[str], dtypes: list[str], tokens: list[int]) -> dict[str, Any]:
    """bf16's tiles (TILES, which W8A16 shares), or for fp8 W8A8's (W8A8_TILES)."""
    best: dict[str, Any] = {}
    for name in models:
        hidden, inter, num_experts, top_k = MODELS[name]
        for dtype in dtypes:
            a8 = dtype == "fp8"
            experts = experts_weights(hidden, inter, num_experts, dtype)
            key = f"{name}/{'w8a8' if a8 else dtype}"
            best[key] = {}
            for t in tokens:
                inputs = routings(t, hidden, num_experts, top_k)
                check(experts, inputs[0], a8)
                timed = []
                for tile in sweep_tiles(t, top_k, num_experts, a8):
                    try:
                        timed.append((graph_time(fused_call(experts, inputs, tile, a8), 8), tile))
                    except triton.runtime.errors.OutOfResources:
                        continue  # more shared memory or registers than an SM has
                timed.sort(key=lambda pair: pair[0])
                default = graph_time(fused_call(experts, inputs, None, a8), 8)
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
            table, table_name = (
                (fused_moe.W8A8_TILES, "W8A8_TILES") if a8 else (fused_moe.TILES, "TILES")
            )
            sys.stdout.write(
                f"{table_name} from {key} (each bucket's largest swept token count):\n"
            )
            for bound, current in table:
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
    parser.add_argument("--blocks", action="store_true", help="only the whole block's rows")
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
    rows = [] if args.blocks else compare(args.models, args.dtypes, args.tokens, bandwidth)
    blocks = block_rows(args.models, args.dtypes, args.tokens, bandwidth)
    result = {**meta, "copy_bandwidth": bandwidth, "rows": rows, "blocks": blocks}
    name = "moe_block.json" if args.blocks else "moe_kernel.json"
    (args.out_dir / name).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
