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
from kvfleet.engine.layers.fp8 import quantize_rows
from kvfleet.engine.layers.moe import FusedMoE, SparseMoeBlock, route
from kvfleet.engine.models.llama import LlamaDecoderLayer, LlamaMLP
from kvfleet.engine.models.mixture_of_experts import MoeForCausalLM
from kvfleet.kernels import reference
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


def _experts(gen: torch.Generator, experts: int, hidden: int, inter: int):
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    down = torch.randn(experts, hidden, inter, generator=gen) / inter**0.5
    return gate_up, down


def _direct(x, gate_up, down, weights, ids) -> torch.Tensor:
    """The formula, token by token and slot by slot in fp32; a slot of expert -1 adds nothing."""
    inter = down.shape[-1]
    out = torch.zeros(x.shape[0], x.shape[1])
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if e < 0:
                continue
            xt = x[t].float()
            gate, up = gate_up[e, :inter].float() @ xt, gate_up[e, inter:].float() @ xt
            out[t] += weights[t, j] * (down[e].float() @ (torch.nn.functional.silu(gate) * up))
    return out


def _quantize_experts(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 [E, N, K] and its scale [E, N]: each expert's output channel (row) on its own."""
    fp8, scale = quantize_rows(w.reshape(-1, w.shape[-1]))
    return fp8.view(w.shape), scale.view(w.shape[:2])


@pytest.mark.parametrize("num_tokens", [0, 1, 5, 40])
def test_fused_experts_is_the_weighted_sum_of_each_tokens_experts(num_tokens):
    gen = torch.Generator().manual_seed(num_tokens)
    experts, hidden, inter, top_k = 6, 16, 12, 2
    x = torch.randn(num_tokens, hidden, generator=gen)
    gate_up, down = _experts(gen, experts, hidden, inter)
    weights, ids = route(torch.randn(num_tokens, experts, generator=gen), top_k, True)
    out = reference.fused_experts(x, gate_up, down, weights, ids, "silu")
    assert out.shape == (num_tokens, hidden)
    torch.testing.assert_close(out, _direct(x, gate_up, down, weights, ids), rtol=1e-5, atol=1e-5)


def test_fused_experts_skips_the_slots_of_another_ranks_experts():
    """Expert parallelism: a rank holding experts 0-2 of 6 gets ids -1 for the others."""
    gen = torch.Generator().manual_seed(3)
    experts, hidden, inter, top_k, local = 6, 16, 12, 3, 3
    x = torch.randn(20, hidden, generator=gen)
    gate_up, down = _experts(gen, experts, hidden, inter)
    weights, ids = route(torch.randn(20, experts, generator=gen), top_k, True)
    local_ids = ids.masked_fill(ids >= local, -1)
    assert (local_ids == -1).any() and (local_ids >= 0).any()
    out = reference.fused_experts(x, gate_up[:local], down[:local], weights, local_ids, "silu")
    expected = _direct(x, gate_up, down, weights, local_ids)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    # Every slot elsewhere: zeros, and the other ranks' outputs sum to the whole.
    nowhere = torch.full_like(ids, -1)
    assert not reference.fused_experts(x, gate_up, down, weights, nowhere, "silu").any()
    rest = ids.masked_fill(ids < local, -1)
    whole = reference.fused_experts(x, gate_up, down, weights, ids, "silu")
    other = reference.fused_experts(x, gate_up, down, weights, rest, "silu")
    torch.testing.assert_close(out + other, whole, rtol=1e-5, atol=1e-5)


def test_fused_experts_dequantizes_fp8_weights_per_expert_and_channel():
    gen = torch.Generator().manual_seed(4)
    experts, hidden, inter, top_k = 4, 32, 16, 2
    x = torch.randn(9, hidden, generator=gen).to(torch.bfloat16)
    gate_up, down = _experts(gen, experts, hidden, inter)
    # Experts and channels of very different magnitudes: one scale each is needed.
    gate_up = gate_up * torch.logspace(-2, 1, 2 * inter)[None, :, None]
    down = down * torch.logspace(1, -2, experts)[:, None, None]
    gate_up_q, gate_up_scale = _quantize_experts(gate_up)
    down_q, down_scale = _quantize_experts(down)
    weights, ids = route(torch.randn(9, experts, generator=gen), top_k, True)
    out = reference.fused_experts(
        x, gate_up_q, down_q, weights, ids, "silu", gate_up_scale, down_scale
    )
    assert out.dtype == torch.bfloat16
    dequantized = (
        gate_up_q.float() * gate_up_scale[..., None],
        down_q.float() * down_scale[..., None],
    )
    expected = _direct(x, *dequantized, weights, ids)
    # The gate/up output and the result are rounded to bf16 once each.
    torch.testing.assert_close(
        out.float(), expected, rtol=2e-2, atol=2e-2 * float(expected.abs().max())
    )
    with pytest.raises(ValueError, match="need gate_up_scale and down_scale"):
        reference.fused_experts(x, gate_up_q, down_q, weights, ids, "silu")


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
