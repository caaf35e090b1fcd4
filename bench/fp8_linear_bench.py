"""Where an fp8 (W8A8) linear layer's time goes on the GPU, next to bf16: per-token activation
quantization, the cuBLASLt FP8 GEMM (row-wise scales, as served; per-tensor scales for
comparison) and bf16 `F.linear`, at Llama-3-8B's shapes and batch sizes from decode to prefill.
Each op is captured in a CUDA graph and replayed, so the times are GPU time, not launch cost.

    python bench/fp8_linear_bench.py
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch

from kvfleet.engine.layers.fp8 import fp8_linear, quantize_rows, quantize_tokens

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}
BATCHES = (1, 8, 64, 256, 2048)


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
    x_fp8, x_scale = quantize_tokens(x)
    ws, one = w_scale.view(1, -1), torch.ones((), device="cuda")
    bf16 = graph_time(lambda: torch.nn.functional.linear(x, w_bf16))
    fp8 = graph_time(lambda: fp8_linear(x, w_fp8, w_scale, None, None))
    quant = graph_time(lambda: quantize_tokens(x))
    rowwise = graph_time(
        lambda: torch._scaled_mm(x_fp8, w_fp8.t(), scale_a=x_scale, scale_b=ws,
                                 out_dtype=torch.bfloat16)
    )  # fmt: skip
    tensorwise = graph_time(
        lambda: torch._scaled_mm(x_fp8, w_fp8.t(), scale_a=one, scale_b=one,
                                 out_dtype=torch.bfloat16)
    )  # fmt: skip
    return f"{m:5d} {bf16:9.1f} {fp8:7.1f}  ({quant:7.1f} {rowwise:13.1f} {tensorwise:16.1f})"


def main() -> int:
    sys.stdout.write(f"{torch.cuda.get_device_name()}  torch {torch.__version__}\n")
    sys.stdout.write(
        "shape        M   bf16 us  fp8 us  (quant us  rowwise-mm us  tensorwise-mm us)\n"
    )
    for name, (k, n) in SHAPES.items():
        w = torch.randn(n, k, device="cuda") * 0.02
        w_bf16 = w.to(torch.bfloat16)
        w_fp8, w_scale = quantize_rows(w)
        del w
        for m in BATCHES:
            sys.stdout.write(f"{name:8s} {row(m, k, w_bf16, w_fp8, w_scale)}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
