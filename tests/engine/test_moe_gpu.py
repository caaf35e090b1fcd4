"""The fused mixture-of-experts kernel on the GPU (kernels.fused_moe): against its twin at
Qwen3-30B-A3B's and Mixtral-8x7B's expert shapes in bf16 and fp8 weights (W8A16 and W8A8), from
decode to prefill token counts, with slots of other ranks' experts and an intermediate dimension
split over two ranks; replayed from a captured CUDA graph with new routings; the routing and
alignment in one launch (expert_routing.route_and_align) against the launches it replaces, and the
MoE layer taking it at decode sizes, under a CUDA graph too; and the tiny MoE models served with
CUDA graphs, greedy output equal to eager and to HF. Skipped where no GPU is
visible (CI); run on one with `pytest -q tests/engine/test_moe_gpu.py` (bench/gpu_run.sh OUT
moe-tests)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kvfleet.engine import LLM, SamplingParams
from kvfleet.engine.layers.fp8 import quantize_rows
from kvfleet.engine.layers.moe import FusedMoE, route
from kvfleet.kernels import expert_routing, fused_moe, reference
from tests.support.engine import MAX_TOKENS, assert_no_leak, hf_greedy
from tests.support.tiny_model import MOE_ARCHITECTURES

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# (hidden, moe intermediate, experts, top_k)
QWEN3_30B_A3B = (2048, 768, 128, 8)
QWEN3_30B_A3B_TP2 = (2048, 384, 128, 8)  # one rank's share of each expert's intermediate
MIXTRAL_8X7B = (4096, 14336, 8, 2)
# Qwen3-30B-A3B's largest token count routed and aligned in one launch.
ONE_LAUNCH_TOKENS = expert_routing.ROUTE_ALIGN_MAX_PAIRS // QWEN3_30B_A3B[3]


def _experts(shape: tuple[int, int, int, int], fp8: bool, seed: int) -> tuple:
    hidden, inter, experts, _ = shape
    gen = torch.Generator(device="cuda").manual_seed(seed)
    gate_up = torch.randn(experts, 2 * inter, hidden, device="cuda", generator=gen) / hidden**0.5
    down = torch.randn(experts, hidden, inter, device="cuda", generator=gen) / inter**0.5
    if not fp8:
        return gate_up.to(torch.bfloat16), down.to(torch.bfloat16), None, None
    (gate_up_q, gate_up_scale), (down_q, down_scale) = (
        (q.view(w.shape), s.view(w.shape[:2]))
        for w in (gate_up, down)
        for q, s in [quantize_rows(w.reshape(-1, w.shape[-1]))]
    )
    return gate_up_q, down_q, gate_up_scale, down_scale


def _inputs(shape: tuple[int, int, int, int], tokens: int, seed: int, skip: bool) -> tuple:
    hidden, _, experts, top_k = shape
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, hidden, device="cuda", generator=gen).to(torch.bfloat16)
    logits = torch.randn(tokens, experts, device="cuda", generator=gen)
    weights, ids = route(logits, top_k, True)
    if skip:  # an expert-parallel rank holding the first half of the experts
        ids = ids.masked_fill(ids >= experts // 2, -1)
    return x, weights, ids


# W8A8's distance from its twin, as a share of the output's norm. The kernel and the twin
# compute act(gate) * up a bf16 rounding apart (other summation orders), and where that straddles
# an e4m3 rounding boundary (a step of 6-12%, against bf16's 0.4%) the two quantize it one fp8
# step apart; Hopper's fp8 MMA also accumulates with fewer bits than fp32 (as vLLM's fused MoE
# does by default). The H200 put the W8A8 cases at 1.5-2.4% of the norm (twenty-second session;
# a 1% bound failed them all), W8A16 and bf16 within 1%. A skipped or misplaced scale is off by
# the whole output.
W8A8_NORM_TOLERANCE = 4e-2


def _assert_close_to_twin(got: torch.Tensor, want: torch.Tensor, w8a8: bool = False) -> None:
    """bf16: the kernel rounds its gate/up product and each pair's output once, the twin rounds
    after each of its PyTorch ops; 1% of the norm (W8A8_NORM_TOLERANCE under W8A8), and no
    element off by 5% of the largest."""
    got, want = got.float(), want.float()
    assert torch.isfinite(got).all()
    if not want.any():
        # Every expert of every token on another rank (one token, expert parallel): nothing here
        # adds to the output, which must be exactly zero.
        assert not got.any()
        return
    assert float((got - want).norm() / want.norm()) < (W8A8_NORM_TOLERANCE if w8a8 else 1e-2)
    assert float((got - want).abs().max()) < 5e-2 * float(want.abs().max())


def _captured(call: Callable[[], torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """call() captured in a CUDA graph (its kernels compiled by a first call outside the
    capture, on a side stream as capture wants), and the graph's output tensor."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    return graph, out


@pytest.mark.parametrize("tokens", [1, 7, 256, 4096])
@pytest.mark.parametrize(
    ("shape", "mode", "skip"),
    [
        (QWEN3_30B_A3B, "bf16", False),
        (QWEN3_30B_A3B, "w8a16", True),
        (QWEN3_30B_A3B, "w8a8", False),
        (QWEN3_30B_A3B, "w8a8", True),
        (QWEN3_30B_A3B_TP2, "w8a8", False),
        (MIXTRAL_8X7B, "bf16", True),
        (MIXTRAL_8X7B, "w8a16", False),
        (MIXTRAL_8X7B, "w8a8", True),
    ],
    ids=[
        "qwen3-bf16", "qwen3-w8a16-ep", "qwen3-w8a8", "qwen3-w8a8-ep", "qwen3-tp2-w8a8",
        "mixtral-bf16-ep", "mixtral-w8a16", "mixtral-w8a8-ep",
    ],
)  # fmt: skip
def test_fused_experts_equals_the_twin_at_real_sizes(tokens, shape, mode, skip):
    gate_up, down, gate_up_scale, down_scale = _experts(shape, mode != "bf16", seed=0)
    x, weights, ids = _inputs(shape, tokens, seed=tokens, skip=skip)
    args = (x, gate_up, down, weights, ids, "silu", gate_up_scale, down_scale, mode == "w8a8")
    got = fused_moe.fused_experts(*args)
    assert got.shape == x.shape and got.dtype == torch.bfloat16
    _assert_close_to_twin(got, reference.fused_experts(*args), mode == "w8a8")
    # Deterministic: the combine sums each token's slots in order.
    assert torch.equal(fused_moe.fused_experts(*args), got)


@pytest.mark.parametrize("tokens", [1, 300])
def test_w8a8_quantizes_as_its_twin_does(tokens):
    """The GPU's fp8 casts round to nearest as the twin's do, and the scales are the twin's: W8A8
    lies well closer to its own twin than to W8A16's (which it would not if it quantized
    differently or skipped a scale). Not exactly: see W8A8_NORM_TOLERANCE (the H200 measured
    0.39-0.46 of W8A16's distance)."""
    gate_up, down, gate_up_scale, down_scale = _experts(QWEN3_30B_A3B, True, seed=5)
    x, weights, ids = _inputs(QWEN3_30B_A3B, tokens, seed=6, skip=False)
    args = (x, gate_up, down, weights, ids, "silu", gate_up_scale, down_scale)
    got = fused_moe.fused_experts(*args, fp8_activations=True).float()
    want = reference.fused_experts(*args, fp8_activations=True).float()
    w8a16 = reference.fused_experts(*args).float()
    assert float((got - want).norm()) < 0.6 * float((w8a16 - want).norm())


@pytest.mark.parametrize(("tokens", "mode"), [(1, "bf16"), (48, "bf16"), (48, "w8a8"),
                                               (512, "w8a8")])  # fmt: skip
def test_fused_experts_replayed_from_a_cuda_graph_with_new_routings(tokens, mode):
    gate_up, down, gate_up_scale, down_scale = _experts(QWEN3_30B_A3B, mode == "w8a8", seed=1)
    x, weights, ids = _inputs(QWEN3_30B_A3B, tokens, seed=2, skip=False)
    experts = (gate_up, down, weights, ids, "silu", gate_up_scale, down_scale, mode == "w8a8")

    def call() -> torch.Tensor:
        return fused_moe.fused_experts(x, *experts)

    graph, out = _captured(call)
    for seed in (3, 4):
        # Other block counts than the capture's: half the tokens crowded onto experts 0-7 (runs
        # of several blocks), then a routing with the slots of another rank's experts.
        new_x, new_weights, new_ids = _inputs(QWEN3_30B_A3B, tokens, seed=seed, skip=seed == 4)
        if seed == 3:
            new_ids[: tokens // 2 + 1] = torch.arange(8, device="cuda")
        x.copy_(new_x)
        weights.copy_(new_weights)
        ids.copy_(new_ids)
        graph.replay()
        want = reference.fused_experts(x, *experts)
        _assert_close_to_twin(out, want, mode == "w8a8")


@pytest.mark.parametrize("tokens", [1, 7, ONE_LAUNCH_TOKENS])
@pytest.mark.parametrize("ep", [False, True], ids=["whole", "ep-rank1"])
def test_route_and_align_equals_route_then_align_at_qwen3_sizes(tokens, ep):
    hidden, _, experts, top_k = QWEN3_30B_A3B
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    # The router's bf16 logits: ties are common.
    logits = torch.randn(tokens, experts, device="cuda", generator=gen).to(torch.bfloat16)
    local = range(experts // 2, experts) if ep else range(experts)
    block_m = fused_moe.call_tile(tokens, False).block_m
    got = expert_routing.route_and_align(logits, top_k, True, local, block_m)
    weights, ids = expert_routing.route_experts(logits, top_k, True)
    ids = ids - local.start
    ids = torch.where((ids >= 0) & (ids < len(local)), ids, -1)
    sorted_pairs, block_expert = fused_moe.align(ids, len(local), block_m)
    torch.testing.assert_close(got.weights, weights, rtol=1e-6, atol=1e-7)
    assert torch.equal(got.ids, ids)
    assert torch.equal(got.block_expert, block_expert)
    used = int((block_expert >= 0).sum()) * block_m
    assert torch.equal(got.sorted_pairs[:used], sorted_pairs[:used])
    # The experts run on its buffers as on align's.
    gate_up, down, _, _ = _experts(QWEN3_30B_A3B, False, seed=0)
    gate_up, down = gate_up[local.start : local.stop], down[local.start : local.stop]
    x = torch.randn(tokens, hidden, device="cuda", generator=gen).to(torch.bfloat16)
    args = (x, gate_up, down, got.weights, got.ids, "silu")
    aligned = (got.sorted_pairs, got.block_expert)
    assert torch.equal(
        fused_moe.fused_experts(*args, aligned=aligned), fused_moe.fused_experts(*args)
    )


@pytest.fixture(scope="module")
def qwen3_experts() -> FusedMoE:
    """One layer's experts at Qwen3-30B-A3B's shapes, bf16, on the GPU."""
    hidden, inter, experts, top_k = QWEN3_30B_A3B
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            moe = FusedMoE(experts, top_k, hidden, inter, "silu")
    finally:
        torch.set_default_dtype(previous)
    moe.gate_up_proj.data, moe.down_proj.data, _, _ = _experts(QWEN3_30B_A3B, False, seed=8)
    return moe


def _layer_twin(moe: FusedMoE, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    weights, ids = reference.route_experts(logits, moe.top_k, True)
    return reference.fused_experts(x, moe.gate_up_proj, moe.down_proj, weights, ids, "silu")


@pytest.mark.parametrize(
    ("tokens", "one_launch"),
    [(1, True), (ONE_LAUNCH_TOKENS, True), (ONE_LAUNCH_TOKENS + 1, False)],
)
def test_moe_layer_routes_and_aligns_in_one_launch_at_decode_sizes(
    tokens, one_launch, qwen3_experts, monkeypatch
):
    calls = []
    for module, name in ((expert_routing, "route_and_align"), (fused_moe, "align")):
        real = getattr(module, name)
        monkeypatch.setattr(
            module, name, lambda *a, real=real, name=name, **k: calls.append(name) or real(*a, **k)
        )
    x, _, _ = _inputs(QWEN3_30B_A3B, tokens, seed=9, skip=False)
    logits = torch.randn(tokens, QWEN3_30B_A3B[2], device="cuda").to(torch.bfloat16)
    got = qwen3_experts.routed(x, logits, True)
    assert calls == (["route_and_align"] if one_launch else ["align"])
    _assert_close_to_twin(got, _layer_twin(qwen3_experts, x, logits))


@pytest.mark.parametrize("tokens", [1, ONE_LAUNCH_TOKENS])
def test_moe_layer_replayed_from_a_cuda_graph_with_new_routings(tokens, qwen3_experts):
    x, _, _ = _inputs(QWEN3_30B_A3B, tokens, seed=10, skip=False)
    logits = torch.randn(tokens, QWEN3_30B_A3B[2], device="cuda").to(torch.bfloat16)

    def call() -> torch.Tensor:
        return qwen3_experts.routed(x, logits, True)

    graph, out = _captured(call)
    for seed in (11, 12):
        new_x, _, _ = _inputs(QWEN3_30B_A3B, tokens, seed=seed, skip=False)
        new_logits = torch.randn(tokens, QWEN3_30B_A3B[2], device="cuda")
        if seed == 11:
            # Every token on experts 0-7: other runs and block counts than the capture's.
            new_logits[:, :8] += 20
        x.copy_(new_x)
        logits.copy_(new_logits)
        graph.replay()
        _assert_close_to_twin(out, _layer_twin(qwen3_experts, x, logits))
        assert torch.equal(out, call())


@pytest.mark.parametrize("arch", MOE_ARCHITECTURES)
def test_moe_models_with_cuda_graphs_equal_eager_and_hf(arch, model_dirs, prompts):
    """fp32 (the kernel multiplies in full fp32, not TF32): greedy output token for token."""
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    outputs = {}
    for eager in (False, True):
        llm = LLM(str(model_dirs[arch]), dtype="float32", device="cuda", enforce_eager=eager)
        assert (llm.engine.runner.graphs is None) == eager
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
        outputs[eager] = [o.outputs[0].token_ids for o in outs]
        assert_no_leak(llm)
        del llm
        torch.cuda.empty_cache()
    assert outputs[False] == outputs[True] == hf_greedy(model_dirs[arch], prompts, MAX_TOKENS)
