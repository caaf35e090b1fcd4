"""Where one engine step's time goes: wall time per decode step at a fixed batch, split into the
host's share (scheduling, input preparation, output processing) and the GPU's, plus the top CUDA
kernels from torch.profiler.

    python bench/profile_step.py --model bench/models/Qwen3-0.6B --batch 128 --context 1024
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import device_name, random_workload

from kvfleet.engine import LLM, SamplingParams


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--max-model-len", type=int, default=4096)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)

    llm = LLM(
        model=args.model,
        load_format="dummy",
        dtype="bfloat16",
        skip_tokenizer_init=True,
        max_model_len=args.max_model_len,
        max_num_seqs=max(args.batch, 8),
    )
    core = llm.engine
    work = random_workload(args.batch, (args.context,) * 2, (1, 1), core.vocab_size, 0)
    sp = SamplingParams(temperature=0, max_tokens=args.steps * 3, ignore_eos=True)
    for i, prompt in enumerate(work.prompts):
        core.add_request(str(i), core.admit(prompt, sp))
    while any(r.num_output_tokens == 0 for r in core.scheduler.requests.values()):
        core.step()  # prefill everything first: what follows are pure decode steps

    def timed_steps(n: int) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(n):
            core.step()
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / n

    timed_steps(5)
    wall = timed_steps(args.steps)
    runner = core.runner
    original = runner.execute
    gpu_ms: list[float] = []

    def execute_timed(out):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        result = original(out)
        end.record()
        end.synchronize()
        gpu_ms.append(start.elapsed_time(end))
        return result

    runner.execute = execute_timed
    timed_steps(args.steps)
    runner.execute = original
    execute = sum(gpu_ms) / len(gpu_ms) / 1e3

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        timed_steps(10)
    sys.stdout.write(
        f"{device_name()}: batch {args.batch}, context ~{args.context}\n"
        f"wall per decode step: {wall * 1e3:.2f} ms; inside ModelRunner.execute (events, incl. "
        f"its host prep and the sampler sync): {execute * 1e3:.2f} ms; outside it (scheduler, "
        f"outputs): {(wall - execute) * 1e3:.2f} ms\n"
        f"tokens/s at this batch: {args.batch / wall:,.0f}\n"
    )
    sys.stdout.write(
        prof.key_averages().table(sort_by="self_device_time_total", row_limit=15) + "\n"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
