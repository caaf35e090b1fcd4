"""Multi-LoRA serving benchmark helpers (issue 40), driven by bench/gpu_run.sh's `lora` step.

    python bench/lora.py adapters --model bench/models/Llama-3.1-8B --out /tmp/lora8b \\
        --count 64 --rank 16
        random PEFT adapter folders a0..a63 of the model's q/k/v/o/gate/up/down projections
        (bf16, A and B of N(0, 0.01): a visible but sane change), written with safetensors
        alone, so the GPU machine needs no PEFT
    python bench/lora.py report --base base.json --lora lora8.json [--churn lora64.json] \\
        [--metrics metrics.txt]
        the adapters' output tok/s and TPOT p50 against the base model's (issue 40's goals:
        >= 0.85x and <= 1.2x), and from the engine's /metrics the adapter loads into GPU slots
        and their mean time

The load itself is bench/serve.py's closed loop (--users, --spread-models) against servers the
step starts with and without --enable-lora.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _shapes(config: dict) -> dict[str, tuple[int, int]]:
    """Each target's (out, in) features from an HF Llama-family config."""
    hidden = config["hidden_size"]
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    kv = config.get("num_key_value_heads") or heads
    inter = config["intermediate_size"]
    return {
        "q_proj": (heads * head_dim, hidden),
        "k_proj": (kv * head_dim, hidden),
        "v_proj": (kv * head_dim, hidden),
        "o_proj": (hidden, heads * head_dim),
        "gate_proj": (inter, hidden),
        "up_proj": (inter, hidden),
        "down_proj": (hidden, inter),
    }


def write_adapters(model: Path, out: Path, count: int, rank: int, seed: int) -> list[Path]:
    import torch
    from safetensors.torch import save_file

    config = json.loads((model / "config.json").read_text())
    shapes = _shapes(config)
    paths = []
    for i in range(count):
        path = out / f"a{i}"
        path.mkdir(parents=True, exist_ok=True)
        gen = torch.Generator().manual_seed(seed + i)
        tensors = {}
        for layer in range(config["num_hidden_layers"]):
            for target, (n, k) in shapes.items():
                part = "self_attn" if target in TARGETS[:4] else "mlp"
                name = f"base_model.model.model.layers.{layer}.{part}.{target}"
                a = torch.randn(rank, k, generator=gen) * 0.01
                b = torch.randn(n, rank, generator=gen) * 0.01
                tensors[f"{name}.lora_A.weight"] = a.to(torch.bfloat16)
                tensors[f"{name}.lora_B.weight"] = b.to(torch.bfloat16)
        save_file(tensors, str(path / "adapter_model.safetensors"))
        adapter_config = {
            "peft_type": "LORA",
            "r": rank,
            "lora_alpha": 2 * rank,
            "target_modules": list(TARGETS),
            "bias": "none",
            "task_type": "CAUSAL_LM",
        }
        (path / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2))
        paths.append(path)
    return paths


def _result(path: Path) -> tuple[float, float]:
    """(output tok/s, TPOT p50 in ms) of a bench/serve.py --result-json."""
    doc = json.loads(path.read_text())
    metrics = doc["metrics"]
    return float(metrics["output_throughput"]), float(metrics["tpot_ms"]["p50"])


def _metric_sum(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if re.match(rf"^{re.escape(name)}(\{{|\s)", line):
            total += float(line.rsplit(" ", 1)[1])
    return total


def report(base: Path, lora: Path, churn: Path | None, metrics: Path | None) -> str:
    base_tps, base_tpot = _result(base)
    lines = [f"{'run':<28}{'output tok/s':>14}{'TPOT p50 ms':>14}{'tok/s x':>10}{'TPOT x':>9}"]
    lines.append(f"{'base model':<28}{base_tps:>14.1f}{base_tpot:>14.2f}{1:>10.2f}{1:>9.2f}")
    runs = [("8 adapters, --max-loras 8", lora)]
    if churn is not None:
        runs.append(("64 adapters, --max-loras 16", churn))
    for label, path in runs:
        tps, tpot = _result(path)
        lines.append(
            f"{label:<28}{tps:>14.1f}{tpot:>14.2f}{tps / base_tps:>10.2f}{tpot / base_tpot:>9.2f}"
        )
    if metrics is not None:
        text = metrics.read_text()
        count = _metric_sum(text, "kvfleet_engine_lora_load_seconds_count")
        seconds = _metric_sum(text, "kvfleet_engine_lora_load_seconds_sum")
        loads = _metric_sum(text, "kvfleet_engine_lora_loads_total")
        evictions = _metric_sum(text, "kvfleet_engine_lora_evictions_total")
        mean = f"{1000 * seconds / count:.1f} ms" if count else "n/a"
        lines.append(
            f"slot loads {loads:.0f}, evictions {evictions:.0f}, mean load time {mean} "
            "(from host memory, or disk the first time)"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    a = sub.add_parser("adapters", help="write random PEFT adapter folders")
    a.add_argument("--model", type=Path, required=True, help="a folder with the config.json")
    a.add_argument("--out", type=Path, required=True)
    a.add_argument("--count", type=int, default=8)
    a.add_argument("--rank", type=int, default=16)
    a.add_argument("--seed", type=int, default=0)
    r = sub.add_parser("report", help="compare serve.py results")
    r.add_argument("--base", type=Path, required=True)
    r.add_argument("--lora", type=Path, required=True)
    r.add_argument("--churn", type=Path, default=None)
    r.add_argument("--metrics", type=Path, default=None, help="a /metrics scrape after the churn")
    args = p.parse_args(argv)
    if args.command == "adapters":
        for path in write_adapters(args.model, args.out, args.count, args.rank, args.seed):
            print(path)
    else:
        sys.stdout.write(report(args.base, args.lora, args.churn, args.metrics))
    return 0


if __name__ == "__main__":
    sys.exit(main())
