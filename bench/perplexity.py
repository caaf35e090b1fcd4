"""The accuracy cost of the FP8 paths (issue 21, item 4): perplexity of a model over a fixed text
through the engine's prompt logprobs, and greedy agreement over chat prompts, for the baseline
(the model dtype: --dtype, auto = fp32 on the CPU, bf16 on a GPU) and each FP8 variant:
--kv-cache-dtype fp8 (k/v scales 1.0, or calibrated: --calculate-kv-scales), --quantization fp8
(W8A8), and both; and fp8-weights-only, a diagnostic: W8A8's fp8 weights with the activations
left unquantized, which tells the weights' share of its error from the activations'.

Perplexity as HF's guide computes it for fixed-length models: windows of --window tokens every
--stride tokens, each window scoring only the tokens no earlier window scored (the rest are its
context), so every token after the first is scored once with up to window - stride tokens before
it. Greedy agreement: each variant's greedy answer to the same chat prompts against the
baseline's, as the share of identical answers and the mean length of the common token prefix.

    python bench/perplexity.py                      # the default model, every variant
    python bench/perplexity.py --model DIR --dtype bfloat16 --variants baseline,fp8-kv

Goal (issue 21): fp8 KV within 1% of the baseline's perplexity, W8A8 within 3%."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from common import device_name, git_commit

from kvfleet.engine import LLM, SamplingParams
from kvfleet.engine.config import EngineArgs
from kvfleet.engine.engine_core import load_tokenizer
from kvfleet.engine.layers import linear
from kvfleet.engine.models import llama

logger = logging.getLogger("bench.perplexity")

TEXT = Path(__file__).resolve().parent / "data" / "ruth_kjv.txt"

# The engine arguments of each variant, on top of the shared ones.
VARIANTS: dict[str, dict[str, Any]] = {
    "baseline": {},
    "fp8-kv": {"kv_cache_dtype": "fp8"},
    # k/v scales from the first batch's K/V instead of 1.0 (a GGUF checkpoint carries none).
    "fp8-kv-scaled": {"kv_cache_dtype": "fp8", "calculate_kv_scales": True},
    "fp8-w8a8": {"quantization": "fp8"},
    "fp8-both": {"kv_cache_dtype": "fp8", "quantization": "fp8"},
    # A diagnostic, not a served path: the fp8 weights with the activations left unquantized,
    # the weights' share of W8A8's error.
    "fp8-weights-only": {"quantization": "fp8"},
}
# Perplexity goals relative to the baseline: the bounds (both paths: the looser one).
GOALS = {"fp8-kv": 0.01, "fp8-kv-scaled": 0.01, "fp8-w8a8": 0.03, "fp8-both": 0.03}

CHAT_PROMPTS = (
    "What is the capital of France?",
    "Name three primary colours.",
    "Explain in one sentence what a CPU does.",
    "Write a haiku about the sea.",
    "What is 12 times 7?",
    "Give me a synonym for happy.",
    "Why is the sky blue?",
    "List the days of the week.",
    "What does a bee make?",
    "Translate 'good morning' into French.",
    "What is the boiling point of water in Celsius?",
    "Suggest a name for a pet cat.",
    "How many legs does a spider have?",
    "What is the opposite of cold?",
    "Describe a rainbow in a short sentence.",
    "Who wrote Romeo and Juliet?",
)


@dataclass
class Window:
    begin: int  # first token of the window in the text
    end: int  # one past its last token
    first_scored: int  # first token (in the text) this window scores


def windows(num_tokens: int, window: int, stride: int) -> list[Window]:
    """HF's strided windows: each scores the tokens after the previous one's end. Windows
    overlap (stride < window), so no window's first token, which has nothing before it in the
    window, is left to it to score; the text's first token is never scored."""
    if not 0 < stride < window:
        raise ValueError(f"stride ({stride}) must be in 1..window - 1 ({window - 1})")
    if num_tokens < 2:
        raise ValueError(f"the text has {num_tokens} tokens; at least 2 are needed")
    out: list[Window] = []
    prev_end = 0
    for begin in range(0, num_tokens, stride):
        end = min(begin + window, num_tokens)
        out.append(Window(begin, end, max(prev_end, 1)))
        prev_end = end
        if end == num_tokens:
            break
    return out


def perplexity(
    ids: Sequence[int],
    window: int,
    stride: int,
    score: Callable[[list[list[int]]], list[list[float | None]]],
) -> tuple[float, int]:
    """exp(mean NLL) over every token after the first, and how many were scored. `score` gives
    each prompt's per-token logprobs (None for its first token)."""
    spans = windows(len(ids), window, stride)
    logprobs = score([list(ids[w.begin : w.end]) for w in spans])
    nll, count = 0.0, 0
    for w, lps in zip(spans, logprobs, strict=True):
        for pos in range(w.first_scored - w.begin, w.end - w.begin):
            lp = lps[pos]
            assert lp is not None, f"no logprob for token {w.begin + pos}"
            nll -= lp
            count += 1
    return math.exp(nll / count), count


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@dataclass
class VariantResult:
    variant: str
    engine_args: dict[str, Any]
    dtype: str
    perplexity: float
    scored_tokens: int
    score_s: float
    answers: list[list[int]]
    # Filled against the baseline.
    ppl_delta: float | None = None
    identical: float | None = None
    mean_common_prefix: float | None = None
    mean_answer_len: float | None = None
    within_goal: bool | None = None


def _weight_only_fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor | None,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    y = x.float() @ (weight.float() * weight_scale[:, None]).T
    return (y if bias is None else y + bias.float()).to(x.dtype)


@contextlib.contextmanager
def _variant_arithmetic(name: str) -> Iterator[None]:
    """fp8-weights-only: the engine's fp8 linear layers multiply by their dequantized fp8
    weights without quantizing their inputs, in this process, while the variant runs. The
    models built meanwhile leave their norms and activations unquantized too (those that feed
    an fp8 linear quantize its input themselves when the model is built with an Fp8Input)."""
    if name != "fp8-weights-only":
        yield
        return
    served, producer_input = linear.fp8_linear, llama.Fp8Input
    linear.fp8_linear = _weight_only_fp8_linear
    llama.Fp8Input = lambda consumer: None
    try:
        yield
    finally:
        linear.fp8_linear, llama.Fp8Input = served, producer_input


def run_variant(
    name: str,
    model: str,
    shared: dict[str, Any],
    text_ids: list[int],
    window: int,
    stride: int,
    max_tokens: int,
    prompts: Sequence[str],
) -> VariantResult:
    extra = VARIANTS[name]
    missing = [k for k in extra if k not in EngineArgs.model_fields]
    if missing:
        raise SystemExit(f"variant {name}: this engine has no {', '.join(missing)} argument")
    args = {**shared, **extra}
    logger.info("%s: %s", name, args)
    with _variant_arithmetic(name), LLM(model, **args) as llm:
        tok = llm.get_tokenizer()
        scoring = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)

        def score(prompts_ids: list[list[int]]) -> list[list[float | None]]:
            outs = llm.generate(
                [{"prompt_token_ids": p} for p in prompts_ids], scoring, use_tqdm=False
            )
            return [
                [None if e is None else e[t] for t, e in zip(p, o.prompt_logprobs, strict=True)]
                for p, o in zip(prompts_ids, outs, strict=True)
            ]

        t0 = time.perf_counter()
        ppl, count = perplexity(text_ids, window, stride, score)
        score_s = time.perf_counter() - t0
        chats = [
            tok.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
            )
            for q in prompts
        ]
        greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        answers = [o.outputs[0].token_ids for o in llm.generate(chats, greedy, use_tqdm=False)]
        dtype = str(llm.engine.model_config.dtype).removeprefix("torch.")
    logger.info("%s: perplexity %.4f over %d tokens (%.1f s)", name, ppl, count, score_s)
    return VariantResult(name, extra, dtype, ppl, count, score_s, answers)


def compare(base: VariantResult, other: VariantResult) -> None:
    other.ppl_delta = other.perplexity / base.perplexity - 1
    pairs = list(zip(base.answers, other.answers, strict=True))
    other.identical = sum(a == b for a, b in pairs) / len(pairs)
    other.mean_common_prefix = sum(common_prefix(a, b) for a, b in pairs) / len(pairs)
    other.mean_answer_len = sum(len(a) for a in base.answers) / len(pairs)
    goal = GOALS.get(other.variant)
    other.within_goal = None if goal is None else other.ppl_delta <= goal


def table(results: list[VariantResult]) -> str:
    lines = [
        "| variant | dtype | perplexity | vs baseline | goal | identical greedy | "
        "mean common prefix / answer (tokens) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        goal = GOALS.get(r.variant)
        lines.append(
            f"| {r.variant} | {r.dtype} | {r.perplexity:.4f} | "
            + ("-" if r.ppl_delta is None else f"{r.ppl_delta:+.2%}")
            + " | "
            + ("-" if goal is None else f"<= {goal:.0%}: {'met' if r.within_goal else 'MISSED'}")
            + " | "
            + ("-" if r.identical is None else f"{r.identical:.0%}")
            + " | "
            + (
                "-"
                if r.mean_common_prefix is None
                else f"{r.mean_common_prefix:.1f} / {r.mean_answer_len:.1f}"
            )
            + " |"
        )
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint; default: the default model")
    p.add_argument("--dtype", default="auto", help="the baseline's and every variant's dtype")
    p.add_argument("--device", default="auto")
    p.add_argument("--text", type=Path, default=TEXT, help="the text scored")
    p.add_argument("--max-text-tokens", type=int, default=None, help="score only the start")
    p.add_argument("--window", type=int, default=512, help="tokens a scoring window holds")
    p.add_argument("--stride", type=int, default=256, help="tokens between window starts")
    p.add_argument("--max-tokens", type=int, default=64, help="greedy answer length")
    p.add_argument("--num-prompts", type=int, default=len(CHAT_PROMPTS))
    p.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help=f"comma-separated, the first is the baseline; of {', '.join(VARIANTS)}",
    )
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    names = args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        p.error(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    if not 1 <= args.num_prompts <= len(CHAT_PROMPTS):
        p.error(f"--num-prompts must be in 1..{len(CHAT_PROMPTS)}")
    args.variant_names = names
    return args


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args = parse_args(argv)
    model = args.model
    if model is None:
        from kvfleet.engine.default_model import default_model_path

        model = str(default_model_path())
    shared = {
        "dtype": args.dtype,
        "device": args.device,
        "max_model_len": max(args.window + 1, 2048),
        "enable_prefix_caching": False,
        # Enough for every window at once; the CPU default (4 GiB) would crowd a shared machine.
        "max_num_seqs": 16,
        "kv_cache_memory_bytes": 512 << 20,
    }
    text_ids = load_tokenizer(model).encode(args.text.read_text(), add_special_tokens=False)
    text_ids = text_ids[: args.max_text_tokens]
    results: list[VariantResult] = []
    for name in args.variant_names:
        result = run_variant(
            name,
            model,
            shared,
            text_ids,
            args.window,
            args.stride,
            args.max_tokens,
            CHAT_PROMPTS[: args.num_prompts],
        )
        if results:
            compare(results[0], result)
        results.append(result)
    print(table(results))
    meta = {
        "model": model,
        "text": args.text.name,
        "text_tokens": len(text_ids),
        "window": args.window,
        "stride": args.stride,
        "max_tokens": args.max_tokens,
        "num_prompts": args.num_prompts,
        "device": device_name(),
        "commit": git_commit(),
    }
    print(json.dumps(meta))
    if args.out is not None:
        payload = {"meta": meta, "results": [asdict(r) for r in results]}
        args.out.write_text(json.dumps(payload, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
