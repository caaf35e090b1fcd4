"""A request's LoRA adapter, as vLLM's offline API names it: LoRARequest(lora_name, lora_int_id,
lora_path). Imports nothing heavy: the server's settings and the command line read it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """An adapter: its name (the OpenAI `model` of its requests), an id unique among the adapters
    one engine serves (vLLM's lora_int_id, >= 1), and its PEFT folder (adapter_config.json and
    adapter_model.safetensors)."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not self.lora_name:
            raise ValueError("a LoRA adapter needs a name")
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be >= 1, not {self.lora_int_id}")
