"""The attention kernels' machine code without a GPU: each kernel compiled by the installed Triton
for a CUDA target (sm_90 by default; ptxas ships with Triton), its loops disassembled, and per loop
the instruction count and the instructions that decide a memory-bound kernel's speed (tensor-core
dots, e4m3 conversions, byte-wide loads, asynchronous copies). What the fp8-cache decode kernel's
byte gathers cost was found this way (bench/RESULTS.md, issue 21); the GPU's own Triton may emit
somewhat different code.

    python bench/kernel_sass.py [--arch 90] [--cache fp8] [--json]
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kvfleet.kernels import paged_attention as pa

# Llama-3-8B's attention: 32 query heads over 8 KV heads of 128 dimensions, 16-token pages, bf16
# queries; the KV cache in bf16 or e4m3.
GROUP, HEAD_DIM, PAGE_SIZE = 4, 128, 16
WATCH = ("HMMA", "HGMMA", "F2FP.F16.E4M3", "LDS.U8", "LDG.E.U8", "STS.U16", "LDGSTS")
_INSTRUCTION = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_BRANCH = re.compile(r"BRA\s+0x([0-9a-f]+)")


def _signature(fn: triton.JITFunction, constexprs: dict, fp8: bool) -> tuple[dict, dict]:
    """Argument types as the launches pass them; pointers and strides 16-divisible, as Triton
    specializes them at real sizes."""
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            if name == "kv_ptr":
                sig[name] = "*fp8e4nv" if fp8 else "*bf16"
            elif name in ("q_ptr", "out_ptr"):
                sig[name] = "*bf16"
            else:
                sig[name] = "*fp32" if ("part" in name or "scale" in name) else "*i32"
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in ("scale", "soft_cap"):
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
            if name.startswith("stride"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, attrs


def _cases(fp8: bool) -> list[tuple[str, triton.JITFunction, dict, int, int]]:
    dot = tl.float16 if fp8 else tl.bfloat16
    block_n = pa._kv_tile_tokens(HEAD_DIM, 2)
    warps, stages = pa._FP8_DECODE_LAUNCH if fp8 else (4, 3)
    decode = dict(
        GROUP=GROUP, BLOCK_G=16, HEAD_DIM=HEAD_DIM, PAGE_SIZE=PAGE_SIZE, BLOCK_N=block_n,
        NUM_SPLITS=4, NUM_PARTS=4, HAS_PREFIX=False, HAS_SOFT_CAP=False, DOT_DTYPE=dot,
        KV_FP8=fp8, PDL=True,
    )  # fmt: skip
    prefix = dict(
        GROUP=GROUP, HEAD_DIM=HEAD_DIM, PAGE_SIZE=PAGE_SIZE, BLOCK_M=pa._PREFIX_BLOCK_M,
        BLOCK_N=block_n, NUM_SPLITS=4, PREFIX_SPLITS=4, HAS_SOFT_CAP=False, DOT_DTYPE=dot,
        KV_FP8=fp8, PDL=True,
    )  # fmt: skip
    block_m, big_n, big_warps, big_stages = pa.prefill_tile(2, fp8, HEAD_DIM)
    prefill = dict(
        GROUP=GROUP, GROUP_PAD=GROUP, BLOCK_M=block_m, BLOCK_N=big_n, HEAD_DIM=HEAD_DIM,
        PAGE_SIZE=PAGE_SIZE, HAS_SOFT_CAP=False, DOT_DTYPE=dot, BLOCK_SEQS=128, KV_FP8=fp8,
    )  # fmt: skip
    small = dict(prefill, BLOCK_M=16, BLOCK_N=block_n)
    return [
        ("decode split", pa._decode_split_kernel, decode, warps, stages),
        ("decode shared prefix", pa._decode_prefix_kernel, prefix, 4, 2),
        ("prefill, big tile", pa._prefill_kernel, prefill, big_warps, big_stages),
        ("prefill, 16-row tile", pa._prefill_kernel, small, 4, 2),
    ]


def loops(sass: str) -> list[collections.Counter]:
    """Opcode counts of each loop body (a backward branch's span), in address order."""
    code = [(int(m[1], 16), m[2]) for m in map(_INSTRUCTION.match, sass.splitlines()) if m]
    spans = sorted(
        (int(b[1], 16), addr)
        for addr, text in code
        if (b := _BRANCH.search(text)) and int(b[1], 16) < addr
    )
    return [
        collections.Counter(
            re.sub(r"^@!?U?P\w+\s+", "", text).split()[0] for addr, text in code if lo <= addr <= hi
        )
        for lo, hi in spans
    ]


def disassemble(fn, constexprs: dict, warps: int, stages: int, arch: int, fp8: bool) -> str:
    sig, attrs = _signature(fn, constexprs, fp8)
    src = ASTSource(fn, sig, constexprs=constexprs, attrs=attrs)
    kernel = triton.compile(
        src,
        target=GPUTarget("cuda", arch, 32),
        options={"num_warps": warps, "num_stages": stages},
    )
    cuobjdump = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        return subprocess.run(
            [str(cuobjdump), "-sass", cubin.name], capture_output=True, text=True, check=True
        ).stdout


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability x 10")
    parser.add_argument("--cache", choices=("bf16", "fp8", "both"), default="both")
    parser.add_argument("--json", action="store_true", help="one JSON object per loop")
    args = parser.parse_args(argv)
    if not args.json:
        print(f"Triton {triton.__version__}, sm_{args.arch}; per loop: instructions, then {WATCH}")
    for fp8 in {"bf16": (False,), "fp8": (True,), "both": (False, True)}[args.cache]:
        cache = "fp8" if fp8 else "bf16"
        for name, fn, constexprs, warps, stages in _cases(fp8):
            sass = disassemble(fn, constexprs, warps, stages, args.arch, fp8)
            for i, ops in enumerate(loops(sass)):
                watched = {w: sum(n for op, n in ops.items() if op.startswith(w)) for w in WATCH}
                if args.json:
                    row = {"cache": cache, "kernel": name, "loop": i}
                    print(json.dumps(row | {"instructions": sum(ops.values())} | watched))
                else:
                    print(
                        f"{cache:>4} {name:<22} loop {i}: {sum(ops.values()):5d}  "
                        + " ".join(f"{n:4d}" for n in watched.values())
                    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
