"""Batched LoRA's PyTorch twins (the CPU path and the kernels' oracle) against LoRA written out
row by row: a batch mixing adapters of ranks 8 and 16 (padded to 16) and the base model."""

from __future__ import annotations

import torch

from kvfleet.kernels import reference
from tests.support.lora_batches import RANK, SLOT_MAP, adapters, row_by_row


def test_twins_apply_each_tokens_adapter_and_leave_base_rows():
    t, k, n = len(SLOT_MAP), 24, 20
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(t, k, generator=gen)
    a, b = adapters(n, k, 1)
    slots = torch.tensor(SLOT_MAP, dtype=torch.int32)
    out = torch.randn(t, 5 + n + 3, generator=gen)
    before = out.clone()
    y = reference.lora_shrink(x, a, slots)
    assert y.shape == (t, RANK) and y.dtype == x.dtype
    assert not y[slots == -1].any()
    assert not y[slots == 1, 8:].any()  # the rank-8 adapter's padding
    reference.lora_expand(y, b, slots, out, offset=5)
    want = row_by_row(x, a, b, slots, before[:, 5 : 5 + n])
    torch.testing.assert_close(out[:, 5 : 5 + n], want, atol=1e-5, rtol=1e-5)
    assert torch.equal(out[:, :5], before[:, :5]) and torch.equal(
        out[:, 5 + n :], before[:, 5 + n :]
    )
    assert torch.equal(out[slots == -1], before[slots == -1])


def test_twins_round_once_to_the_activation_dtype():
    t, k, n = len(SLOT_MAP), 32, 16
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(t, k, generator=gen).to(torch.bfloat16)
    a, b = adapters(n, k, 3, torch.bfloat16)
    slots = torch.tensor(SLOT_MAP, dtype=torch.int32)
    y = reference.lora_shrink(x, a, slots)
    assert y.dtype == torch.bfloat16
    want_y = torch.stack(
        [
            x[i].float() @ a[s].float().T if s >= 0 else torch.zeros(RANK)
            for i, s in enumerate(SLOT_MAP)
        ]
    ).to(torch.bfloat16)
    assert torch.equal(y, want_y)
    out = torch.randn(t, n, generator=gen).to(torch.bfloat16)
    before = out.clone()
    reference.lora_expand(y, b, slots, out)
    want = torch.stack(
        [
            (before[i].float() + y[i].float() @ b[s].float().T) if s >= 0 else before[i].float()
            for i, s in enumerate(SLOT_MAP)
        ]
    ).to(torch.bfloat16)
    assert torch.equal(out, want)


def test_slice_twins_are_the_single_twins_per_slice():
    # A fused qkv: q 16 columns, k and v 8 each, every slice with its own adapters.
    t, k, widths = len(SLOT_MAP), 24, [16, 8, 8]
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(t, k, generator=gen)
    pairs = [adapters(n, k, 10 + i) for i, n in enumerate(widths)]
    slots = torch.tensor(SLOT_MAP, dtype=torch.int32)
    y = reference.lora_shrink_slices(x, [a for a, _ in pairs], slots)
    assert y.shape == (3, t, RANK)
    out = torch.randn(t, sum(widths), generator=gen)
    before = out.clone()
    reference.lora_expand_slices(y, [b for _, b in pairs], slots, out, [0, 16, 24])
    for (a, b), start, n in zip(pairs, [0, 16, 24], widths, strict=True):
        want = row_by_row(x, a, b, slots, before[:, start : start + n])
        torch.testing.assert_close(out[:, start : start + n], want, atol=1e-5, rtol=1e-5)


def test_twins_with_no_adapter_in_the_batch_change_nothing():
    a, b = adapters(8, 16, 5)
    x = torch.randn(4, 16)
    slots = torch.full((4,), -1, dtype=torch.int32)
    out = torch.randn(4, 8)
    before = out.clone()
    reference.lora_expand(reference.lora_shrink(x, a, slots), b, slots, out)
    assert torch.equal(out, before)
