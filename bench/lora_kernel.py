"""What a LoRA batch adds to each projection on the GPU: the batched shrink + expand
(kvfleet.kernels.lora.add_lora_slices) against the base model's GEMM of the same projection, at
Llama-3.1-8B's shapes (qkv, o, gate/up, down), decode to prefill token counts, ranks 16 and 64,
8 and 16 slots.
Times are GPU time from CUDA-graph replays (fp8_linear_bench.graph_time) cycling through copies
of the weights and adapters that overflow the L2 cache, as a step's distinct layers do.

Each row: the base GEMM, LoRA over a batch whose tokens use every slot (decode: mixed token by
token; prefill: a run per adapter), LoRA over a batch of the base model only (what the kernels
cost when no request uses an adapter), and the overhead (LoRA / GEMM).

    python bench/lora_kernel.py --out-dir OUT        # OUT/lora_kernel.json and the table
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch
from common import device_name, git_commit
from fp8_linear_bench import copies, graph_time

from kvfleet.kernels import lora

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


def slot_map(tokens: int, num_slots: int) -> torch.Tensor:
    """Every slot in use: decode batches (up to 256 tokens) mix them token by token, a prefill
    batch holds one run per adapter."""
    if tokens <= 256:
        slots = torch.randperm(max(tokens, num_slots))[:tokens] % num_slots
    else:
        slots = torch.arange(tokens) * num_slots // tokens
    return slots.to(torch.int32).cuda()


def measure(projection: str, tokens: int, rank: int, num_slots: int) -> dict[str, object]:
    torch.cuda.empty_cache()  # the last row's weights, graphs and copies
    k, widths = PROJECTIONS[projection]
    n = sum(widths)
    dtype = torch.bfloat16
    x = torch.randn(tokens, k, device="cuda", dtype=dtype)
    out = torch.zeros(tokens, n, device="cuda", dtype=dtype)
    weights = copies(torch.randn(n, k, device="cuda", dtype=dtype) * 0.02)
    a = [torch.randn(num_slots, rank, k, device="cuda", dtype=dtype) * 0.02 for _ in widths]
    b = [torch.randn(num_slots, w, rank, device="cuda", dtype=dtype) * 0.02 for w in widths]
    adapters = copies(*a, *b)
    offsets = [sum(widths[:i]) for i in range(len(widths))]
    used = slot_map(tokens, num_slots)
    base_only = torch.full((tokens,), -1, dtype=torch.int32, device="cuda")

    def gemm() -> torch.Tensor:
        return torch.nn.functional.linear(x, *next(weights))

    def with_lora(slots: torch.Tensor) -> torch.Tensor:
        tensors = next(adapters)
        a_i, b_i = tensors[: len(widths)], tensors[len(widths) :]
        lora.add_lora_slices(x, a_i, b_i, slots, out, offsets)
        return out

    base_us = graph_time(gemm)
    lora_us = graph_time(lambda: with_lora(used))
    idle_us = graph_time(lambda: with_lora(base_only))
    return {
        "projection": projection,
        "tokens": tokens,
        "rank": rank,
        "slots": num_slots,
        "gemm_us": round(base_us, 2),
        "lora_us": round(lora_us, 2),
        "lora_base_only_us": round(idle_us, 2),
        "overhead": round(lora_us / base_us, 3),
        "shrink_tile": str(lora.shrink_tile_for(tokens, rank, k, x.element_size())),
        "expand_tile": str(lora.expand_tile_for(tokens)),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("--projections", nargs="+", default=list(PROJECTIONS))
    parser.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    args = parser.parse_args()
    torch.manual_seed(0)
    sys.stdout.write(f"{torch.cuda.get_device_name()}  torch {torch.__version__}\n")
    sys.stdout.write("projection  tokens  rank  slots  gemm us  lora us  base-only us  lora/gemm\n")
    rows = []
    for projection, rank, num_slots, tokens in itertools.product(
        args.projections, RANKS, SLOTS, args.tokens
    ):
        row = measure(projection, tokens, rank, num_slots)
        rows.append(row)
        sys.stdout.write(
            f"{projection:10s} {tokens:7d} {rank:5d} {num_slots:6d} {row['gemm_us']:8.1f} "
            f"{row['lora_us']:8.1f} {row['lora_base_only_us']:13.1f} {row['overhead']:10.2f}\n"
        )
    args.out_dir.mkdir(parents=True, exist_ok=True)
    record = {
        "date": time.strftime("%Y-%m-%d"),
        "device": device_name(),
        "commit": git_commit(),
        "torch": torch.__version__,
        "rows": rows,
    }
    (args.out_dir / "lora_kernel.json").write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
