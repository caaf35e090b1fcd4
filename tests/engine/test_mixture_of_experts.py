"""Mixtures of experts beyond the shared HF-equality suite (tests/engine/test_engine_equivalence.py
runs Mixtral and Qwen3-MoE too): the routing and the experts' computation against their direct
formulas, Qwen3-MoE's dense/sparse layer mix and unnormalised top-k, the per-expert checkpoint
tensors into the stacked weights, and dummy weights. Two tensor-parallel ranks are in
tests/engine/test_tensor_parallel.py."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvfleet.engine import LLM, SamplingParams
from kvfleet.engine.layers.moe import FusedMoE, SparseMoeBlock, experts_reference, route
from kvfleet.engine.models.llama import LlamaDecoderLayer, LlamaMLP
from kvfleet.engine.models.mixture_of_experts import MoeForCausalLM
from tests.support.engine import MAX_TOKENS, assert_no_leak, hf_greedy
from tests.support.tiny_model import build_tiny_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


def _generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("renormalize", [True, False])
def test_route_is_softmax_top_k(renormalize):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(50, 8, generator=gen, dtype=torch.float64) * 2
    weights, ids = route(logits.to(torch.float32), 3, renormalize)
    assert weights.dtype == torch.float32 and ids.shape == (50, 3)
    for t in range(50):
        probs = [float(v) for v in logits[t].exp() / logits[t].exp().sum()]
        best = sorted(range(8), key=lambda e: -probs[e])[:3]
        assert ids[t].tolist() == best
        total = sum(probs[e] for e in best) if renormalize else 1.0
        expected = torch.tensor([probs[e] / total for e in best])
        torch.testing.assert_close(weights[t].double(), expected.double(), rtol=1e-6, atol=1e-7)


def test_route_softmax_in_fp32_for_bf16_logits():
    logits = torch.tensor([[4.0, 4.01, -3.0, 0.5]], dtype=torch.bfloat16)
    weights, _ = route(logits, 2, renormalize=False)
    assert weights.dtype == torch.float32
    expected = torch.softmax(logits.float(), dim=-1).topk(2).values
    torch.testing.assert_close(weights, expected)


@pytest.mark.parametrize("num_tokens", [0, 1, 5, 40])
def test_experts_reference_is_the_weighted_sum_of_each_tokens_experts(num_tokens):
    gen = torch.Generator().manual_seed(num_tokens)
    experts, hidden, inter, top_k = 6, 16, 12, 2
    x = torch.randn(num_tokens, hidden, generator=gen)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    down = torch.randn(experts, hidden, inter, generator=gen) / inter**0.5
    weights, ids = route(torch.randn(num_tokens, experts, generator=gen), top_k, True)
    out = experts_reference(x, gate_up, down, weights, ids, "silu")
    assert out.shape == (num_tokens, hidden)
    for t in range(num_tokens):
        expected = torch.zeros(hidden)
        for j in range(top_k):
            e = int(ids[t, j])
            gate, up = gate_up[e, :inter] @ x[t], gate_up[e, inter:] @ x[t]
            expected += weights[t, j] * (down[e] @ (torch.nn.functional.silu(gate) * up))
        torch.testing.assert_close(out[t], expected, rtol=1e-5, atol=1e-5)


def test_qwen3_moe_dense_and_sparse_layers_unnormalised_top_k(tmp_path, prompts):
    """Layer 0 in mlp_only_layers, a sparse step of 2: dense, sparse, dense, sparse, as
    transformers builds it; top-k weights not renormalised, which changes HF's own output."""

    def build(name: str, norm_topk_prob: bool):
        return build_tiny_model(
            tmp_path / name,
            "qwen3_moe",
            num_layers=4,
            mlp_only_layers=[0],
            decoder_sparse_step=2,
            norm_topk_prob=norm_topk_prob,
        )

    path, normalised = build("unnormalised", False), build("normalised", True)
    expected = hf_greedy(path, prompts, MAX_TOKENS)
    assert expected != hf_greedy(normalised, prompts, MAX_TOKENS)

    llm = LLM(str(path), dtype="float32")
    model = llm.engine.runner.model
    assert isinstance(model, MoeForCausalLM)
    kinds = [type(m.mlp) for m in model.modules() if isinstance(m, LlamaDecoderLayer)]
    assert kinds == [LlamaMLP, SparseMoeBlock, LlamaMLP, SparseMoeBlock]
    assert _generate(llm, prompts) == expected
    assert_no_leak(llm)


def test_mixtral_sharded_checkpoint_of_per_expert_tensors(tmp_path, prompts):
    path = build_tiny_model(tmp_path / "mixtral", "mixtral", max_shard_size="100KB")
    shards = sorted(path.glob("*.safetensors"))
    assert len(shards) > 1
    names = set().union(*(load_file(f).keys() for f in shards))
    # What transformers writes: one tensor per expert and projection, under block_sparse_moe.
    assert "model.layers.1.block_sparse_moe.experts.7.w2.weight" in names
    llm = LLM(str(path), dtype="float32")
    assert _generate(llm, prompts[:4]) == hf_greedy(path, prompts[:4], MAX_TOKENS)
    assert_no_leak(llm)


def test_missing_expert_is_an_error(tmp_path):
    path = build_tiny_model(tmp_path / "qwen3_moe", "qwen3_moe")
    weights = path / "model.safetensors"
    tensors = load_file(weights)
    del tensors["model.layers.1.mlp.experts.5.up_proj.weight"]
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"lacks weights for: model\.layers\.1\.mlp\.experts"):
        LLM(str(path), dtype="float32")


def test_dummy_weights_differ_per_expert(tmp_path):
    path = build_tiny_model(tmp_path / "mixtral", "mixtral")
    llm = LLM(str(path), load_format="dummy", dtype="float32", skip_tokenizer_init=True)
    model = llm.engine.runner.model
    assert isinstance(model, MoeForCausalLM)
    experts = [m for m in model.modules() if isinstance(m, FusedMoE)]
    assert len(experts) == 2
    gate_up, inter = experts[0].gate_up_proj, experts[0].intermediate_size
    assert not torch.equal(gate_up[0], gate_up[1])
    assert not torch.equal(gate_up[0, :inter], gate_up[0, inter:])  # gate and up
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": [5, 6, 7, 8]}, sp)[0]
    assert len(out.outputs[0].token_ids) == 4
    assert_no_leak(llm)


def test_an_unsplittable_width_is_refused(monkeypatch):
    monkeypatch.setattr("kvfleet.engine.layers.moe.tp_size", lambda: 3)
    with pytest.raises(ValueError, match="intermediate size 8 does not split over 3"):
        FusedMoE(4, 2, 16, 8, "silu")
