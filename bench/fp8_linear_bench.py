"""Where an fp8 (W8A8) linear layer's time goes on the GPU, next to bf16: per-token activation
quantization, the cuBLASLt FP8 GEMM (row-wise scales; per-tensor scales for comparison), the
small-batch path (unscaled GEMM + Triton epilogue) and bf16 `F.linear`, at Llama-3-8B's shapes and
batch sizes from decode to prefill; then, for decode-sized batches, the one-kernel
`small_batch_linear` over a grid of tile configurations against the weight-read floor. Each op is
captured in a CUDA graph and replayed, so the times are GPU time, not launch cost.

    python bench/fp8_linear_bench.py
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable

import torch
from latency import copy_bandwidth

from kvfleet.engine.layers.fp8 import fp8_linear, quantize_rows
from kvfleet.kernels import fp8_quant

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}
BATCHES = (1, 8, 16, 32, 64, 256, 2048)
# small_batch_linear's tiles: (block_n, block_k, num_warps, num_stages).
TILES = list(itertools.product((16, 32), (256, 512, 1024), (4, 8), (3, 5)))


def graph_time(fn: Callable[[], object], replays: int = 50) -> float:
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


def row(m: int, k: int, w_bf16: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor) -> str:
    """One batch size: bf16 linear, the served fp8 path, and its parts."""
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    x_fp8, x_scale = fp8_quant.quantize_tokens(x)
    ws, one = w_scale.view(1, -1), torch.ones((), device="cuda")
    bf16 = graph_time(lambda: torch.nn.functional.linear(x, w_bf16))
    fp8 = graph_time(lambda: fp8_linear(x, w_fp8, w_scale, None, None))
    quant = graph_time(lambda: fp8_quant.quantize_tokens(x))

    def epilogue_path() -> torch.Tensor:
        xq, xs = fp8_quant.quantize_tokens(x)
        acc = torch._scaled_mm(xq, w_fp8.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
        return fp8_quant.scale_rows_cols(acc, xs, w_scale, None, x.dtype)

    epilogue = graph_time(epilogue_path)
    rowwise = graph_time(
        lambda: torch._scaled_mm(x_fp8, w_fp8.t(), scale_a=x_scale, scale_b=ws,
                                 out_dtype=torch.bfloat16)
    )  # fmt: skip
    tensorwise = graph_time(
        lambda: torch._scaled_mm(x_fp8, w_fp8.t(), scale_a=one, scale_b=one,
                                 out_dtype=torch.bfloat16)
    )  # fmt: skip
    return (
        f"{m:5d} {bf16:9.1f} {fp8:7.1f}  ({quant:7.1f} {rowwise:13.1f} {tensorwise:16.1f}"
        f" {epilogue:13.1f})"
    )


def tiles(
    m: int, k: int, n: int, w_fp8: torch.Tensor, w_scale: torch.Tensor, bandwidth: float
) -> str:
    """small_batch_linear's default tile and its best in TILES, against the weight-read floor
    (the fp8 weight's bytes at the copy bandwidth, bytes a second)."""
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    times = {
        tile: graph_time(
            lambda t=tile: fp8_quant.small_batch_linear(x, w_fp8, w_scale, None, None, *t)
        )
        for tile in TILES
    }
    default = graph_time(lambda: fp8_quant.small_batch_linear(x, w_fp8, w_scale, None, None))
    best = min(times, key=times.__getitem__)
    floor = n * k / bandwidth * 1e6
    return (
        f"{m:5d} floor {floor:6.1f} us; default {default:6.1f} us ({floor / default:4.0%}); "
        f"best {times[best]:6.1f} us ({floor / times[best]:4.0%}) at (block_n, block_k, warps, "
        f"stages) = {best}"
    )


def main() -> int:
    sys.stdout.write(f"{torch.cuda.get_device_name()}  torch {torch.__version__}\n")
    bandwidth = copy_bandwidth()
    sys.stdout.write(f"copy bandwidth: {bandwidth / 1e9:,.0f} GB/s\n")
    sys.stdout.write(
        "shape        M   bf16 us  fp8 us  (quant us  rowwise-mm us  tensorwise-mm us"
        "  epilogue-path us)\n"
    )
    weights = {}
    for name, (k, n) in SHAPES.items():
        w = torch.randn(n, k, device="cuda") * 0.02
        w_bf16 = w.to(torch.bfloat16)
        weights[name] = quantize_rows(w)
        del w
        for m in BATCHES:
            sys.stdout.write(f"{name:8s} {row(m, k, w_bf16, *weights[name])}\n")
    sys.stdout.write("small_batch_linear tiles:\n")
    for name, (k, n) in SHAPES.items():
        for m in (1, 8, fp8_quant.SMALL_BATCH_TOKENS):
            sys.stdout.write(f"{name:8s} {tiles(m, k, n, *weights[name], bandwidth)}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
