"""LoRA adapters for the fleet harness: random PEFT adapter folders for a model config (no base
weights needed, so a dummy-weight Llama-3.1-8B gets them as quickly as the tiny model), and the
adapter loads the engines report during a run.

An adapter's A and B are drawn from N(0, std) with a seed per adapter, on every attention and
MLP projection of the dense families, written as PEFT writes them: ``adapter_config.json`` and
``adapter_model.safetensors`` with ``base_model.model.model.layers.{i}.{module}.lora_{A,B}.weight``.
Loads per minute come from the engines' ``kvfleet_engine_lora_resident`` series (the adapters in
GPU slots), sampled: an adapter that appears in an engine's slots between two samples is a load,
so loads and evictions within one sample interval are not counted (a lower bound).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import torch
from prometheus_client.parser import text_string_to_metric_families
from safetensors.torch import save_file

from kvfleet.telemetry.metric_names import LORA_NAME, LORA_RESIDENT, LORA_TIER

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def module_shapes(config: dict) -> dict[str, tuple[int, int]]:
    """(in, out) features of each target projection of a dense decoder layer."""
    hidden = config["hidden_size"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    inter = config["intermediate_size"]
    return {
        "self_attn.q_proj": (hidden, heads * head_dim),
        "self_attn.k_proj": (hidden, kv_heads * head_dim),
        "self_attn.v_proj": (hidden, kv_heads * head_dim),
        "self_attn.o_proj": (heads * head_dim, hidden),
        "mlp.gate_proj": (hidden, inter),
        "mlp.up_proj": (hidden, inter),
        "mlp.down_proj": (inter, hidden),
    }


def write_random_adapter(
    model_dir: Path, path: Path, *, rank: int, seed: int, dtype: torch.dtype, std: float = 0.02
) -> Path:
    """A PEFT LoRA adapter of the model whose config.json is in ``model_dir``, at ``path``."""
    config = json.loads((model_dir / "config.json").read_text())
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module, (fan_in, fan_out) in module_shapes(config).items():
            key = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{key}.lora_A.weight"] = (torch.randn(rank, fan_in, generator=gen) * std).to(
                dtype
            )
            tensors[f"{key}.lora_B.weight"] = (torch.randn(fan_out, rank, generator=gen) * std).to(
                dtype
            )
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    adapter_config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
        "target_modules": list(TARGETS), "lora_dropout": 0.0, "bias": "none",
        "use_rslora": False, "fan_in_fan_out": False, "modules_to_save": None,
        "base_model_name_or_path": str(model_dir),
    }  # fmt: skip
    (path / "adapter_config.json").write_text(json.dumps(adapter_config, indent=1) + "\n")
    return path


def gpu_adapters(exposition: str) -> frozenset[str]:
    """The adapters an engine's /metrics say are in its GPU slots."""
    lines = [line for line in exposition.splitlines() if line.startswith(LORA_RESIDENT)]
    held = set()
    for family in text_string_to_metric_families("\n".join(lines) + "\n"):
        for sample in family.samples:
            if sample.labels.get(LORA_TIER) == "gpu" and sample.value > 0:
                held.add(sample.labels.get(LORA_NAME, ""))
    return frozenset(held)


class LoadCounter:
    """Adapter loads into GPU slots, per engine, from successive samples of what each holds."""

    def __init__(self) -> None:
        self.loads = 0
        self._held: dict[str, frozenset[str]] = {}

    def sample(self, engines: Iterable[tuple[str, frozenset[str]]]) -> None:
        """Each engine's GPU adapters now; an engine's first sample is its baseline."""
        for engine, held in engines:
            before = self._held.get(engine)
            if before is not None:
                self.loads += len(held - before)
            self._held[engine] = held
