"""Programmatic dependent launch: the decode GEMM's L2 prefetch size (a pure function of the
launch's shape), and every kernel that takes part waiting for the one before."""

from __future__ import annotations

import ast
import os
from pathlib import Path

# Before triton is imported: the module's jitted helpers must be the interpreter's for the
# kernel tests collected after this file.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from kvfleet.kernels.dependent_launch import LINE, prefetch_columns

KERNELS = Path(__file__).resolve().parents[2] / "kernels"


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


def _kernels_with_pdl() -> list[tuple[str, ast.FunctionDef]]:
    found = []
    for path in sorted(KERNELS.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and "PDL" in {a.arg for a in node.args.args}:
                found.append((f"{path.name}:{node.name}", node))
    return found


def test_every_kernel_launched_with_pdl_waits_for_the_one_before_unconditionally():
    """A kernel launched with PDL that read or wrote memory before waiting would race with the
    kernel before it: every kernel taking the PDL flag calls enter(PDL) or wait_for_prior(PDL)
    in its own body, not under a condition (only the GEMM's weight prefetch may precede it)."""
    kernels = _kernels_with_pdl()
    helpers = {"enter", "wait_for_prior", "allow_dependents"}
    launched = [(name, fn) for name, fn in kernels if fn.name not in helpers]
    assert len(launched) >= 9, [name for name, _ in kernels]  # the decode path's kernels
    for name, fn in launched:
        waits = [
            stmt
            for stmt in fn.body
            if isinstance(stmt, ast.Expr)
            and isinstance(stmt.value, ast.Call)
            and getattr(stmt.value.func, "id", None) in {"enter", "wait_for_prior"}
        ]
        assert waits, f"{name} takes PDL but does not wait for the kernel before it"
