"""Batched LoRA's Triton kernels against their PyTorch twins in the interpreter: tiny sizes, fp32
activations with bf16 adapters loaded and computed in fp32 (the interpreter's bf16 dot is
wrong), mixed slots and the base model, partial token, K and column blocks, several slices at
offsets. The real sizes, in a CUDA graph too, are in test_lora_gpu.py."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

pytest.importorskip("triton")

from kvfleet.kernels import lora, reference
from tests.support.lora_batches import RANK, SLOT_MAP, adapters, row_by_row


@pytest.mark.parametrize(
    ("k", "tile", "stacked"),
    [
        (96, lora.ShrinkTile(16, 32, 1), False),  # one program per token block and slot
        # 5 K tiles over 3 splits (2, 2, 1), a partial K tile; the slices as views of one
        # stacked A [S, 3R, K], as a layer may hold them.
        (160, lora.ShrinkTile(16, 32, 3), True),
    ],
)
def test_shrink_kernel_matches_twin(k, tile, stacked, monkeypatch):
    monkeypatch.setattr(lora, "shrink_tile", lambda *_: tile)
    gen = torch.Generator().manual_seed(k)
    x = torch.randn(len(SLOT_MAP) + 9, k, generator=gen)  # 20 tokens: a partial token block
    slots = torch.tensor(SLOT_MAP + SLOT_MAP[:9], dtype=torch.int32)
    # bf16 adapters on fp32 activations: loaded as bf16, computed in fp32.
    a_slices = [adapters(8, k, 20 + i, torch.bfloat16)[0] for i in range(3)]
    if stacked:
        a_slices = list(torch.cat(a_slices, dim=1).split(RANK, dim=1))
    got = lora.lora_shrink_slices(x, a_slices, slots)
    want = reference.lora_shrink_slices(x, a_slices, slots)
    assert got.shape == want.shape == (3, len(slots), RANK) and got.dtype == x.dtype
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert not got[:, slots == -1].any()


def test_expand_kernel_matches_twin_with_slices_at_offsets(monkeypatch):
    # qkv-like slices of unequal widths (24, 40 and 8 columns: partial column blocks) at
    # offsets into a wider output, 20 tokens over two token blocks; y a strided view of one
    # [T, 3R] shrink, as a stacked A gives it.
    monkeypatch.setattr(lora, "expand_tile", lambda *_: lora.ExpandTile(16, 16))
    gen = torch.Generator().manual_seed(7)
    slots = torch.tensor(SLOT_MAP + SLOT_MAP[:9], dtype=torch.int32)
    t, widths, offsets = len(slots), [24, 40, 8], [3, 30, 72]
    y = torch.randn(t, 3, RANK, generator=gen).transpose(0, 1)
    y[:, slots == 1, 8:] = 0  # as the rank-8 adapter's shrink leaves them
    bs = [adapters(n, 8, 30 + i)[1] for i, n in enumerate(widths)]
    out = torch.randn(t, 84, generator=gen)
    want = out.clone()
    reference.lora_expand_slices(y, bs, slots, want, offsets)
    lora.lora_expand_slices(y, bs, slots, out, offsets)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def test_kernels_refuse_columns_outside_the_output_and_ranks_past_their_tiles():
    y = torch.zeros(1, 2, RANK)
    b = adapters(8, 8, 0)[1]
    slots = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="outside"):
        lora.lora_expand_slices(y, [b], slots, torch.zeros(2, 12), [5])
    wide = torch.zeros(1, lora.MAX_RANK + 1, 16)
    with pytest.raises(ValueError, match="ranks up to"):
        lora.lora_shrink(torch.zeros(2, 16), wide, slots)


def test_kernels_with_every_token_on_the_base_model_change_nothing():
    a, b = adapters(32, 64, 8)
    x = torch.randn(5, 64)
    slots = torch.full((5,), -1, dtype=torch.int32)
    y = lora.lora_shrink(x, a, slots)
    assert y.shape == (5, RANK) and not y.any()
    out = torch.randn(5, 32)
    before = out.clone()
    lora.lora_expand(torch.randn(5, RANK), b, slots, out)
    assert torch.equal(out, before)


def test_single_slice_kernels_run_one_projection_end_to_end():
    gen = torch.Generator().manual_seed(9)
    a, b = adapters(48, 64, 11)
    x = torch.randn(len(SLOT_MAP), 64, generator=gen)
    slots = torch.tensor(SLOT_MAP, dtype=torch.int32)
    out = torch.randn(len(SLOT_MAP), 48, generator=gen)
    want = row_by_row(x, a, b, slots, out)
    lora.lora_expand(lora.lora_shrink(x, a, slots), b, slots, out)
    torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-4)


def test_tiles_come_from_the_token_count_and_rank():
    # Decode batches split K (A's bytes spread over the SMs); prefill does not.
    assert lora.shrink_tile(1, 16, 4096) == lora.ShrinkTile(16, 256, 8)
    assert lora.shrink_tile(64, 64, 14336).split_k == 4
    assert lora.shrink_tile(2048, 16, 4096).split_k == 1
    assert lora.shrink_tile(1, 16, 300).split_k == 1  # too short a K to split
    assert lora.shrink_tile(1, 64, 4096).block_k == 128  # a wide rank's A tile
    assert lora.shrink_tile(1, 16, 4096, itemsize=4).block_k == 64  # fp32's bytes
    assert lora.expand_tile(1, 16).block_m == 16 and lora.expand_tile(2048, 64).block_m == 64
