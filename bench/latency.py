"""Batch-1 decode latency next to the memory floor: every decode step must read all weights
once, so time per output token cannot beat weight bytes / memory bandwidth. The bandwidth is
measured in the same run with a device-to-device copy. With --quantization fp8 the linear
layers' weights count one byte each (their fp32 scales, the bf16 embeddings, LM head and norms
as they are): the fp8 floor. A mixture of experts' token reads only its top-k experts of each
layer: the experts' bytes count top_k / num_experts of them (this rank's share either way,
experts split or placed per rank).

    python bench/latency.py --model bench/models/Llama-3.1-8B --load-format dummy
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import device_name, git_commit, random_workload, sync

from kvfleet.engine import LLM, SamplingParams

logger = logging.getLogger("bench.latency")


def copy_bandwidth(nbytes: int = 4 << 30, repeats: int = 10) -> float:
    """Bytes moved per second (read + write) by a large device-to-device copy."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / statistics.median(times)


def bytes_one_token_reads(model: torch.nn.Module) -> float:
    """Every weight, but of each layer's experts only the share one token's top-k reads."""
    from kvfleet.engine.layers.moe import FusedMoE

    total = 0.0
    experts = set()
    for module in model.modules():
        if isinstance(module, FusedMoE):
            share = module.top_k / module.num_experts
            for p in module.parameters():
                experts.add(id(p))
                total += p.numel() * p.element_size() * share
    total += sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in experts)
    return total


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--load-format", default="dummy", choices=["auto", "dummy"])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the engine's loop: the next step launched before the last one's tokens are read",
    )
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        help="a mixture of experts' experts placed whole per rank, not each one split",
    )
    p.add_argument("--quantization", choices=["fp8"], default=None, help="fp8: W8A8 weights")
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="the prefix cache (off by default: each timed run computes its prompt)",
    )
    p.add_argument(
        "--cpu-kv-cache-bytes",
        default="0",
        help="the host KV tier's size (needs --enable-prefix-caching): its cost to a decode step",
    )
    p.add_argument("--profile", action="store_true", help="cProfile one timed run (host time)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

    bandwidth = copy_bandwidth()
    llm = LLM(
        model=args.model,
        load_format=args.load_format,
        dtype=args.dtype,
        skip_tokenizer_init=True,
        max_model_len=args.max_model_len,
        max_num_seqs=8,
        enforce_eager=args.enforce_eager,
        enable_prefix_caching=args.enable_prefix_caching,
        cpu_kv_cache_bytes=args.cpu_kv_cache_bytes,
        tensor_parallel_size=args.tensor_parallel_size,
        enable_expert_parallel=args.enable_expert_parallel,
        quantization=args.quantization,
        async_scheduling=args.async_scheduling,
    )
    weight_bytes = bytes_one_token_reads(llm.engine.runner.model)
    vocab = llm.engine.vocab_size
    prompt = {
        "prompt_token_ids": random_workload(1, (args.input_len,) * 2, (1, 1), vocab, 0).prompts[0]
    }

    def timed(max_tokens: int) -> float:
        sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        sync()
        start = time.perf_counter()
        llm.generate(prompt, sp)
        sync()
        return time.perf_counter() - start

    timed(args.output_len)  # warm-up
    prefill = statistics.median(timed(1) for _ in range(args.repeats))
    full = statistics.median(timed(args.output_len) for _ in range(args.repeats))
    tpot = (full - prefill) / (args.output_len - 1)
    if args.profile:
        import cProfile
        import io
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        timed(args.output_len)
        prof.disable()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
        sys.stdout.write(buf.getvalue())
    floor = weight_bytes / bandwidth
    sys.stdout.write(
        f"device: {device_name()}  commit: {git_commit()}\n"
        f"weights one token reads: {weight_bytes / 2**30:.2f} GiB; "
        f"copy bandwidth: {bandwidth / 1e9:,.0f} GB/s\n"
        f"memory floor per token: {floor * 1e3:.3f} ms\n"
        f"batch-1 TPOT: {tpot * 1e3:.3f} ms ({tpot / floor:.2f}x the floor); "
        f"TTFT (prefill {args.input_len} tokens + 1 decode): {prefill * 1e3:.1f} ms\n"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
