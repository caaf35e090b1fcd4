"""Embedding throughput: kvfleet's LLM(runner="pooling").embed on random token-id inputs of
one length, against HF transformers' body (AutoModel) run in batches of those inputs (no
padding: they are all as long), pooled the same way (last token, L2-normalised), in the same
process on the same architecture. Sequences/s and prompt tokens/s for each.

    python bench/embeddings.py --model bench/models/Qwen3-0.6B --num-prompts 2048 \\
        --input-len 512 --hf-batch-size 32 128 --result-json out.json

The weights are random (--load-format dummy for kvfleet, transformers' own initialisation for
HF): the cost of a forward pass does not depend on them."""

from __future__ import annotations

import argparse
import gc
import logging
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import Result, Timer, random_workload, write_results

from kvfleet.engine import LLM
from kvfleet.engine.llm import TokensPrompt

logger = logging.getLogger("bench.embeddings")


def run_kvfleet(args: argparse.Namespace, prompts: list[list[int]]) -> Result:
    llm = LLM(
        model=args.model,
        runner="pooling",
        load_format=args.load_format,
        dtype=args.dtype,
        skip_tokenizer_init=True,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        gpu_memory_utilization=args.gpu_memory_utilization,
        # Random inputs share no prefix; the cache would only cost its bookkeeping.
        enable_prefix_caching=False,
    )
    inputs: list[TokensPrompt] = [{"prompt_token_ids": p} for p in prompts]
    llm.embed(inputs[:8], use_tqdm=False)  # warm-up
    with Timer() as t:
        outs = llm.embed(inputs, use_tqdm=False)
    width = {len(o.outputs.embedding) for o in outs}
    llm.shutdown()
    return Result(
        "kvfleet embed", t.seconds, len(prompts), sum(map(len, prompts)), 0,
        {"embedding_size": sorted(width)},
    )  # fmt: skip


def run_hf(args: argparse.Namespace, prompts: list[list[int]], batch_size: int) -> Result:
    from transformers import AutoConfig, AutoModel

    config = AutoConfig.from_pretrained(args.model)
    dtype = torch.bfloat16 if args.dtype == "auto" else getattr(torch, args.dtype)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = AutoModel.from_config(config, dtype=dtype).eval()

    def embed(model: torch.nn.Module, batch: list[list[int]]) -> torch.Tensor:
        # Every input has the same length: no padding, the last position is each one's last.
        ids = torch.tensor(batch, device=device)
        hidden = model(input_ids=ids).last_hidden_state[:, -1].float()
        return torch.nn.functional.normalize(hidden, dim=-1)

    with torch.inference_mode():
        embed(model, prompts[:batch_size])  # warm-up
        with Timer() as t:
            for s in range(0, len(prompts), batch_size):
                embed(model, prompts[s : s + batch_size]).cpu()
    del model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return Result(f"HF AutoModel batch {batch_size}", t.seconds, len(prompts),
                  sum(map(len, prompts)), 0)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description="Embedding throughput against HF transformers")
    parser.add_argument("--model", default="bench/models/Qwen3-0.6B")
    parser.add_argument("--load-format", default="dummy", choices=["auto", "dummy"])
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-prompts", type=int, default=2048)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--hf-batch-size", type=int, nargs="*", default=[32, 128])
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--result-json", default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(args.model).vocab_size
    length = (args.input_len, args.input_len)
    prompts = random_workload(args.num_prompts, length, (0, 0), vocab, args.seed).prompts
    results = [run_kvfleet(args, prompts)]
    results += [run_hf(args, prompts, b) for b in args.hf_batch_size]
    print(f"{args.num_prompts} inputs of {args.input_len} tokens, {args.model}")
    print("| run | sequences | seconds | sequences/s | tokens/s |\n|---|---|---|---|---|")
    for r in results:
        tok_s = r.prompt_tokens / r.seconds
        print(f"| {r.name} | {r.requests} | {r.seconds:.2f} | {r.req_s:,.1f} | {tok_s:,.0f} |")
    best_hf = max(results[1:], key=lambda r: r.req_s, default=None)
    if best_hf is not None:
        print(f"kvfleet / best HF: {results[0].req_s / best_hf.req_s:.2f}x sequences/s")
    meta = {"model": args.model, "num_prompts": args.num_prompts, "input_len": args.input_len}
    write_results(args.result_json, meta, results)


if __name__ == "__main__":
    main()
