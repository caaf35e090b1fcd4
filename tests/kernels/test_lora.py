"""Batched LoRA's Triton kernels against their PyTorch twin in the interpreter: tiny sizes, fp32
activations with bf16 adapters loaded and computed in fp32 (the interpreter's bf16 dot is
wrong), mixed slots and the base model, partial token, K and column blocks, 1-3 slices at
offsets, K split or not. The real sizes, in a CUDA graph too, are in test_lora_gpu.py."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

pytest.importorskip("triton")

from kvfleet.kernels import lora, reference
from tests.support.lora_batches import RANK, SLOT_MAP, adapters, row_by_row

# 20 tokens: two token blocks of 16, the second partial.
SLOTS_20 = torch.tensor(SLOT_MAP + SLOT_MAP[:9], dtype=torch.int32)


@pytest.mark.parametrize(
    ("k", "rank", "widths", "shrink", "expand"),
    [
        # One program per token block and slot; q, k, v-like slices of unequal widths (partial
        # column blocks), their A views of one stacked [S, 3R, K].
        (96, RANK, [24, 40, 8], lora.ShrinkTile(16, 32, 1), lora.ExpandTile(16, 16)),
        # 5 K tiles over 3 splits (2, 2, 1), a partial K tile; gate, up-like slices.
        (160, RANK, [16, 40], lora.ShrinkTile(16, 32, 3), lora.ExpandTile(16, 32)),
        # Rank 8 (a 16-wide rank tile, half masked); 3 K tiles over 4 splits, the last empty
        # (its partials zero); one slice.
        (80, 8, [40], lora.ShrinkTile(16, 32, 4), lora.ExpandTile(16, 16)),
    ],
)
def test_kernels_match_twin(k, rank, widths, shrink, expand):
    gen = torch.Generator().manual_seed(k)
    x = torch.randn(len(SLOTS_20), k, generator=gen)
    # bf16 adapters on fp32 activations: loaded as bf16, computed in fp32.
    pairs = [adapters(n, k, 20 + i, torch.bfloat16) for i, n in enumerate(widths)]
    stacked = torch.cat([a[:, :rank] for a, _ in pairs], dim=1)
    a_slices = list(stacked.split(rank, dim=1))
    b_slices = [b[:, :, :rank] for _, b in pairs]
    offsets = [3 + sum(widths[:i]) for i in range(len(widths))]
    base_out = torch.randn(len(SLOTS_20), offsets[-1] + widths[-1] + 5, generator=gen)
    out, want = base_out.clone(), base_out.clone()
    lora.add_lora_slices(x, a_slices, b_slices, SLOTS_20, out, offsets, shrink, expand)
    reference.add_lora_slices(x, a_slices, b_slices, SLOTS_20, want, offsets)
    torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-4)
    assert torch.equal(out[SLOTS_20 == -1], base_out[SLOTS_20 == -1])
    assert not torch.equal(out[SLOTS_20 >= 0], base_out[SLOTS_20 >= 0])


def test_a_projection_is_two_launches_with_k_split(monkeypatch):
    # Expand sums shrink's split partials itself: nothing is launched between the two.
    from triton.runtime.interpreter import InterpretedFunction

    launched = []
    run = InterpretedFunction.run

    def counted(self, *args, grid, **kwargs):
        launched.append((self.fn.__name__, tuple(grid)))
        return run(self, *args, grid=grid, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", counted)
    a, b = adapters(16, 64, 4)
    x = torch.randn(3, 64)
    out = torch.zeros(3, 16)
    slots = torch.tensor([0, 2, -1], dtype=torch.int32)
    lora.add_lora_slices(x, [a], [b], slots, out, [0], lora.ShrinkTile(16, 16, 2))
    assert launched == [("_shrink_kernel", (1, 3, 2)), ("_expand_kernel", (1, 1))]


def test_kernels_refuse_mismatched_slices_columns_outside_the_output_and_wide_ranks():
    a, b = adapters(8, 16, 0)
    x, slots = torch.zeros(2, 16), torch.zeros(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="outside"):
        lora.add_lora_slices(x, [a], [b], slots, torch.zeros(2, 12), [5])
    with pytest.raises(ValueError, match="as many of B"):
        lora.add_lora_slices(x, [a, a], [b], slots, torch.zeros(2, 16), [0, 8])
    with pytest.raises(ValueError, match="1-3 slices"):
        lora.add_lora_slices(x, [a] * 4, [b] * 4, slots, torch.zeros(2, 32), [0, 8, 16, 24])
    wide = torch.zeros(1, lora.MAX_RANK + 1, 16)
    with pytest.raises(ValueError, match="ranks up to"):
        lora.add_lora_slices(x, [wide], [torch.zeros(1, 8, lora.MAX_RANK + 1)], slots,
                             torch.zeros(2, 8), [0])  # fmt: skip


def test_kernels_with_every_token_on_the_base_model_change_nothing():
    a, b = adapters(32, 64, 8)
    x = torch.randn(5, 64)
    slots = torch.full((5,), -1, dtype=torch.int32)
    out = torch.randn(5, 32)
    before = out.clone()
    lora.add_lora_slices(x, [a], [b], slots, out, [0], lora.ShrinkTile(16, 16, 2))
    assert torch.equal(out, before)


def test_table_tiles_run_one_projection_end_to_end():
    # The token count's own tiles (K split over programs), row by row as LoRA is written.
    gen = torch.Generator().manual_seed(9)
    a, b = adapters(48, 256, 11)
    x = torch.randn(len(SLOT_MAP), 256, generator=gen)
    slots = torch.tensor(SLOT_MAP, dtype=torch.int32)
    assert lora.shrink_tile_for(len(slots), RANK, 256, x.element_size()).split_k > 1
    out = torch.randn(len(SLOT_MAP), 48, generator=gen)
    want = row_by_row(x, a, b, slots, out)
    lora.add_lora_slices(x, [a], [b], slots, out, [0])
    torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-4)


def test_tiles_come_from_the_token_count_and_rank():
    # Decode batches split K wider (A's bytes spread over the SMs) than prefill.
    assert lora.shrink_tile_for(1, 16, 4096) == lora.ShrinkTile(16, 128, 16)
    assert lora.shrink_tile_for(64, 64, 14336).split_k == 8
    assert lora.shrink_tile_for(2048, 16, 4096).split_k == 4
    assert lora.shrink_tile_for(1, 16, 300).split_k == 1  # too short a K to split
    assert lora.shrink_tile_for(1, 64, 4096).block_k == 64  # a wide rank's A tile
    assert lora.shrink_tile_for(1, 16, 4096, itemsize=4).block_k == 32  # fp32's bytes
    assert lora.expand_tile_for(1).block_n == 32 and lora.expand_tile_for(2048).block_n == 256
    # The table's own tiles are used as they are at its rank and dtype.
    for bound, shrink, _ in lora.TILES:
        fitted = lora.shrink_tile_for(bound, 16, 1 << 20)
        assert fitted == shrink, bound
