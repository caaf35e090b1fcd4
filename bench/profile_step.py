"""Where one engine step's time goes: wall time per decode step at a fixed batch; how much of it
the host spends waiting for the device's tokens (ModelRunner.resolve: the device is the bottleneck
then) and how much busy (scheduling, input preparation, launching, grammar masks, outputs); the
top CUDA kernels from torch.profiler. With `--modes free,json` the same batch runs again with
every request under a JSON schema (the structured-output bench's); with `--scheduling async,sync`
each mode runs under both engine loops, on the same engine.

    python bench/profile_step.py --model bench/models/Qwen3-0.6B --batch 128 --context 1024
    python bench/profile_step.py --model /tmp/llama8b --batch 32 --modes free,json \
        --scheduling async,sync

A JSON mode needs a tokenizer in the model folder (bench/dummy_tokenizer.py writes one).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import io
import logging
import pstats
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import llguidance
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import device_name, random_workload
from structured import records_schema

from kvfleet.engine import LLM, SamplingParams
from kvfleet.engine import sampler as sampler_module
from kvfleet.engine.engine_core import EngineCore
from kvfleet.engine.sampling_params import StructuredOutputsParams
from kvfleet.kernels import reference

MODES = ("free", "json")


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(fn: Callable[..., Any], spent: list[float], host: bool = False) -> Callable[..., Any]:
    """fn, adding each call's seconds to spent (on the GPU, events around it: the call's host
    work plus the device work it waits for; host: the host's clock only, for work that waits
    for no device work, which events queued behind a running forward would time as nothing)."""

    def call(*args: Any) -> Any:
        if host or not torch.cuda.is_available():
            start = time.perf_counter()
            result = fn(*args)
            spent.append(time.perf_counter() - start)
            return result
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        result = fn(*args)
        end.record()
        end.synchronize()
        spent.append(start.elapsed_time(end) / 1e3)
        return result

    return call


@contextlib.contextmanager
def _gc_pauses() -> Iterator[list[tuple[int, float]]]:
    """The (generation, seconds) of each garbage collection inside: pauses of the engine's
    thread, which lengthen a step when they fall between the sampler's wait and the next launch."""
    pauses: list[tuple[int, float]] = []
    started: list[float] = []

    def callback(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            pauses.append((info["generation"], time.perf_counter() - started.pop()))

    gc.callbacks.append(callback)
    try:
        yield pauses
    finally:
        gc.callbacks.remove(callback)


def device_idle(events: list[Any], steps: int, top: int = 4) -> str:
    """The device's idle time between kernels and copies (from a profiler's events), per step,
    and its longest gaps with the work on either side: where the host kept the device waiting."""
    work = sorted(
        (e.time_range.start, e.time_range.end, e.name)
        for e in events
        if e.device_type == torch.autograd.DeviceType.CUDA
    )
    if not work:
        return "no device work recorded"
    gaps: list[tuple[float, str, str]] = []
    busy_until, last = work[0][1], work[0][2]
    for start, end, name in work[1:]:
        if start > busy_until:
            gaps.append((start - busy_until, last, name))
        if end > busy_until:
            busy_until, last = end, name
    idle = sum(g for g, _, _ in gaps) / 1e3  # the profiler's clock is in microseconds
    longest = "; ".join(
        f"{g:.0f} us after {a[:40]} before {b[:40]}" for g, a, b in sorted(gaps, reverse=True)[:top]
    )
    return f"device idle between its work: {idle / steps:.3f} ms a step (longest: {longest})"


def profile_mode(
    core: EngineCore, mode: str, args: argparse.Namespace, threads: int = 0
) -> tuple[float, str]:
    """One mode's wall seconds per decode step and its report: the batch admitted and
    prefilled, then timed decode steps, under the engine's current loop (async or sync
    scheduling). threads: the grammar executor's, for the report (0: the engine's own)."""
    structured = None
    if mode == "json":
        schema = records_schema("profile", 64)  # never complete within the steps run
        structured = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    sp = SamplingParams(
        temperature=0,
        max_tokens=args.steps * 4 + 16,
        ignore_eos=True,
        structured_outputs=structured,
    )
    work = random_workload(args.batch, (args.context,) * 2, (1, 1), core.vocab_size, 0)
    ids = [f"{mode}-{i}" for i in range(args.batch)]
    for rid, prompt in zip(ids, work.prompts, strict=True):
        core.add_request(rid, core.admit(prompt, sp))
    while any(r.num_output_tokens == 0 for r in core.scheduler.requests.values()):
        core.step()  # prefill everything first: what follows are pure decode steps

    def steps(n: int) -> float:
        _sync()
        start = time.perf_counter()
        for _ in range(n):
            core.step()
        _sync()
        return (time.perf_counter() - start) / n

    steps(5)
    with _gc_pauses() as pauses:
        wall = steps(args.steps)
    runner, resolve_s, masks_s = core.runner, [], []
    # Host clocks: the resolve's wait is for work queued earlier, which events would not time.
    runner.resolve = _timed(runner.resolve, resolve_s, host=True)
    if core.structured is not None:
        core.structured.masks = _timed(core.structured.masks, masks_s, host=True)
    try:
        steps(args.steps)
    finally:
        del runner.resolve  # the instance attributes go; the methods show through again
        if core.structured is not None:
            del core.structured.masks
    waiting = sum(resolve_s) / args.steps
    masks = sum(masks_s) / args.steps  # called every step (a free batch returns at once)
    spread = ""
    gc_line = (
        f"; garbage collection: {len(pauses)} passes ({sum(g == 2 for g, _ in pauses)} full), "
        f"{sum(t for _, t in pauses) / args.steps * 1e3:.3f} ms a step"
    )
    if mode == "json":
        q = np.percentile(np.array(masks_s) * 1e3, [50, 90, 100])
        spread = f" (p50 {q[0]:.3f}, p90 {q[1]:.3f}, max {q[2]:.3f}; {threads or 'engine'} threads)"
    table = ""
    if args.host_profile:
        # Python's profiler slows every call, so its times are only for comparing modes: what
        # the host does between the sampler's wait for the tokens and the next forward's launch
        # is exposed, as the GPU idles meanwhile.
        profiler = cProfile.Profile()
        profiler.runcall(steps, args.steps)
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(args.host_profile)
        table += text.getvalue()
    if torch.cuda.is_available():
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            steps(10)
        table += prof.key_averages().table(sort_by="self_device_time_total", row_limit=20) + "\n"
        table += device_idle(prof.events(), 10) + "\n"
    for rid in ids:
        core.abort_request(rid)
    loop = "async" if core.async_scheduling else "sync"
    return wall, (
        f"[{mode}, {loop}] wall per decode step: {wall * 1e3:.2f} ms; the host waiting for the "
        f"tokens (ModelRunner.resolve, incl. the matchers' advance): {waiting * 1e3:.2f} ms; "
        f"busy otherwise: {(wall - waiting) * 1e3:.2f} ms; grammar bitmask "
        f"(host): {masks * 1e3:.3f} ms{spread}{gc_line}; tokens/s at this batch: "
        f"{args.batch / wall:,.0f}\n{table}"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--quantization", choices=["fp8"], default=None, help="fp8: W8A8 weights")
    p.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto")
    p.add_argument(
        "--modes",
        default="free",
        help="comma-separated, run in turn on the same engine: free (unconstrained), json "
        "(every request under a JSON schema; needs a tokenizer)",
    )
    p.add_argument(
        "--scheduling",
        default="async",
        help="comma-separated engine loops to run each mode under, in turn: async (the "
        "default: the next step launched before the last one's tokens are read), sync",
    )
    p.add_argument(
        "--host-profile",
        type=int,
        default=0,
        metavar="N",
        help="also run the decode steps under Python's profiler and print its N costliest "
        "functions (own time) per mode",
    )
    p.add_argument(
        "--bitmask-op",
        choices=("engine", "pytorch"),
        default="engine",
        help="how the JSON mode bans tokens: the engine's own way (the Triton kernel on a GPU) "
        "or the PyTorch twin's ops, to tell the kernel's launch from the rest of a step's cost",
    )
    p.add_argument(
        "--grammar-threads",
        default="0",
        help="comma-separated thread counts of the grammar executor, one JSON run each "
        "(0: the engine's own executor)",
    )
    args = p.parse_args(argv)
    threads = [int(t) for t in args.grammar_threads.split(",") if t]
    modes = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(modes) - set(MODES))
    if unknown or not modes:
        p.error(f"--modes: {', '.join(unknown) or 'none given'}; choose from {', '.join(MODES)}")
    loops = [s for s in args.scheduling.split(",") if s]
    if not loops or set(loops) - {"async", "sync"}:
        p.error(f"--scheduling: {args.scheduling!r}; choose from async, sync")
    logging.basicConfig(level=logging.WARNING)
    llm = LLM(
        model=args.model,
        load_format="dummy",
        dtype=args.dtype,
        skip_tokenizer_init="json" not in modes,
        max_model_len=args.max_model_len,
        max_num_seqs=max(args.batch, 8),
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    engine_op = sampler_module.apply_bitmask
    try:
        if args.bitmask_op == "pytorch":
            sampler_module.apply_bitmask = reference.apply_token_bitmask
        sys.stdout.write(f"{device_name()}: batch {args.batch}, context ~{args.context}\n")
        grammars = llm.engine.structured
        own = grammars.executor if grammars is not None else None
        for loop in loops:
            llm.engine.async_scheduling = loop == "async"
            walls: dict[str, float] = {}
            for mode in modes:
                for n in threads if mode == "json" else [0]:
                    if grammars is not None:
                        grammars.executor = llguidance.LLExecutor(num_threads=n) if n else own
                    walls[mode], report = profile_mode(llm.engine, mode, args, n)
                    sys.stdout.write(report)
                    if mode == "json" and "free" in walls:
                        ratio = walls["json"] / walls["free"]
                        sys.stdout.write(f"json / free wall per step ({loop}): {ratio:.3f}\n")
    finally:
        sampler_module.apply_bitmask = engine_op
        llm.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
