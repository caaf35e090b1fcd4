"""What a LoRA batch adds to each projection on the GPU: the batched shrink + expand
(kvfleet.kernels.lora.add_lora_slices) against the base model's GEMM of the same projection, at
Llama-3.1-8B's shapes (qkv, o, gate/up, down), decode to prefill token counts, ranks 16 and 64,
8 and 16 slots.
Times are GPU time from CUDA-graph replays (fp8_linear_bench.graph_time) cycling through copies
of the weights and adapters that overflow the L2 cache, as a step's distinct layers do.

Each row: the base GEMM, LoRA over a batch whose tokens use every slot (decode: mixed token by
token; prefill: a run per adapter), LoRA over a batch of the base model only (what the kernels
cost when no request uses an adapter), and the overhead (LoRA / GEMM).

With ``--sweep``, candidate tiles per token-count bucket at rank 16 and 8 slots: shrink's
(tokens, K tile, K split, warps) with the table's expand, then expand's (tokens, columns, warps)
with the best shrink, each timed as the sum over the four projections (a layer's LoRA), the
best pair checked against the twin and printed as a ``TILES`` table to paste into
kernels/lora.py (OUT/lora_kernel_sweep.json).

    python bench/lora_kernel.py --out-dir OUT        # OUT/lora_kernel.json and the table
    python bench/lora_kernel.py --out-dir OUT --sweep
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import device_name, git_commit
from fp8_linear_bench import copies, graph_time

from kvfleet.kernels import lora, reference

# Llama-3.1-8B: input width, output width of each slice.
PROJECTIONS = {
    "qkv": (4096, [4096, 1024, 1024]),
    "o": (4096, [4096]),
    "gate_up": (4096, [14336, 14336]),
    "down": (14336, [4096]),
}
TOKENS = (1, 8, 32, 64, 256, 2048)
RANKS = (16, 64)
SLOTS = (8, 16)
# The sweep's token counts: each bucket's largest (the tile it gets) and 1; its adapters.
SWEEP_TOKENS = (1, 16, 32, 128, 512, 2048)
SWEEP_RANK, SWEEP_SLOTS = 16, 8


def slot_map(tokens: int, num_slots: int) -> torch.Tensor:
    """Every slot in use: decode batches (up to 256 tokens) mix them token by token, a prefill
    batch holds one run per adapter."""
    if tokens <= 256:
        slots = torch.randperm(max(tokens, num_slots))[:tokens] % num_slots
    else:
        slots = torch.arange(tokens) * num_slots // tokens
    return slots.to(torch.int32).cuda()


@dataclass
class Batch:
    """One projection's inputs: x, out, the adapters' copies (cycled, to overflow L2), the slot
    map with every slot in use."""

    k: int
    widths: list[int]
    x: torch.Tensor
    out: torch.Tensor
    adapters: Iterator[tuple[torch.Tensor, ...]]
    used: torch.Tensor

    @property
    def offsets(self) -> list[int]:
        return [sum(self.widths[:i]) for i in range(len(self.widths))]


def batch(projection: str, tokens: int, rank: int, num_slots: int) -> Batch:
    k, widths = PROJECTIONS[projection]
    dtype = torch.bfloat16
    x = torch.randn(tokens, k, device="cuda", dtype=dtype)
    out = torch.zeros(tokens, sum(widths), device="cuda", dtype=dtype)
    a = [torch.randn(num_slots, rank, k, device="cuda", dtype=dtype) * 0.02 for _ in widths]
    b = [torch.randn(num_slots, w, rank, device="cuda", dtype=dtype) * 0.02 for w in widths]
    return Batch(k, widths, x, out, copies(*a, *b), slot_map(tokens, num_slots))


def lora_call(
    data: Batch,
    slots: torch.Tensor,
    shrink: lora.ShrinkTile | None = None,
    expand: lora.ExpandTile | None = None,
) -> Callable[[], torch.Tensor]:
    def call() -> torch.Tensor:
        tensors = next(data.adapters)
        a, b = tensors[: len(data.widths)], tensors[len(data.widths) :]
        lora.add_lora_slices(data.x, a, b, slots, data.out, data.offsets, shrink, expand)
        return data.out

    return call


def measure(projection: str, tokens: int, rank: int, num_slots: int) -> dict[str, object]:
    torch.cuda.empty_cache()  # the last row's weights, graphs and copies
    data = batch(projection, tokens, rank, num_slots)
    weights = copies(
        torch.randn(data.out.shape[1], data.k, device="cuda", dtype=data.x.dtype) * 0.02
    )
    base_only = torch.full((tokens,), -1, dtype=torch.int32, device="cuda")

    def gemm() -> torch.Tensor:
        return torch.nn.functional.linear(data.x, *next(weights))

    base_us = graph_time(gemm)
    lora_us = graph_time(lora_call(data, data.used))
    idle_us = graph_time(lora_call(data, base_only))
    return {
        "projection": projection,
        "tokens": tokens,
        "rank": rank,
        "slots": num_slots,
        "gemm_us": round(base_us, 2),
        "lora_us": round(lora_us, 2),
        "lora_base_only_us": round(idle_us, 2),
        "overhead": round(lora_us / base_us, 3),
        "shrink_tile": str(lora.shrink_tile_for(tokens, rank, data.k, data.x.element_size())),
        "expand_tile": str(lora.expand_tile_for(tokens)),
    }


def _block_ms(tokens: int) -> list[int]:
    # Up to the token count's power of two: a taller block is padding.
    return [m for m in (16, 32, 64) if m <= max(16, triton.next_power_of_2(tokens))]


def shrink_candidates(tokens: int) -> list[lora.ShrinkTile]:
    """Shrink's tiles for the table (rank 16, 16-bit x): K unsplit, or split up to 16 ways
    for decode batches (4 past 128 tokens, where the token blocks fill the SMs); only those
    whose loads fit a thread's registers (the table's rule, so that a pasted tile is used as
    timed)."""
    splits = (1, 2, 4, 8, 16) if tokens <= 128 else (1, 2, 4)
    return [
        lora.ShrinkTile(block_m, block_k, split, warps)
        for block_m, block_k, split, warps in itertools.product(
            _block_ms(tokens), (64, 128, 256), splits, (4, 8)
        )
        if lora.fits_registers(block_m, lora.block_r(SWEEP_RANK), block_k, warps)
    ]


def expand_candidates(tokens: int) -> list[lora.ExpandTile]:
    return [
        lora.ExpandTile(block_m, block_n, warps)
        for block_m, block_n, warps in itertools.product(
            _block_ms(tokens), (32, 64, 128, 256), (4, 8)
        )
    ]


def tiles_table(best: dict[int, tuple[lora.ShrinkTile, lora.ExpandTile]]) -> str:
    """kernels/lora.py's TILES with each bucket's tiles from its largest swept token count (the
    table's own where none was swept)."""
    lines = ["TILES: tuple[tuple[int, ShrinkTile, ExpandTile], ...] = ("]
    for bound, shrink, expand in lora.TILES:
        swept = [t for t in best if t <= bound]
        if swept:
            shrink, expand = best[max(swept)]
        lines.append(f"    ({'1 << 62' if bound == 1 << 62 else bound}, {shrink}, {expand}),")
    return "\n".join([*lines, ")"]) + "\n"


def check(data: Batch, shrink: lora.ShrinkTile, expand: lora.ExpandTile) -> None:
    """The tiles against the twin before they are kept (a fast wrong kernel is no result)."""
    a_b = next(data.adapters)
    a, b = a_b[: len(data.widths)], a_b[len(data.widths) :]
    base = torch.randn_like(data.out)
    got, want = base.clone(), base.clone()
    lora.add_lora_slices(data.x, a, b, data.used, got, data.offsets, shrink, expand)
    reference.add_lora_slices(data.x, a, b, data.used, want, data.offsets)
    delta, want_delta = (got - base).float(), (want - base).float()
    error = float((delta - want_delta).norm() / want_delta.norm().clamp(min=1e-30))
    if error > 2e-2:
        raise SystemExit(f"{shrink} {expand} is off the twin by {error:.3g} (relative norm)")


def layer_time(
    batches: dict[str, Batch], shrink: lora.ShrinkTile | None, expand: lora.ExpandTile | None
) -> float | None:
    """One layer's LoRA time: the sum over its projections, shrink's tile fitted to each one's
    K as the table's is (None: the table's tiles); None where a tile does not compile."""
    total = 0.0
    for data in batches.values():
        fitted = shrink and lora.fit_shrink_tile(shrink, SWEEP_RANK, data.k)
        try:
            total += graph_time(lora_call(data, data.used, fitted, expand), 16)
        except triton.runtime.errors.OutOfResources:
            return None  # more shared memory or registers than an SM has
    return total


def best_of(
    timed: list[tuple[float | None, lora.ShrinkTile, lora.ExpandTile]],
) -> list[tuple[float, lora.ShrinkTile, lora.ExpandTile]]:
    return sorted(
        ((us, shrink, expand) for us, shrink, expand in timed if us is not None),
        key=lambda row: row[0],
    )


def sweep(projections: list[str], tokens: list[int]) -> dict[str, object]:
    best: dict[int, tuple[lora.ShrinkTile, lora.ExpandTile]] = {}
    rows: dict[str, object] = {}
    for t in tokens:
        torch.cuda.empty_cache()
        batches = {p: batch(p, t, SWEEP_RANK, SWEEP_SLOTS) for p in projections}
        table_expand = lora.expand_tile_for(t)
        shrinks = best_of(
            [(layer_time(batches, s, table_expand), s, table_expand) for s in shrink_candidates(t)]
        )
        shrink = shrinks[0][1]
        expands = best_of(
            [(layer_time(batches, shrink, e), shrink, e) for e in expand_candidates(t)]
        )
        us, shrink, expand = expands[0]
        for data in batches.values():
            check(data, lora.fit_shrink_tile(shrink, SWEEP_RANK, data.k), expand)
        table_us = layer_time(batches, None, None)
        best[t] = (shrink, expand)
        rows[str(t)] = dict(us=us, table_us=table_us, shrink=asdict(shrink), expand=asdict(expand))
        sys.stdout.write(
            f"{t:5d} tokens  best {us:7.1f} us a layer  {shrink} {expand}  "
            f"(table's tiles {table_us or float('nan'):.1f} us)\n"
        )
        for next_us, next_shrink, _ in shrinks[1:4]:
            sys.stdout.write(f"{'':13s}next shrink {next_us:7.1f} us {next_shrink}\n")
        for next_us, _, next_expand in expands[1:3]:
            sys.stdout.write(f"{'':13s}next expand {next_us:7.1f} us {next_expand}\n")
    sys.stdout.write("TILES for kernels/lora.py (each bucket's largest swept token count):\n")
    sys.stdout.write(tiles_table(best))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("--projections", nargs="+", default=list(PROJECTIONS))
    parser.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    parser.add_argument("--ranks", type=int, nargs="+", default=list(RANKS))
    parser.add_argument("--slots", type=int, nargs="+", default=list(SLOTS))
    parser.add_argument("--sweep", action="store_true", help="time candidate tiles per bucket")
    parser.add_argument("--sweep-tokens", type=int, nargs="+", default=list(SWEEP_TOKENS))
    args = parser.parse_args()
    torch.manual_seed(0)
    sys.stdout.write(f"{torch.cuda.get_device_name()}  torch {torch.__version__}\n")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    meta = {"device": device_name(), "commit": git_commit(), "torch": torch.__version__}
    if args.sweep:
        best = sweep(args.projections, args.sweep_tokens)
        (args.out_dir / "lora_kernel_sweep.json").write_text(json.dumps({**meta, "best": best}))
        return 0
    sys.stdout.write("projection  tokens  rank  slots  gemm us  lora us  base-only us  lora/gemm\n")
    rows = []
    for projection, rank, num_slots, tokens in itertools.product(
        args.projections, args.ranks, args.slots, args.tokens
    ):
        row = measure(projection, tokens, rank, num_slots)
        rows.append(row)
        sys.stdout.write(
            f"{projection:10s} {tokens:7d} {rank:5d} {num_slots:6d} {row['gemm_us']:8.1f} "
            f"{row['lora_us']:8.1f} {row['lora_base_only_us']:13.1f} {row['overhead']:10.2f}\n"
        )
    record = {"date": time.strftime("%Y-%m-%d"), **meta, "rows": rows}
    (args.out_dir / "lora_kernel.json").write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
