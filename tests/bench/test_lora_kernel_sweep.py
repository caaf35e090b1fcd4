"""bench/lora_kernel.py --sweep's CPU side: its candidate tiles and the TILES table it prints for
kernels/lora.py (the timing needs CUDA graphs, on the GPU: bench/gpu_run.sh lora-kernel-sweep)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

pytest.importorskip("triton")

from kvfleet.kernels import lora
from tests.support.scripts import load_bench_script

bench = load_bench_script("lora_kernel")


def test_candidates_fit_the_table_and_span_split_and_tile_sizes() -> None:
    decode = bench.shrink_candidates(1)
    assert {tile.block_m for tile in decode} == {16}  # taller blocks would be padding
    assert {tile.split_k for tile in decode} == {1, 2, 4, 8, 16}
    prefill = bench.shrink_candidates(2048)
    assert {tile.block_m for tile in prefill} == {16, 32, 64}
    assert {tile.split_k for tile in prefill} == {1, 2, 4}
    for tile in decode + prefill:
        # The table's fitting leaves a candidate as it is timed (K split capped only by K).
        assert lora.fit_shrink_tile(tile, bench.SWEEP_RANK, 1 << 20) == tile
    assert lora.ShrinkTile(64, 256, 1, 8) not in prefill  # 80 x 256 loads spill registers
    expands = bench.expand_candidates(32)
    assert {(e.block_m, e.num_warps) for e in expands} == {(16, 4), (16, 8), (32, 4), (32, 8)}
    assert {e.block_n for e in expands} == {32, 64, 128, 256}


def test_table_takes_each_buckets_largest_swept_tiles() -> None:
    fast = (lora.ShrinkTile(16, 128, 2, 4), lora.ExpandTile(16, 32, 8))
    wide = (lora.ShrinkTile(64, 64, 1, 8), lora.ExpandTile(64, 256, 8))
    slow = (lora.ShrinkTile(32, 64, 8, 4), lora.ExpandTile(32, 32, 4))
    text = bench.tiles_table({1: slow, 16: fast, 2048: wide})
    assert text.startswith("TILES: tuple[tuple[int, ShrinkTile, ExpandTile], ...] = (\n")
    table = eval(
        text.split("= ", 1)[1], dict(vars(lora))
    )  # the table as pasted into kernels/lora.py
    assert [row[0] for row in table] == [bound for bound, _, _ in lora.TILES]
    by_bound = {bound: (shrink, expand) for bound, shrink, expand in table}
    assert by_bound[16] == fast  # 16 tokens, not 1: the bucket's largest
    assert by_bound[32] == fast and by_bound[128] == fast
    assert by_bound[1 << 62] == wide
