"""Expert parallelism's placement (--enable-expert-parallel): which experts a rank holds, global
ids to its own, the loader reading only its experts' tensors, and the errors. That 2 ranks
generate what 1 does is tests/engine/test_tensor_parallel.py."""

from __future__ import annotations

import pytest
import torch

from kvfleet.engine.config import EngineArgs, ModelConfig
from kvfleet.engine.layers.moe import FusedMoE, expert_parallel_layers
from kvfleet.engine.models import build_pooling_model, loader
from kvfleet.engine.models.mixture_of_experts import MoeForCausalLM
from tests.support.tiny_model import build_tiny_model


@pytest.fixture
def rank1_of_2(monkeypatch):
    monkeypatch.setattr("kvfleet.engine.layers.moe.tp_size", lambda: 2)
    monkeypatch.setattr("kvfleet.engine.layers.moe.tp_rank", lambda: 1)


def test_a_rank_holds_its_share_of_the_experts_whole(rank1_of_2):
    with expert_parallel_layers(True):
        moe = FusedMoE(8, 2, 16, 32, "silu")
    assert moe.local_experts == range(4, 8) and moe.intermediate_size == 32
    assert moe.gate_up_proj.shape == (4, 64, 16) and moe.down_proj.shape == (4, 16, 32)
    ids = torch.tensor([[0, 4], [7, 3], [5, 6]])
    assert moe.local_ids(ids).tolist() == [[-1, 0], [3, -1], [1, 2]]
    # Its experts load whole into their slots; another rank's is an error, not a silent skip.
    down = torch.randn(16, 32)
    moe.weight_loader(moe.down_proj, down, "6")
    assert torch.equal(moe.down_proj[2], down)
    with pytest.raises(ValueError, match=r"expert 3: this rank holds experts 4\.\.7"):
        moe.weight_loader(moe.down_proj, down, "3")
    # Without expert parallelism the same rank holds a half of every expert.
    split = FusedMoE(8, 2, 16, 32, "silu")
    assert split.local_experts == range(8) and split.gate_up_proj.shape == (8, 32, 16)


def test_experts_must_divide_over_the_ranks(monkeypatch, tmp_path):
    monkeypatch.setattr("kvfleet.engine.layers.moe.tp_size", lambda: 4)
    with expert_parallel_layers(True), pytest.raises(ValueError, match="6 experts do not divide"):
        FusedMoE(6, 2, 16, 32, "silu")
    path = build_tiny_model(tmp_path / "m", "mixtral", num_local_experts=6)
    args = EngineArgs(model=str(path), device="cpu", tensor_parallel_size=4,
                      enable_expert_parallel=True)  # fmt: skip
    with pytest.raises(ValueError, match=r"6 experts do not divide over tensor_parallel_size=4"):
        ModelConfig.from_args(args, torch.device("cpu"))
    # Off, or on one rank, nothing changes.
    args = args.model_copy(update={"tensor_parallel_size": 2})
    assert ModelConfig.from_args(args, torch.device("cpu")).expert_parallel
    off = args.model_copy(update={"enable_expert_parallel": False})
    assert not ModelConfig.from_args(off, torch.device("cpu")).expert_parallel


@pytest.mark.parametrize("runner", ["generate", "pooling"])
def test_the_loader_never_reads_another_ranks_experts(rank1_of_2, model_dirs, monkeypatch, runner):
    """Rank 1 of 2 reads the shared tensors and experts 4..7, not one tensor of experts 0..3;
    the embedding model (--runner pooling) the same, and never the LM head."""
    from transformers import AutoConfig

    path = model_dirs["mixtral"]
    read: list[str] = []
    real_open = loader.safe_open

    class Recording:
        def __init__(self, *args, **kwargs):
            self.f = real_open(*args, **kwargs)

        def __enter__(self):
            self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def keys(self):
            return self.f.keys()

        def get_tensor(self, name):
            read.append(name)
            return self.f.get_tensor(name)

    monkeypatch.setattr(loader, "safe_open", Recording)
    config = AutoConfig.from_pretrained(path)
    with expert_parallel_layers(True):
        if runner == "generate":
            model = MoeForCausalLM(config, "MixtralForCausalLM")
        else:
            model = build_pooling_model(config, "MixtralForCausalLM")
    loader.load_weights(model, path, progress=False)
    experts = {int(n.split(".experts.")[1].split(".")[0]) for n in read if ".experts." in n}
    assert experts == {4, 5, 6, 7}
    assert (
        "model.embed_tokens.weight" in read
        and "model.layers.1.block_sparse_moe.gate.weight" in read
    )
    assert ("lm_head.weight" in read) == (runner == "generate")
