"""Where an fp8 (W8A8) linear layer's time goes on the GPU, next to bf16: per-token activation
quantization, the cuBLASLt FP8 GEMM (row-wise scales; per-tensor scales for comparison), the
small-batch path (unscaled GEMM + Triton epilogue) and bf16 `F.linear`, at Llama-3-8B's shapes and
batch sizes from decode to prefill. Each op is captured in a CUDA graph and replayed, so the
times are GPU time, not launch cost; the replays cycle through copies of the weight that together
overflow the L2 cache (50 MB on an H100), as a decode step's distinct layers do, so a weight is
read from memory each time.

    python bench/fp8_linear_bench.py
    python bench/fp8_linear_bench.py --gemm-sweep   # kernels.fp8_gemm's tiles at decode sizes
"""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Callable, Iterator

import torch
import triton
from latency import copy_bandwidth

from kvfleet.engine.layers.fp8 import fp8_linear, quantize_rows
from kvfleet.kernels import fp8_gemm, fp8_quant

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}
BATCHES = (1, 8, 16, 32, 64, 256, 2048)
L2_BYTES = 50 << 20


def graph_time(fn: Callable[[], object], replays: int = 48) -> float:
    """Microseconds per call of fn, replayed from one CUDA graph holding `replays` calls."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(replays):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (5 * replays)


def copies(*tensors: torch.Tensor) -> Iterator[tuple[torch.Tensor, ...]]:
    """An endless cycle through enough copies of `tensors` to fill three L2 caches."""
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    count = -(-3 * L2_BYTES // nbytes)
    return itertools.cycle(
        [tensors] + [tuple(t.clone() for t in tensors) for _ in range(count - 1)]
    )


def row(m: int, k: int, w_bf16: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor) -> str:
    """One batch size: bf16 linear, the served fp8 path, and its parts."""
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    x_fp8, x_scale = fp8_quant.quantize_tokens(x)
    one = torch.ones((), device="cuda")
    bf16s, fp8s = copies(w_bf16), copies(w_fp8, w_scale)

    def bf16() -> torch.Tensor:
        return torch.nn.functional.linear(x, *next(bf16s))

    def served() -> torch.Tensor:
        return fp8_linear(x, *next(fp8s), None, None)

    def quant() -> tuple[torch.Tensor, torch.Tensor]:
        return fp8_quant.quantize_tokens(x)

    def epilogue() -> torch.Tensor:
        w, ws = next(fp8s)
        xq, xs = fp8_quant.quantize_tokens(x)
        acc = torch._scaled_mm(xq, w.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
        return fp8_quant.scale_rows_cols(acc, xs, ws, None, x.dtype)

    def rowwise() -> torch.Tensor:
        w, ws = next(fp8s)
        return torch._scaled_mm(
            x_fp8, w.t(), scale_a=x_scale, scale_b=ws.view(1, -1), out_dtype=torch.bfloat16
        )

    def tensorwise() -> torch.Tensor:
        w, _ = next(fp8s)
        return torch._scaled_mm(x_fp8, w.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)

    t = [graph_time(fn) for fn in (bf16, served, quant, rowwise, tensorwise, epilogue)]
    return f"{m:5d} {t[0]:9.1f} {t[1]:7.1f}  ({t[2]:7.1f} {t[3]:13.1f} {t[4]:16.1f} {t[5]:13.1f})"


def sweep_tiles(k: int, n: int) -> Iterator[fp8_gemm.GemmTile]:
    for block_n, block_k, split, warps, stages in itertools.product(
        (64, 128), (128, 256, 512), (1, 2, 3, 4, 6, 8), (4, 8), (4, 6)
    ):
        if k // block_k >= 2 * split and block_n * block_k <= 64 * 512 and warps * 16 <= block_n:
            yield fp8_gemm.GemmTile(block_n, block_k, split, warps, stages)


def gemm_sweep(bandwidth: float) -> None:
    """kernels.fp8_gemm at 1, 4 and 16 tokens, every tile of sweep_tiles: the default tile's time,
    the best tile's, and each against the fp8 weight-read floor and the cuBLASLt path it
    replaces (quantized input; unscaled GEMM + epilogue)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    sys.stdout.write(
        "shape      M  floor us  cublas+epilogue us  default tile us (tile)  best us (tile)\n"
    )
    one = torch.ones((), device="cuda")
    for name, (k, n) in SHAPES.items():
        w_fp8, w_scale = quantize_rows(torch.randn(n, k, device="cuda") * 0.02)
        floor = w_fp8.numel() / bandwidth * 1e6
        weights = copies(w_fp8, w_scale)
        for m in (1, 4, 16):
            x_fp8, x_scale = fp8_quant.quantize_tokens(
                torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            )

            def cublas(
                weights: Iterator[tuple[torch.Tensor, ...]] = weights,
                x_fp8: torch.Tensor = x_fp8,
                x_scale: torch.Tensor = x_scale,
            ) -> torch.Tensor:
                w, ws = next(weights)
                acc = torch._scaled_mm(
                    x_fp8, w.t(), scale_a=one, scale_b=one, out_dtype=torch.float32
                )
                return fp8_quant.scale_rows_cols(acc, x_scale, ws, None, torch.bfloat16)

            def gemm(
                tile: fp8_gemm.GemmTile | None,
                weights: Iterator[tuple[torch.Tensor, ...]] = weights,
                x_fp8: torch.Tensor = x_fp8,
                x_scale: torch.Tensor = x_scale,
            ) -> Callable[[], torch.Tensor]:
                def call() -> torch.Tensor:
                    w, ws = next(weights)
                    return fp8_gemm.small_batch_gemm(
                        x_fp8, x_scale, w, ws, None, torch.bfloat16, tile
                    )

                return call

            default = fp8_gemm.default_tile(n, k, sms)
            timed = []
            for tile in sweep_tiles(k, n):
                try:
                    timed.append((graph_time(gemm(tile)), tile))
                except triton.runtime.errors.OutOfResources:
                    continue  # more shared memory than an SM has
            timed.sort()
            best_t, best = timed[0]
            d = graph_time(gemm(None))
            sys.stdout.write(
                f"{name:8s} {m:3d} {floor:9.1f} {graph_time(cublas):19.1f} "
                f"{d:9.1f} ({floor / d:.0%}; {default})  {best_t:.1f} ({floor / best_t:.0%}; "
                f"{best})\n"
            )
            for t_us, tile in timed[1:4]:
                sys.stdout.write(f"{'':14s} next best {t_us:.1f} us {tile}\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--gemm-sweep", action="store_true", help="the decode GEMM's tiles")
    args = parser.parse_args()
    sys.stdout.write(f"{torch.cuda.get_device_name()}  torch {torch.__version__}\n")
    bandwidth = copy_bandwidth()
    sys.stdout.write(f"copy bandwidth: {bandwidth / 1e9:,.0f} GB/s\n")
    if args.gemm_sweep:
        gemm_sweep(bandwidth)
        return 0
    sys.stdout.write(
        "shape        M   bf16 us  fp8 us  (quant us  rowwise-mm us  tensorwise-mm us"
        "  epilogue-path us)\n"
    )
    for name, (k, n) in SHAPES.items():
        w = torch.randn(n, k, device="cuda") * 0.02
        w_bf16, (w_fp8, w_scale) = w.to(torch.bfloat16), quantize_rows(w)
        del w
        for m in BATCHES:
            sys.stdout.write(f"{name:8s} {row(m, k, w_bf16, w_fp8, w_scale)}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
