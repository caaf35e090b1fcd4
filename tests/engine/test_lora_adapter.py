"""PEFT adapter folders the engine refuses, each with an error that names what is wrong: the
options it does not apply, a rank above --max-lora-rank, tensors of modules it does not serve,
shapes that do not fit the base model; and the scaling it folds into B."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from kvfleet.engine.engine_args import EngineArgs
from kvfleet.engine.lora_adapter import (
    LoRAAdapterError,
    TargetShape,
    check_weights,
    read_config,
    read_weights,
)
from kvfleet.engine.lora_request import LoRARequest

Q = "model.layers.0.self_attn.q_proj"
TARGETS = {Q: TargetShape(32, 16), "model.layers.0.mlp.down_proj": TargetShape(16, 48)}


def _adapter(path: Path, tensors: dict[str, torch.Tensor] | None = None, **config) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    base = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}
    (path / "adapter_config.json").write_text(json.dumps(base | config))
    if tensors is None:
        tensors = {
            f"base_model.model.{Q}.lora_A.weight": torch.ones(4, 16),
            f"base_model.model.{Q}.lora_B.weight": torch.ones(32, 4),
        }
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return path


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("use_dora", True, "DoRA"),
        ("bias", "all", "bias='all'"),
        ("modules_to_save", ["lm_head"], "modules_to_save"),
        ("rank_pattern", {"q_proj": 8}, "rank_pattern"),
        ("target_modules", ["q_proj", "lm_head"], r"target_modules \['lm_head'\]"),
        ("peft_type", "IA3", "peft_type 'IA3'"),
        ("r", 32, "rank 32 is above the engine's --max-lora-rank 16"),
    ],
)
def test_unsupported_options_are_refused_by_name(tmp_path, option, value, message):
    path = _adapter(tmp_path / "a", **{option: value})
    with pytest.raises(LoRAAdapterError, match=message):
        read_config(path, max_rank=16)


def test_tensors_are_checked_against_the_base_model(tmp_path):
    config = read_config(_adapter(tmp_path / "ok"), 16)
    check_weights(tmp_path / "ok", config, TARGETS)
    embed = {"base_model.model.model.embed_tokens.lora_embedding_A": torch.ones(4, 8)}
    with pytest.raises(LoRAAdapterError, match="embed_tokens"):
        check_weights(_adapter(tmp_path / "embed", embed), config, TARGETS)
    wide = {
        f"base_model.model.{Q}.lora_A.weight": torch.ones(4, 17),
        f"base_model.model.{Q}.lora_B.weight": torch.ones(32, 4),
    }
    with pytest.raises(LoRAAdapterError, match=r"shape \[4, 17\]; .* need \[4, 16\]"):
        check_weights(_adapter(tmp_path / "wide", wide), config, TARGETS)
    alone = {f"base_model.model.{Q}.lora_A.weight": torch.ones(4, 16)}
    with pytest.raises(LoRAAdapterError, match="lora_A without its pair"):
        check_weights(_adapter(tmp_path / "alone", alone), config, TARGETS)
    with pytest.raises(LoRAAdapterError, match=r"no adapter_config\.json"):
        read_config(tmp_path / "missing", 16)


@pytest.mark.parametrize(("rslora", "scale"), [(False, 8 / 4), (True, 8 / math.sqrt(4))])
def test_the_scaling_is_folded_into_b(tmp_path, rslora, scale):
    path = _adapter(tmp_path / "a", use_rslora=rslora)
    adapter = read_weights(path, read_config(path, 16), TARGETS)
    a, b = adapter.weights[Q]
    assert torch.equal(a, torch.ones(4, 16))
    assert torch.allclose(b, torch.full((32, 4), scale))


def test_lora_modules_are_read_as_vllm_takes_them():
    args = EngineArgs(
        model="m", enable_lora=True, lora_modules=["a=/x", '{"name": "b", "path": "/y"}']
    )
    assert args.lora_requests() == [LoRARequest("a", 1, "/x"), LoRARequest("b", 2, "/y")]
    assert args.cpu_loras == args.max_loras == 1
    refusals = [
        ({"lora_modules": ["a=/x"]}, "lora_modules needs enable_lora"),
        ({"enable_lora": True, "lora_modules": ["a=/x", "a=/y"]}, r"names \['a'\] more than once"),
        ({"enable_lora": True, "lora_modules": ["nopath"]}, "is not name=path"),
        ({"enable_lora": True, "lora_modules": ['{"name": "a"}']}, "needs a name and a path"),
        ({"enable_lora": True, "max_loras": 4, "max_cpu_loras": 2}, "at least max_loras"),
    ]
    for kwargs, message in refusals:
        with pytest.raises(ValueError, match=message):
            EngineArgs(model="m", **kwargs)


def test_the_rank_bound_is_the_kernels_and_the_operators():
    from kvfleet.engine.engine_args import MAX_LORA_RANK
    from kvfleet.kernels import lora
    from kvfleet.operator import spec

    assert MAX_LORA_RANK == lora.MAX_RANK == spec.MAX_LORA_RANK
    with pytest.raises(ValueError, match="less than or equal to 256"):
        EngineArgs(model="m", enable_lora=True, max_lora_rank=MAX_LORA_RANK + 1)
