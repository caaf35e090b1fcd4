"""The grammar-mask Triton kernel against its PyTorch twin, on the CPU through Triton's interpreter
(small sizes; bench/kernel_test_gpu.py checks a real vocabulary on a GPU). Logits start with NaN
and -inf among them: the kernel only stores, so every allowed logit must come back bit for bit."""

from __future__ import annotations

import os

# Must precede the first import of triton: kernels pick interpreter or compiler when decorated.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

pytest.importorskip("triton")

from kvfleet.kernels import reference
from kvfleet.kernels.grammar_mask import BLOCK_WORDS, apply_token_bitmask

ALL_ALLOWED = -1


def _logits(rows: int, vocab: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen)
    logits[:, ::7] = float("-inf")  # already banned (a logit_bias, an earlier mask)
    logits[:, 3::11] = float("nan")  # never read, so never changed where allowed
    return logits.to(dtype)


def _bitmask(rows: int, words: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-(2**31), 2**31, (rows, words), generator=gen, dtype=torch.int64).int()


def _check(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    want = logits.clone()
    reference.apply_token_bitmask(want, bitmask)
    apply_token_bitmask(logits, bitmask)
    assert torch.equal(logits.isnan(), want.isnan())
    assert torch.equal(logits.nan_to_num(0.0), want.nan_to_num(0.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "vocab",
    [
        1,
        31,
        32,
        100,  # not a multiple of 32
        BLOCK_WORDS * 32,  # exactly one program a row
        BLOCK_WORDS * 32 + 17,  # a second program holding a partial word
        2 * BLOCK_WORDS * 32 - 32,  # a second program short of whole words
    ],
)
def test_matches_reference(vocab: int, dtype: torch.dtype) -> None:
    rows = 5
    words = -(-vocab // 32)
    bitmask = _bitmask(rows, words, seed=vocab)
    bitmask[1] = ALL_ALLOWED
    bitmask[2] = 0  # every token banned
    bitmask[3, 0] = 1  # token 0 alone (or nothing past it) allowed in its first word
    logits = _logits(rows, vocab, dtype, seed=vocab)
    before = logits.clone()
    _check(logits, bitmask)
    assert torch.equal(logits[1].nan_to_num(0.0), before[1].nan_to_num(0.0))
    assert (logits[2] == float("-inf")).all()


def test_wider_bitmask_ignores_bits_past_the_vocabulary() -> None:
    vocab, rows = 70, 3
    bitmask = _bitmask(rows, 10, seed=1)  # room for 320 tokens
    bitmask[:, 3:] = 0  # would ban everything past token 96, if read
    logits = _logits(rows, vocab, torch.float32, seed=1)
    _check(logits, bitmask)
    # A bitmask row stride of its own: a slice of a wider buffer.
    buffer = _bitmask(rows, 40, seed=2)
    logits = _logits(rows, vocab, torch.float32, seed=2)
    _check(logits, buffer[:, 5:10])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_strided_logits_and_nothing_outside_them_written(dtype: torch.dtype) -> None:
    rows, vocab = 4, 200
    # Every other row of a wider tensor, columns from 9 on: the row stride is 2 * 260.
    big = _logits(2 * rows, 260, dtype, seed=3)
    logits = big[::2, 9 : 9 + vocab]
    assert not logits.is_contiguous()
    untouched = big.clone()
    bitmask = _bitmask(rows, -(-vocab // 32), seed=3)
    want = logits.clone()
    reference.apply_token_bitmask(want, bitmask)
    apply_token_bitmask(logits, bitmask)
    assert torch.equal(logits.nan_to_num(0.0), want.nan_to_num(0.0))
    outside = torch.ones_like(big, dtype=torch.bool)
    outside[::2, 9 : 9 + vocab] = False
    assert torch.equal(big[outside].nan_to_num(0.0), untouched[outside].nan_to_num(0.0))
    # Transposed storage (a column stride other than 1) as well.
    logits_t = _logits(vocab, rows, dtype, seed=4).t()
    _check(logits_t, bitmask)


def test_no_rows_is_a_no_op() -> None:
    apply_token_bitmask(torch.empty(0, 50), torch.empty(0, 2, dtype=torch.int32))


@pytest.mark.parametrize(
    ("logits", "bitmask", "message"),
    [
        (torch.zeros(2, 64), torch.zeros(2, 1, dtype=torch.int32), r"needs shape \[2, >= 2\]"),
        (torch.zeros(2, 64), torch.zeros(3, 2, dtype=torch.int32), r"needs shape \[2, >= 2\]"),
        (torch.zeros(2, 64), torch.zeros(2, 2, dtype=torch.int64), "must be int32"),
        (torch.zeros(2, 64, dtype=torch.int32), torch.zeros(2, 2, dtype=torch.int32), "float32"),
        (torch.zeros(64), torch.zeros(2, dtype=torch.int32), "must be 2-D"),
    ],
)
def test_bad_inputs_are_clear_errors(logits, bitmask, message) -> None:
    with pytest.raises(ValueError, match=message):
        apply_token_bitmask(logits, bitmask)
