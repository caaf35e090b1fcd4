"""bench/kernel_sass.py compiles the attention kernels for Hopper on this CPU machine (Triton
ships ptxas): an FP8 cache's K/V tiles must reach the dot products without byte-wide loads. Those
were what held the fp8-cache decode kernel to 77-80% of copy bandwidth before the cache kept V
by dimension (bench/RESULTS.md, issue 21)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.scripts import ROOT

# Found, not imported: importing Triton before the interpreter tests set TRITON_INTERPRET would
# leave triton.language's own jitted helpers compiled-only, and those tests could not run them.
_TRITON = importlib.util.find_spec("triton")
if _TRITON is None or _TRITON.origin is None:
    pytest.skip("no Triton", allow_module_level=True)
if not (Path(_TRITON.origin).parent / "backends/nvidia/bin/cuobjdump").exists():
    pytest.skip("this Triton has no CUDA toolchain", allow_module_level=True)


def test_fp8_cache_loops_load_no_single_bytes() -> None:
    # A process of its own: the interpreter tests set TRITON_INTERPRET, which turns every kernel
    # imported after it into an interpreted one that cannot be compiled.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, "bench/kernel_sass.py", "--cache", "fp8", "--json"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=True,
    )  # fmt: skip
    rows = [json.loads(line) for line in run.stdout.splitlines()]
    assert {row["kernel"] for row in rows} == {
        "decode split", "decode shared prefix", "prefill, big tile", "prefill, 16-row tile",
    }  # fmt: skip
    for row in rows:
        assert row["F2FP.F16.E4M3"] > 0, row  # the loop widens e4m3 tiles: the fp8 path
        assert row["LDS.U8"] == 0 and row["LDG.E.U8"] == 0, row
    decode = [row for row in rows if row["kernel"] == "decode split"]
    assert len(decode) == 1 and decode[0]["HMMA"] > 0
