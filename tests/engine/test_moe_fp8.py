"""FP8 experts on the CPU: experts quantized at load per (expert, output channel), pre-quantized
mixture-of-experts checkpoints (compressed-tensors per channel, vLLM's fp8 per tensor with static
activation scales, and block-scaled as Qwen3's *-FP8 ship) against their exact dequantized twins
quantized at load, and the errors of bad scales. The dense layers' fp8 is
tests/engine/test_fp8_weights.py."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvfleet.engine.layers.fp8 import (
    FP8,
    Fp8Config,
    dequantize_blocks,
    fp8_linear_layers,
    quantize_rows,
    resolve_fp8,
)
from kvfleet.engine.layers.moe import W8A8_MIN_TOKENS, FusedMoE
from kvfleet.engine.llm import LLM, TokensPrompt
from kvfleet.engine.sampling_params import SamplingParams
from kvfleet.kernels import reference
from tests.support.fp8_checkpoint import (
    FIXTURE_BLOCK,
    quantize_blocks_fixture,
    write_dequantized,
    write_fp8_checkpoint,
)

PROMPTS = [[(7 * i + 3 * j) % 480 + 3 for j in range(n)] for i, n in enumerate((1, 17, 40))]
EXPERTS = "model.layers.1.mlp.experts."


def _greedy(path: Path, **engine_args) -> tuple[list[list[int]], dict[str, torch.Tensor]]:
    sp = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    with LLM(str(path), device="cpu", skip_tokenizer_init=True, **engine_args) as llm:
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], sp)
        model = llm.engine.runner.model
        assert isinstance(model, torch.nn.Module)
        params = {k: v.detach().clone() for k, v in model.named_parameters()}
    return [o.outputs[0].token_ids for o in outs], params


def _assert_same_params(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name, value in a.items():
        assert value.dtype == b[name].dtype, name
        assert torch.equal(value.float(), b[name].float()), name


@pytest.fixture(scope="module")
def fp8_dirs(model_dirs, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe-fp8")
    qwen = model_dirs["qwen3_moe"]
    dirs = {
        "channel": write_fp8_checkpoint(qwen, root / "ct-channel", "compressed-tensors",
                                        per_channel=True),
        "block": write_fp8_checkpoint(qwen, root / "block", "fp8-block", per_channel=False),
        "mixtral-static": write_fp8_checkpoint(model_dirs["mixtral"], root / "mixtral-static",
                                               "fp8", per_channel=False, static=True),
    }  # fmt: skip
    dirs["dequantized"] = write_dequantized(dirs["channel"], root / "dequantized")
    dirs["block-dequantized"] = write_dequantized(dirs["block"], root / "block-dequantized")
    return dirs


def test_fp8_experts_checkpoint_equals_its_twin_quantized_at_load(fp8_dirs):
    """The per-channel checkpoint's experts load as stored (gate rows, then up rows, each with
    its scales); the bf16 twin quantized at load holds the same fp8 weights and scales and
    generates the same tokens. The router gate, embeddings and LM head keep the model dtype."""
    pre, pre_params = _greedy(fp8_dirs["channel"])
    at_load, load_params = _greedy(fp8_dirs["dequantized"], quantization="fp8")
    _assert_same_params(pre_params, load_params)
    assert pre == at_load
    assert len({tuple(t) for t in pre}) == len(pre)  # distinct outputs: a real comparison

    stored = load_file(next(fp8_dirs["channel"].glob("*.safetensors")))
    for e in (0, 5):
        src = f"{EXPERTS}{e}."
        gate_up = torch.cat([stored[f"{src}gate_proj.weight"], stored[f"{src}up_proj.weight"]])
        scales = [stored[f"{src}{p}_proj.weight_scale"].reshape(-1) for p in ("gate", "up")]
        assert pre_params[EXPERTS + "gate_up_proj"].dtype == FP8
        assert torch.equal(pre_params[EXPERTS + "gate_up_proj"][e].float(), gate_up.float())
        assert torch.equal(pre_params[EXPERTS + "gate_up_scale"][e], torch.cat(scales))
        down = stored[f"{src}down_proj.weight"]
        assert torch.equal(pre_params[EXPERTS + "down_proj"][e].float(), down.float())
        assert torch.equal(
            pre_params[EXPERTS + "down_scale"][e], stored[f"{src}down_proj.weight_scale"].flatten()
        )
    for name in ("model.layers.1.mlp.gate.weight", "lm_head.weight", "model.embed_tokens.weight"):
        assert pre_params[name].dtype == torch.float32


def test_per_tensor_scales_expand_to_their_experts_rows(fp8_dirs):
    """vLLM's fp8 format (Mixtral's w1/w3/w2 names): one scale per expert projection, each
    expanded to its rows, gate's and up's apart; the experts' static input scales are not
    used (their activations are quantized per token, or stay in the model dtype) while the
    attention's are. Static
    activation scales make the dense layers' split arithmetic the unsplit one's, so experts
    placed per rank, each loading only its own weights and scales, generate the same tokens."""
    one, params = _greedy(fp8_dirs["mixtral-static"])
    two, rank0 = _greedy(
        fp8_dirs["mixtral-static"], tensor_parallel_size=2, enable_expert_parallel=True
    )
    assert two == one
    assert torch.equal(rank0[EXPERTS + "down_scale"], params[EXPERTS + "down_scale"][:4])
    stored = load_file(next(fp8_dirs["mixtral-static"].glob("*.safetensors")))
    inter = params[EXPERTS + "gate_up_scale"].shape[1] // 2
    for e in (1, 7):
        src = f"model.layers.1.block_sparse_moe.experts.{e}."
        gate_up = params[EXPERTS + "gate_up_scale"][e]
        assert (gate_up[:inter] == stored[src + "w1.weight_scale"]).all()
        assert (gate_up[inter:] == stored[src + "w3.weight_scale"]).all()
        assert (params[EXPERTS + "down_scale"][e] == stored[src + "w2.weight_scale"]).all()
    assert stored[src + "w1.input_scale"].item() > 0
    assert not any("experts" in n and "input_scale" in n for n in params)
    assert params["model.layers.1.self_attn.qkv_proj.input_scale"].item() > 0


def test_block_scaled_checkpoint_loads_requantized_per_channel(fp8_dirs):
    """Block-scaled fp8 (weight_block_size, tiles of several scales with partial ones at the
    edges) loads everywhere, attention and experts, multiplied out and quantized per channel:
    exactly what its bf16 twin quantized at load holds, so the same tokens."""
    block, block_params = _greedy(fp8_dirs["block"])
    twin, twin_params = _greedy(fp8_dirs["block-dequantized"], quantization="fp8")
    _assert_same_params(block_params, twin_params)
    assert block == twin
    assert block_params["model.layers.0.self_attn.qkv_proj.weight"].dtype == FP8
    assert block_params[EXPERTS + "down_proj"].dtype == FP8


def test_block_requantization_error():
    """What requantizing tiles per channel costs (fp8.py's docstring): one more e4m3 rounding on
    each row's grid, about 2% of a matrix's norm, as much as quantizing bf16 weights does."""
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(256, 384, generator=gen) * torch.logspace(-1, 1, 3).repeat_interleave(128)
    q, scale_inv = quantize_blocks_fixture(w, (128, 128))
    tiles = dequantize_blocks(q, scale_inv, (128, 128), "w")
    rows, row_scale = quantize_rows(tiles)
    requantized = rows.float() * row_scale[:, None]
    rel = (requantized - tiles).norm() / tiles.norm()
    once = (quantize_rows(w)[0].float() * quantize_rows(w)[1][:, None] - w).norm() / w.norm()
    assert 0.005 < rel < 0.04 and rel < 2 * once


def test_experts_quantized_at_load_compute_what_their_dequantized_weights_do():
    """Each expert's rows scaled apart (per expert and output channel, a down row's over its
    whole width): the fp8 experts' output is the dequantized weights' output."""
    gen = torch.Generator().manual_seed(4)
    experts, hidden, inter = 4, 32, 48
    with fp8_linear_layers(Fp8Config()):
        fp8 = FusedMoE(experts, 2, hidden, inter, "silu")
    full = FusedMoE(experts, 2, hidden, inter, "silu")
    for e in range(experts):
        # Experts and rows of very different magnitudes: one shared scale would not do.
        for part in ("gate", "up"):
            w = torch.randn(inter, hidden, generator=gen) * 10.0 ** (e - 2)
            fp8.weight_loader(fp8.gate_up_proj, w, f"{e}.{part}")
            q, s = quantize_rows(w)
            full.weight_loader(full.gate_up_proj, q.float() * s[:, None], f"{e}.{part}")
        w = torch.randn(hidden, inter, generator=gen) * torch.logspace(-2, 1, hidden)[:, None]
        fp8.weight_loader(fp8.down_proj, w, str(e))
        q, s = quantize_rows(w)
        full.weight_loader(full.down_proj, q.float() * s[:, None], str(e))
    x = torch.randn(9, hidden, generator=gen)
    weights = torch.rand(9, 2, generator=gen)
    ids = torch.randint(0, experts, (9, 2), generator=gen)
    expected = full(x, weights, ids)
    # fp32 both ways; the sums run in another order (scaled after the products, not before).
    scale = float(expected.abs().max())
    torch.testing.assert_close(fp8(x, weights, ids), expected, rtol=1e-5, atol=1e-6 * scale)


def test_fp8_experts_quantize_their_activations_from_w8a8_min_tokens():
    """Below W8A8_MIN_TOKENS the activations stay in the model dtype (W8A16); from it they are
    quantized per row (W8A8), and the two differ by about what quantizing them costs."""
    gen = torch.Generator().manual_seed(6)
    with fp8_linear_layers(Fp8Config()):
        moe = FusedMoE(4, 2, 32, 48, "silu")
    for e in range(4):
        for part in ("gate", "up"):
            moe.weight_loader(moe.gate_up_proj, torch.randn(48, 32, generator=gen), f"{e}.{part}")
        moe.weight_loader(moe.down_proj, torch.randn(32, 48, generator=gen), str(e))
    weights = (moe.gate_up_proj, moe.down_proj)
    scales = (moe.gate_up_scale, moe.down_scale)
    for tokens in (W8A8_MIN_TOKENS - 1, W8A8_MIN_TOKENS):
        x = torch.randn(tokens, 32, generator=gen)
        routing = torch.rand(tokens, 2, generator=gen), torch.randint(0, 4, (tokens, 2))
        modes = {
            a8: reference.fused_experts(x, *weights, *routing, "silu", *scales, a8)
            for a8 in (False, True)
        }
        got = moe(x, *routing)
        assert torch.equal(got, modes[tokens >= W8A8_MIN_TOKENS])
        assert 1e-3 < float((modes[True] - modes[False]).norm() / modes[False].norm()) < 0.1


def test_a_split_experts_rows_keep_their_whole_scales(monkeypatch):
    """Each expert's intermediate dimension split over 2 ranks, quantized at load: rank 1 holds
    its rows of gate/up with their own scales, and its columns of down scaled over the whole
    row, as one rank holds them."""
    gen = torch.Generator().manual_seed(5)
    gate, up = torch.randn(48, 32, generator=gen), torch.randn(48, 32, generator=gen)
    down = torch.randn(32, 48, generator=gen) * torch.logspace(-2, 1, 48)  # columns differ
    with fp8_linear_layers(Fp8Config()):
        whole = FusedMoE(4, 2, 32, 48, "silu")
        monkeypatch.setattr("kvfleet.engine.layers.moe.tp_size", lambda: 2)
        monkeypatch.setattr("kvfleet.engine.layers.moe.tp_rank", lambda: 1)
        half = FusedMoE(4, 2, 32, 48, "silu")
    for moe in (whole, half):
        moe.weight_loader(moe.gate_up_proj, gate, "2.gate")
        moe.weight_loader(moe.gate_up_proj, up, "2.up")
        moe.weight_loader(moe.down_proj, down, "2")
    assert whole.gate_up_scale is not None and half.gate_up_scale is not None
    assert whole.down_scale is not None and half.down_scale is not None
    rows = torch.cat([torch.arange(24, 48), torch.arange(72, 96)])
    assert torch.equal(half.gate_up_proj[2].float(), whole.gate_up_proj[2][rows].float())
    assert torch.equal(half.gate_up_scale[2], whole.gate_up_scale[2][rows])
    assert torch.equal(half.down_proj[2].float(), whole.down_proj[2][:, 24:].float())
    assert torch.equal(half.down_scale[2], whole.down_scale[2])


def test_w8a8_experts_split_over_two_ranks_sum_to_the_whole(monkeypatch):
    """Each expert's intermediate dimension split over 2 ranks under W8A8: each rank quantizes
    its own slice of act(gate) * up per row (its own scale), and the ranks' partial outputs
    sum to the unsplit experts' within what quantizing the activations costs."""
    gen = torch.Generator().manual_seed(7)
    experts, hidden, inter = 4, 32, 48
    gate_up = torch.randn(experts, 2, inter, hidden, generator=gen)
    down = torch.randn(experts, hidden, inter, generator=gen) * torch.logspace(-1, 1, inter)
    x = torch.randn(W8A8_MIN_TOKENS, hidden, generator=gen)
    routing = torch.rand(len(x), 2, generator=gen), torch.randint(0, experts, (len(x), 2))

    def build(size: int, rank: int) -> FusedMoE:
        monkeypatch.setattr("kvfleet.engine.layers.moe.tp_size", lambda: size)
        monkeypatch.setattr("kvfleet.engine.layers.moe.tp_rank", lambda: rank)
        with fp8_linear_layers(Fp8Config()):
            moe = FusedMoE(experts, 2, hidden, inter, "silu")
        for e in range(experts):
            moe.weight_loader(moe.gate_up_proj, gate_up[e, 0], f"{e}.gate")
            moe.weight_loader(moe.gate_up_proj, gate_up[e, 1], f"{e}.up")
            moe.weight_loader(moe.down_proj, down[e], str(e))
        return moe

    whole = build(1, 0)(x, *routing)
    split = build(2, 0)(x, *routing) + build(2, 1)(x, *routing)
    assert 0 < float((split - whole).norm() / whole.norm()) < 0.05


def test_compressed_tensors_routers_left_unquantized():
    """llm-compressor leaves a mixture of experts' routers out of fp8, by name or pattern, as
    kvfleet does anyway; any other projection left out is refused."""
    group = {"weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
             "input_activations": {"num_bits": 8, "type": "float", "dynamic": True}}  # fmt: skip
    qc = {"quant_method": "compressed-tensors", "config_groups": {"g": group}}
    for ignore in (["lm_head", "re:.*mlp.gate$"], ["model.layers.0.block_sparse_moe.gate"]):
        assert resolve_fp8(None, {**qc, "ignore": ignore}, dummy=False) == Fp8Config(
            checkpoint_fp8=True
        )
    with pytest.raises(ValueError, match=r"leaves \['re:\.\*mlp\.gate_proj\$'\] unquantized"):
        resolve_fp8(None, {**qc, "ignore": ["re:.*mlp.gate_proj$"]}, dummy=False)


def test_bad_expert_scales_are_clear_errors():
    with fp8_linear_layers(Fp8Config(checkpoint_fp8=True)):
        moe = FusedMoE(4, 2, 32, 48, "silu")
    assert moe.gate_up_scale is not None and moe.down_scale is not None
    with pytest.raises(ValueError, match=r"expert 1\.up: weight_scale of shape \(3,\)"):
        moe.weight_loader(moe.gate_up_scale, torch.ones(3), "1.up")
    with pytest.raises(ValueError, match=r"expert 2: weight_scale of shape \(32, 2\)"):
        moe.weight_loader(moe.down_scale, torch.ones(32, 2), "2")
    with pytest.raises(ValueError, match="negative or non-finite"):
        moe.weight_loader(moe.gate_up_scale, torch.tensor(float("nan")), "0.gate")
    with pytest.raises(ValueError, match=r"expert 0\.gate: checkpoint shape \(48, 16\)"):
        moe.weight_loader(moe.gate_up_proj, torch.zeros(48, 16, dtype=FP8), "0.gate")
    moe.weight_loader(moe.gate_up_scale, torch.full((48, 1), 0.5), "3.gate")
    assert (moe.gate_up_scale[3, :48] == 0.5).all()


def test_block_scaled_checkpoint_errors(fp8_dirs, tmp_path):
    q = torch.zeros(64, 64, dtype=FP8)
    with pytest.raises(ValueError, match=r"w: weight_scale_inv of shape \(1, 1\) .* expected"):
        dequantize_blocks(q, torch.ones(1, 1), FIXTURE_BLOCK, "w")
    with pytest.raises(ValueError, match="negative or non-finite"):
        dequantize_blocks(q, -torch.ones(2, 2), FIXTURE_BLOCK, "w")
    dst = tmp_path / "broken"
    shutil.copytree(fp8_dirs["block"], dst)
    (weights,) = dst.glob("*.safetensors")
    tensors = load_file(weights)
    del tensors[EXPERTS + "3.up_proj.weight_scale_inv"]
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"without their partner: .*experts\.3\.up_proj\.weight"):
        _greedy(dst)
