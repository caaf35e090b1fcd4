"""What the engine counts a model's weights as before it loads them (ModelRunner checks they fit
the GPU): every parameter built on the meta device, so a mixture of experts counts all its
experts, at their fp8 size with --quantization fp8. The bench configs are the real models'."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvfleet.engine.config import EngineArgs, ModelConfig
from kvfleet.engine.model_runner import weight_bytes_per_rank

BENCH_MODELS = Path(__file__).resolve().parents[2] / "bench" / "models"


def _bytes(model: str, **args) -> int:
    engine_args = EngineArgs(model=str(BENCH_MODELS / model), device="cpu", dtype="bfloat16",
                             load_format="dummy", **args)  # fmt: skip
    mc = ModelConfig.from_args(engine_args, torch.device("cpu"))
    return weight_bytes_per_rank(mc)


@pytest.mark.parametrize(
    ("model", "experts", "expert_width", "attention", "vocab"),
    [
        # 48 layers: 128 experts of 768, q 32 x 128 and k/v 4 x 128 wide heads (+ q/k norms).
        ("Qwen3-30B-A3B", 128, 768, (32 + 8) * 128 * 2048 + 4096 * 2048 + 2 * 128, 151936),
        # 32 layers: 8 experts of 14336, 32 query and 8 KV heads of 128.
        ("Mixtral-8x7B-v0.1", 8, 14336, (32 + 16) * 128 * 4096 + 4096 * 4096, 32000),
    ],
)
def test_mixture_of_experts_weights_count_every_expert(model, experts, expert_width, attention,
                                                       vocab):  # fmt: skip
    hidden, layers = (2048, 48) if model.startswith("Qwen3") else (4096, 32)
    per_layer = attention + experts * 3 * expert_width * hidden + experts * hidden + 2 * hidden
    params = layers * per_layer + 2 * vocab * hidden + hidden
    assert _bytes(model) == 2 * params
    # The published sizes: 30.5B and 46.7B parameters.
    assert round(params / 1e9, 1) == (30.5 if experts == 128 else 46.7)
    # fp8: the linears' weights (experts' included) at a byte each, plus their fp32 scales.
    fp8 = _bytes(model, quantization="fp8")
    assert 0.5 < fp8 / (2 * params) < 0.53
