"""PEFT LoRA adapter folders for tests, written by PEFT itself from a tiny model: random A and a
non-zero random B (PEFT starts B at zero, which would leave the base model's outputs), at a
chosen rank, alpha and set of target modules."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from kvfleet.engine.lora_request import LoRARequest

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


def write_peft_adapter(
    base_model: Path,
    path: Path,
    *,
    rank: int,
    targets: Sequence[str] = ATTENTION + MLP,
    alpha: int = 16,
    use_rslora: bool = False,
    seed: int = 0,
    std: float = 0.1,
) -> Path:
    """An adapter of `base_model` at `path` (adapter_config.json + adapter_model.safetensors),
    its A and B drawn from N(0, std) with `seed`. Returns `path`."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_model, dtype=torch.float32)
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=list(targets),
        use_rslora=use_rslora,
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )
    peft_model = get_peft_model(model, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * std)
    peft_model.save_pretrained(str(path))
    return path


def write_test_adapters(base_model: Path, root: Path) -> list[LoRARequest]:
    """The suite's three adapters of a tiny Llama, ids 1-3: every projection at rank 8; q and v
    at rank 4 with rsLoRA; the MLP at rank 16 (alpha 32)."""
    specs: list[tuple[str, dict]] = [
        ("all-r8", {"rank": 8, "alpha": 16}),
        ("qv-r4-rslora", {"rank": 4, "targets": ("q_proj", "v_proj"), "alpha": 8,
                          "use_rslora": True}),
        ("mlp-r16", {"rank": 16, "targets": MLP, "alpha": 32}),
    ]  # fmt: skip
    return [
        LoRARequest(name, i, str(write_peft_adapter(base_model, root / name, seed=i, **spec)))
        for i, (name, spec) in enumerate(specs, 1)
    ]
