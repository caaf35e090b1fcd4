"""Offline throughput: kvfleet's LLM on a random token-id workload, with HF transformers
baselines (static padded batches of one or more sizes, and transformers' own continuous batching
where it exists) measured in the same process on the same weights' architecture.

    python bench/throughput.py --model bench/models/Qwen3-0.6B --load-format dummy \\
        --num-prompts 256 --input-len 100 1024 --output-len 100 1024 --baselines hf-static \\
        --hf-batch-size 1 8

With ``--prefix-len N`` every prompt starts with the same N tokens; with prefix caching on (the
default) the kvfleet row reports how many prompt tokens the cache served.
"""

from __future__ import annotations

import argparse
import functools
import gc
import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    TABLE_HEADER,
    Result,
    Timer,
    Workload,
    hf_model,
    random_workload,
    sync,
    write_results,
)

from kvfleet.engine import LLM, SamplingParams

logger = logging.getLogger("bench.throughput")


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_kvfleet(args: argparse.Namespace, work: Workload) -> Result:
    llm = LLM(
        model=args.model,
        load_format=args.load_format,
        dtype=args.dtype,
        skip_tokenizer_init=True,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=args.enable_prefix_caching,
        enforce_eager=args.enforce_eager,
        gpu_memory_utilization=args.gpu_memory_utilization,
        tensor_parallel_size=args.tensor_parallel_size,
        enable_expert_parallel=args.enable_expert_parallel,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        calculate_kv_scales=args.calculate_kv_scales,
        async_scheduling=args.async_scheduling,
    )
    params = [
        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in work.output_lens
    ]
    llm.generate([{"prompt_token_ids": p} for p in work.prompts[:4]], params[:4])  # warm-up
    report_steps = _record_steps(llm) if args.step_stats else None
    with Timer() as t:
        outs = llm.generate([{"prompt_token_ids": p} for p in work.prompts], params)
    if report_steps is not None:
        report_steps()
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    if produced != work.output_tokens:
        raise RuntimeError(f"asked for {work.output_tokens} output tokens, got {produced}")
    stats = llm.engine.stats()
    # Of the timed run alone: the engine's counters also hold the warm-up's lookups.
    cached = sum(o.num_cached_tokens for o in outs)
    llm.shutdown()
    del llm
    free_memory()
    return Result(
        "kvfleet" if args.tensor_parallel_size == 1 else f"kvfleet-tp{args.tensor_parallel_size}",
        t.seconds,
        len(work.prompts),
        work.prompt_tokens,
        produced,
        {
            "num_preemptions": stats.num_preemptions,
            "cached_prompt_tokens": cached,
            "prefix_cache_hit_rate": cached / work.prompt_tokens,
        },
    )


def _record_steps(llm: LLM) -> Callable[[], None]:
    """Spy on the engine's steps; the returned function logs where step time went (pure decode
    steps, CUDA graphs, versus steps that carry prefill tokens, with their counts and mean
    sizes) and removes the spies, which would otherwise keep the engine and its GPU memory
    alive into the baselines."""
    core = llm.engine
    schedule, step = core.scheduler.schedule, core.step
    times: dict[str, list[float]] = {"decode": [], "prefill": []}
    seqs: dict[str, list[int]] = {"decode": [], "prefill": []}
    last: dict[str, int] = {}

    def schedule_spy():
        out = schedule()
        last["seqs"], last["tokens"] = len(out.scheduled), out.num_batched_tokens
        return out

    def step_spy():
        start = time.perf_counter()
        result = step()
        sync()
        kind = "decode" if last.get("tokens") == last.get("seqs") else "prefill"
        times[kind].append(time.perf_counter() - start)
        seqs[kind].append(last.get("seqs", 0))
        return result

    def report() -> None:
        del core.scheduler.schedule, core.step
        logger.info("preemptions: %d", core.scheduler.stats.num_preemptions)
        for kind, t in times.items():
            if t:
                logger.info(
                    "%s steps: %d, %.2f s total, %.2f ms mean, %.1f sequences mean",
                    kind, len(t), sum(t), 1e3 * sum(t) / len(t), sum(seqs[kind]) / len(t),
                )  # fmt: skip

    core.scheduler.schedule = schedule_spy
    core.step = step_spy
    return report


@torch.inference_mode()
def run_hf_static(args: argparse.Namespace, work: Workload, bs: int) -> Result:
    """Batches of ``bs``, left-padded; every row decodes until the batch's longest requested
    output (what a plain `generate` server does), so only requested tokens count."""
    model = hf_model(args.model, args.dtype)
    dev = model.device
    generated = 0
    with Timer() as t:
        for i in range(0, len(work.prompts), bs):
            prompts = work.prompts[i : i + bs]
            width = max(map(len, prompts))
            ids = torch.zeros((len(prompts), width), dtype=torch.long)
            mask = torch.zeros_like(ids)
            for row, p in enumerate(prompts):
                ids[row, width - len(p) :] = torch.tensor(p)
                mask[row, width - len(p) :] = 1
            new = max(work.output_lens[i : i + bs])
            model.generate(
                ids.to(dev),
                attention_mask=mask.to(dev),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=0,
            )
            generated += new * len(prompts)
    del model
    free_memory()
    return Result(
        f"hf-static-bs{bs}",
        t.seconds,
        len(work.prompts),
        work.prompt_tokens,
        work.output_tokens,
        {"tokens_generated_including_padding_waste": generated},
    )


def run_hf_continuous(args: argparse.Namespace, work: Workload) -> Result:
    """transformers' own continuous batching (`generate_batch`), one max_new_tokens for all."""
    from transformers import GenerationConfig

    model = hf_model(args.model, args.dtype)
    if not hasattr(model, "generate_batch"):
        raise RuntimeError("this transformers has no generate_batch")
    new = max(work.output_lens)
    config = GenerationConfig(
        max_new_tokens=new, do_sample=False, eos_token_id=-1, pad_token_id=0, use_cuda_graph=False
    )
    with Timer() as t:
        outs = model.generate_batch(inputs=work.prompts, generation_config=config)
    produced = sum(len(o.generated_tokens) for o in outs.values())
    if produced == 0:
        raise RuntimeError("generate_batch produced no tokens")
    del model
    free_memory()
    return Result(
        "hf-generate_batch",
        t.seconds,
        len(work.prompts),
        work.prompt_tokens,
        produced,
        {"max_new_tokens_for_all": new},
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", required=True, help="HF directory or .gguf file")
    p.add_argument("--load-format", default="dummy", choices=["auto", "dummy"])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len", type=int, nargs=2, default=[100, 1024], metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=[100, 1024], metavar=("MIN", "MAX"))
    p.add_argument("--prefix-len", type=int, default=0, help="shared prefix before each prompt")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--max-num-seqs", type=int, default=None, help="default: the engine's")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
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
    p.add_argument("--kv-cache-dtype", choices=["auto", "fp8", "fp8_e4m3"], default="auto")
    p.add_argument("--calculate-kv-scales", action="store_true")
    p.add_argument("--baselines", nargs="*", default=[], choices=["hf-static", "hf-continuous"])
    p.add_argument("--baseline-num-prompts", type=int, default=64,
                   help="baselines run the first N prompts of the same workload")  # fmt: skip
    p.add_argument("--hf-batch-size", type=int, nargs="+", default=[32],
                   help="hf-static runs once per size")  # fmt: skip
    p.add_argument("--result-json", default=None)
    p.add_argument("--step-stats", action="store_true", help="log decode vs prefill step time")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

    from transformers import AutoConfig

    from kvfleet.engine.checkpoint_path import find_gguf
    from kvfleet.engine.models import gguf_checkpoint

    gguf_file = find_gguf(args.model)
    config = (
        gguf_checkpoint.load_config(gguf_file)
        if gguf_file is not None
        else AutoConfig.from_pretrained(args.model)
    )
    vocab = config.vocab_size
    work = random_workload(
        args.num_prompts, tuple(args.input_len), tuple(args.output_len), vocab, args.seed,
        args.prefix_len,
    )  # fmt: skip
    results = [run_kvfleet(args, work)]
    runners = []
    for name in args.baselines:
        if name == "hf-static":
            runners += [(f"hf-static-bs{bs}", functools.partial(run_hf_static, bs=bs))
                        for bs in args.hf_batch_size]  # fmt: skip
        else:
            runners.append((name, run_hf_continuous))
    for name, runner in runners:
        try:
            results.append(runner(args, work.head(args.baseline_num_prompts)))
        except Exception as e:  # a baseline that cannot run is reported, not fatal
            logger.warning("baseline %s did not run: %r", name, e)
            free_memory()
    sys.stdout.write(TABLE_HEADER + "\n" + "\n".join(r.row() for r in results) + "\n")
    if args.enable_prefix_caching:
        extra = results[0].extra
        sys.stdout.write(
            f"kvfleet prefix cache: {extra['cached_prompt_tokens']:,} of {work.prompt_tokens:,} "
            f"prompt tokens ({extra['prefix_cache_hit_rate']:.1%})\n"
        )
    for r in results[1:]:
        sys.stdout.write(f"kvfleet / {r.name}: {results[0].output_tok_s / r.output_tok_s:.1f}x\n")
    write_results(args.result_json, {"args": vars(args)}, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
