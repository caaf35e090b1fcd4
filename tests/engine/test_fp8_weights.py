"""FP8 weights (W8A8, `--quantization fp8`) on the CPU: the fp8 linear against a dequantized
reference, quantization at load, fp8 checkpoints (vLLM's fp8 and compressed-tensors formats)
against their dequantized twins quantized at load, tensor parallelism, and the errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from kvfleet.engine.config import EngineArgs, ModelConfig
from kvfleet.engine.layers.fp8 import (
    FP8,
    Fp8Config,
    fp8_linear,
    fp8_linear_layers,
    quantize_rows,
    quantize_tokens,
)
from kvfleet.engine.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from kvfleet.engine.llm import LLM
from kvfleet.engine.sampling_params import SamplingParams
from tests.support.fp8_checkpoint import (
    quantize_fixture,
    write_dequantized,
    write_fp8_checkpoint,
)

CPU = torch.device("cpu")
PROMPTS = [[(7 * i + 3 * j) % 480 + 3 for j in range(n)] for i, n in enumerate((1, 17, 40))]


def _greedy(path: Path, tp: int = 1, **engine_args) -> tuple[list[list[int]], dict]:
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    with LLM(str(path), device="cpu", skip_tokenizer_init=True, tensor_parallel_size=tp,
             **engine_args) as llm:  # fmt: skip
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp)
        model = llm.engine.runner.model
        params = {k: v.detach().clone() for k, v in model.named_parameters()}
    return [o.outputs[0].token_ids for o in outs], params


# -- the arithmetic ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_linear_matches_its_dequantized_reference(dtype):
    """Exactly the reference's arithmetic (fp8 operands dequantized, fp32 sums), and within fp8's
    rounding of the unquantized product: e4m3 keeps 4 significant bits, each operand errs by at
    most 1/16 relatively, and random errors add up to ~3% of the result's norm."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(37, 256, generator=gen).to(dtype)
    w = torch.randn(96, 256, generator=gen) * torch.rand(96, 1, generator=gen)
    bias = torch.randn(96, generator=gen).to(dtype)
    w_fp8, w_scale = quantize_rows(w)
    y = fp8_linear(x, w_fp8, w_scale, None, bias)
    assert y.dtype == dtype and y.shape == (37, 96)

    x_fp8, x_scale = quantize_tokens(x)
    reference = (x_fp8.float() * x_scale) @ (w_fp8.float() * w_scale[:, None]).T + bias.float()
    exact_bound = 1e-5 if dtype == torch.float32 else 1e-2  # the output's own rounding
    torch.testing.assert_close(y.float(), reference, rtol=exact_bound, atol=exact_bound)
    unquantized = x.float() @ w.T + bias.float()
    rel = (y.float() - unquantized).norm() / unquantized.norm()
    assert 1e-3 < rel < 0.05


def test_static_activation_scale_and_clamping():
    x = torch.tensor([[1.0, -2.0, 1000.0]])
    scale = torch.tensor(2.0 / 448)  # amax 2: the 1000 clamps to 448 * scale = 2
    x_fp8, x_scale = quantize_tokens(x, scale)
    assert x_scale.shape == (1, 1) and x_scale.item() == pytest.approx(2.0 / 448)
    assert (x_fp8.float() * x_scale).tolist() == [[pytest.approx(1.0), -2.0, 2.0]]
    # The dynamic scale is each row's own; a zero row quantizes to zeros, not NaN.
    x_fp8, x_scale = quantize_tokens(torch.tensor([[0.0, 0.0, 0.0], [3.0, -448.0, 1.0]]))
    assert x_fp8[0].float().tolist() == [0, 0, 0] and x_scale[1].item() == 1.0
    assert x_fp8[1].float().abs().max() == 448


def test_quantize_rows_round_trip():
    """Each row's largest magnitude becomes +-448 (the full fp8 range); every entry is within
    1/16 of itself (plus a subnormal's step); quantizing the dequantized weights again gives
    the same fp8 values; rows of zeros stay zeros."""
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(64, 128, generator=gen) * torch.logspace(-3, 2, 64)[:, None]
    w[5] = 0
    q, s = quantize_rows(w)
    assert q.dtype == FP8 and s.dtype == torch.float32 and s.shape == (64,)
    peak = q.float().abs().amax(dim=1)
    assert (peak[torch.arange(64) != 5] == 448).all() and (q[5].float() == 0).all()
    deq = q.float() * s[:, None]
    assert ((deq - w).abs() <= w.abs() / 16 + s[:, None] * 2**-9).all()
    q2, s2 = quantize_rows(deq)
    assert torch.equal(q2.float(), q.float())
    torch.testing.assert_close(s2, s, rtol=1e-6, atol=0)


# -- layers and loading -----------------------------------------------------------------------


def test_fused_layers_keep_each_shards_scales():
    """q/k/v and gate/up quantized at load keep their rows' own scales (fusing is exact); a
    checkpoint's per-tensor scales expand to their shard's rows; static input scales of fused
    shards take the largest; a row-parallel layer's scales span its whole output."""
    gen = torch.Generator().manual_seed(2)
    with fp8_linear_layers(Fp8Config()):
        qkv = QKVParallelLinear(64, 16, 4, 2, bias=False)
        gate_up = MergedColumnParallelLinear(64, [32, 48])
        down = RowParallelLinear(48, 64)
    parts = {s: torch.randn(n, 64, generator=gen) * f for s, n, f in [("q", 64, 1), ("k", 32, 9),
                                                                       ("v", 32, 0.1)]}  # fmt: skip
    for shard, w in parts.items():
        qkv.weight_loader(qkv.weight, w, shard)
    whole = torch.cat(list(parts.values()))
    q, s = quantize_rows(whole)
    assert torch.equal(qkv.weight.float(), q.float()) and torch.equal(qkv.weight_scale, s)
    x = torch.randn(5, 64, generator=gen)
    torch.testing.assert_close(qkv(x), fp8_linear(x, q, s, None, None))

    for i, n in enumerate((32, 48)):
        gate_up.weight_loader(gate_up.weight, torch.randn(n, 64, generator=gen), str(i))
    w = torch.randn(64, 48, generator=gen)
    down.weight_loader(down.weight, w)
    assert torch.equal(down.weight_scale, quantize_rows(w)[1])

    with fp8_linear_layers(Fp8Config(checkpoint_fp8=True, static_activations=True)):
        qkv = QKVParallelLinear(64, 16, 4, 2, bias=False)
    for i, (shard, w) in enumerate(parts.items()):
        fp8, scale = quantize_fixture(w, per_channel=False)
        qkv.weight_loader(qkv.weight, fp8, shard)
        qkv.weight_loader(qkv.weight_scale, scale, shard)
        qkv.weight_loader(qkv.input_scale, torch.tensor([0.01, 0.03, 0.02][i]), shard)
    expected = [quantize_fixture(w, False)[1].expand(len(w)) for w in parts.values()]
    assert torch.equal(qkv.weight_scale, torch.cat(expected))
    assert qkv.input_scale.item() == pytest.approx(0.03)


@pytest.fixture(scope="module")
def fp8_dirs(model_dirs, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fp8")
    src = model_dirs["llama"]
    dirs = {
        "channel": write_fp8_checkpoint(src, root / "ct-channel", "compressed-tensors",
                                        per_channel=True),
        "tensor-static": write_fp8_checkpoint(src, root / "fp8-static", "fp8", per_channel=False,
                                              static=True),
    }  # fmt: skip
    dirs["dequantized"] = write_dequantized(dirs["channel"], root / "dequantized")
    return dirs


def test_fp8_checkpoint_equals_its_twin_quantized_at_load(fp8_dirs):
    """The compressed-tensors checkpoint is served in fp8 without the flag; its exact bf16 twin
    with --quantization fp8 holds the same fp8 weights and scales and generates the same tokens.
    Embeddings, norms and the LM head stay in the model dtype."""
    pre, pre_params = _greedy(fp8_dirs["channel"])
    at_load, load_params = _greedy(fp8_dirs["dequantized"], quantization="fp8")
    assert pre_params.keys() == load_params.keys()
    for name, value in pre_params.items():
        assert value.dtype == load_params[name].dtype, name
        assert torch.equal(value.float(), load_params[name].float()), name
    assert pre_params["model.layers.0.self_attn.qkv_proj.weight"].dtype == FP8
    for name in ("lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"):
        assert pre_params[name].dtype == torch.float32
    assert pre == at_load
    assert len({tuple(t) for t in pre}) == len(pre)  # distinct outputs: a real comparison


def test_tensor_parallel_fp8_equals_one_rank(fp8_dirs):
    """Static activation scales make the split model's arithmetic the unsplit one's, so the
    tokens are equal: per-tensor scales of q/k/v and gate/up expanded per row and split with
    their shards. Quantized at load, rank 0 holds exactly its slices of the unsplit model's fp8
    weights and scales (row-parallel rows scaled over the whole row); its tokens are not
    compared: with dynamic scales a row-parallel rank scales its half of each token itself,
    which moves the logits by fp8's rounding, enough to flip near-ties of a random model."""
    one, _ = _greedy(fp8_dirs["tensor-static"], 1)
    assert _greedy(fp8_dirs["tensor-static"], 2)[0] == one
    _, whole = _greedy(fp8_dirs["dequantized"], 1, quantization="fp8")
    _, rank0 = _greedy(fp8_dirs["dequantized"], 2, quantization="fp8")
    assert not dist.is_initialized()
    layer = "model.layers.1."
    for name, sizes in ((layer + "self_attn.qkv_proj", [64, 32, 32]),
                        (layer + "mlp.gate_up_proj", [192, 192])):  # fmt: skip
        for suffix in ("weight", "weight_scale"):
            halves = [t[: len(t) // 2] for t in whole[f"{name}.{suffix}"].split(sizes)]
            assert torch.equal(rank0[f"{name}.{suffix}"].float(), torch.cat(halves).float())
    for name in (layer + "self_attn.o_proj", layer + "mlp.down_proj"):
        w = whole[f"{name}.weight"]
        assert torch.equal(rank0[f"{name}.weight"].float(), w[:, : w.shape[1] // 2].float())
        assert torch.equal(rank0[f"{name}.weight_scale"], whole[f"{name}.weight_scale"])


def test_the_layers_feeding_fp8_linears_quantize_what_they_produce(fp8_dirs):
    """Each Llama layer's two norms and its gated activation hand their fp8 linear quantized
    values (one kernel fewer per linear on a GPU); nothing is added to the model's parameters,
    and the tokens and their logprobs equal the unfused path's, bit for bit, with dynamic and
    with static activation scales."""
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=3)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    for path, args in ((fp8_dirs["dequantized"], {"quantization": "fp8"}),
                       (fp8_dirs["tensor-static"], {})):  # fmt: skip
        with LLM(str(path), device="cpu", skip_tokenizer_init=True,
                 enable_prefix_caching=False, **args) as llm:  # fmt: skip
            model = llm.engine.runner.model
            layer = model.model.layers[0]
            producers = [layer.input_layernorm, layer.post_attention_layernorm, layer.mlp.act]
            assert all(p.fp8_output is not None for p in producers)
            assert not any("fp8_output" in name for name, _ in model.named_parameters())
            fused = llm.generate(prompts, sp)
            for layer in model.model.layers:
                for p in (layer.input_layernorm, layer.post_attention_layernorm, layer.mlp.act):
                    p.fp8_output = None
            unfused = llm.generate(prompts, sp)
        for a, b in zip(fused, unfused, strict=True):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            assert a.outputs[0].logprobs == b.outputs[0].logprobs


def test_dummy_weights_in_fp8_are_the_dummy_weights_quantized(model_dirs):
    """Benchmarks run --load-format dummy --quantization fp8: the random weights of the model
    dtype, quantized per channel as a checkpoint's would be."""
    _, full = _greedy(model_dirs["llama"], load_format="dummy")
    _, fp8 = _greedy(model_dirs["llama"], load_format="dummy", quantization="fp8")
    for name in ("model.layers.1.self_attn.qkv_proj.weight", "model.layers.0.mlp.down_proj.weight"):
        q, s = quantize_rows(full[name])
        assert torch.equal(fp8[name].float(), q.float())
        assert torch.equal(fp8[name.replace(".weight", ".weight_scale")], s)
    assert torch.equal(fp8["lm_head.weight"], full["lm_head.weight"])


# -- configuration ----------------------------------------------------------------------------


def _config(path: Path, **args) -> ModelConfig:
    return ModelConfig.from_args(EngineArgs(model=str(path), device="cpu", **args), CPU)


def _with_quantization_config(src: Path, dst: Path, qc: dict) -> Path:
    dst.mkdir()
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = qc
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_quantization_is_read_from_the_checkpoint(model_dirs, fp8_dirs, tmp_path):
    assert _config(model_dirs["llama"]).quantization is None
    assert _config(model_dirs["llama"], quantization="fp8").quantization == Fp8Config()
    assert _config(fp8_dirs["channel"]).quantization == Fp8Config(checkpoint_fp8=True)
    static = _config(fp8_dirs["tensor-static"], quantization="fp8").quantization
    assert static == Fp8Config(checkpoint_fp8=True, static_activations=True)
    block = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    block_config = _config(_with_quantization_config(model_dirs["llama"], tmp_path / "b", block))
    assert block_config.quantization == Fp8Config(checkpoint_fp8=True, weight_block_size=(128, 128))
    # Random weights are quantized at load, whatever the checkpoint was.
    assert _config(fp8_dirs["tensor-static"], load_format="dummy").quantization == Fp8Config()
    with pytest.raises(ValueError, match=r"quantization\n  Input should be 'fp8'"):
        EngineArgs(model="m", quantization="int8")


@pytest.mark.parametrize(
    ("qc", "flag", "match"),
    [
        ({"quant_method": "awq", "bits": 4}, "fp8",
         r"quantized with 'awq' .*--quantization fp8 conflicts with it"),
        ({"quant_method": "gptq", "bits": 4}, None, r"quantized with 'gptq' .*it is not supported"),
        ({"quant_method": "fp8", "weight_block_size": [128]}, None,
         r"weight_block_size \[128\]: expected \[rows, columns\]"),
        ({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"},
         None, "block-quantized fp8 checkpoint with static activation scales"),
        ({"quant_method": "fp8", "activation_scheme": "dynamc"}, None, "activation_scheme"),
        ({"quant_method": "compressed-tensors", "config_groups": {"g": {
            "weights": {"num_bits": 8, "type": "int", "strategy": "channel"},
            "input_activations": {"num_bits": 8, "type": "int", "dynamic": True}}}}, "fp8",
         "not 8-bit floats"),
        ({"quant_method": "compressed-tensors", "config_groups": {"g": {
            "weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}}}, None,
         "weight-only fp8"),
        ({"quant_method": "compressed-tensors", "config_groups": {"g": {
            "weights": {"num_bits": 8, "type": "float", "strategy": "block"},
            "input_activations": {"num_bits": 8, "type": "float", "dynamic": True}}}}, None,
         "strategy 'block'"),
    ],
)  # fmt: skip
def test_unsupported_quantized_checkpoints_are_clear_errors(model_dirs, tmp_path, qc, flag, match):
    path = _with_quantization_config(model_dirs["llama"], tmp_path / "m", qc)
    with pytest.raises(ValueError, match=match):
        _config(path, quantization=flag)


def test_fp8_needs_sm89(monkeypatch, model_dirs):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    args = EngineArgs(model=str(model_dirs["llama"]), device="cpu", quantization="fp8")
    with pytest.raises(ValueError, match=r"fp8 weights need sm_89\+ .*A100.* is sm_80"):
        ModelConfig.from_args(args, torch.device("cuda"))


def test_fp8_checkpoint_without_its_scales_is_an_error(fp8_dirs, tmp_path):
    dst = tmp_path / "broken"
    shutil.copytree(fp8_dirs["channel"], dst)
    (weights,) = dst.glob("*.safetensors")
    tensors = load_file(weights)
    del tensors["model.layers.1.mlp.down_proj.weight_scale"]
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(
        ValueError, match=r"lacks weights for: model.layers.1.mlp.down_proj.weight_s"
    ):
        _greedy(dst)
