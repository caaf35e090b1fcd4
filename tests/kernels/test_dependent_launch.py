"""The decode GEMM's L2 prefetch size (a pure function of the launch's shape)."""

from __future__ import annotations

import os

# Before triton is imported: the module's jitted helpers must be the interpreter's for the
# kernel tests collected after this file.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from kvfleet.kernels.dependent_launch import LINE, prefetch_columns


@pytest.mark.parametrize(
    ("k", "rows", "programs", "budget", "want"),
    [
        (4096, 64, 96, 24 << 20, 4096),  # Llama-3-8B qkv: whole rows fit the budget
        (4096, 64, 448, 24 << 20, 512),  # gate_up: 877 columns a row fit, a power of two of lines
        (14336, 64, 64, 24 << 20, 4096),  # down: 6,144 fit
        (4000, 64, 1, 24 << 20, 2048),  # never past k (4,000 = 31.25 lines)
        (4096, 64, 10_000, 24 << 20, 0),  # under a line a row: none
    ],
)
def test_prefetch_columns(k, rows, programs, budget, want):
    got = prefetch_columns(k, rows, programs, budget)
    assert got == want
    if got:
        lines = got // LINE
        assert got % LINE == 0 and lines & (lines - 1) == 0
        assert got <= k and got * rows * programs <= budget
