"""PEFT LoRA adapter folders for tests, written by PEFT itself from a tiny model: random A and a
non-zero random B (PEFT starts B at zero, which would leave the base model's outputs), at a
chosen rank, alpha and set of target modules."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


def write_peft_adapter(
    base_model: Path,
    path: Path,
    *,
    rank: int,
    targets: Sequence[str] = ATTENTION + MLP,
    alpha: float = 16.0,
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
    peft_model.save_pretrained(path)
    return path
