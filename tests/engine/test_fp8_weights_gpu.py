"""FP8 weights (W8A8) on the GPU at real sizes: cuBLASLt's FP8 GEMM against the dequantized
reference, and an 8B-class layer stack's first-token logprobs in fp8 against bf16. Skipped where
no GPU of compute capability 8.9+ is visible (CI); run on one with
`pytest -q tests/engine/test_fp8_weights_gpu.py` (bench/gpu_run.sh OUT fp8-check)."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import pytest
import torch

from kvfleet.engine import LLM, SamplingParams
from kvfleet.engine.layers.fp8 import fp8_linear, quantize_rows, quantize_tokens
from kvfleet.engine.layers.moe import SparseMoeBlock
from kvfleet.engine.models.mixture_of_experts import MoeForCausalLM
from tests.support.engine import first_token_logprob_gaps, long_random_prompts

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="needs a CUDA GPU of compute capability 8.9+",
)

BENCH_MODELS = Path(__file__).resolve().parents[2] / "bench" / "models"


@pytest.mark.parametrize("m", [1, 7, 64, 4096])
@pytest.mark.parametrize(("k", "n"), [(4096, 6144), (4096, 28672), (14336, 4096)])
def test_fp8_gemm_equals_the_dequantized_reference(m, k, n):
    """Llama-3-8B's qkv, gate_up and down shapes. Against the same fp8 operands dequantized and
    multiplied in fp32: within the bf16 output's rounding (2^-8 relative, 1% bound). Against the
    unquantized bf16 product: within fp8's rounding (~3% of the norm, 5% bound)."""
    gen = torch.Generator(device="cuda").manual_seed(m + k + n)
    x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
    w = torch.randn(n, k, device="cuda", generator=gen) * 0.02
    w_fp8, w_scale = quantize_rows(w)
    y = fp8_linear(x, w_fp8, w_scale, None, None).float()
    x_fp8, x_scale = quantize_tokens(x)
    ref = (x_fp8.float() * x_scale) @ (w_fp8.float() * w_scale[:, None]).T
    assert ((y - ref).norm() / ref.norm()).item() < 1e-2
    exact = x.float() @ w.T
    assert ((y - exact).norm() / exact.norm()).item() < 0.05


@pytest.mark.parametrize("m", [1, 16])
# (weight rows, K tile, splits, warps, stages)
@pytest.mark.parametrize(
    "tile", [(64, 256, 1, 4, 4), (64, 256, 3, 4, 4), (64, 128, 8, 4, 5), (128, 256, 4, 8, 3)]
)
def test_small_batch_gemm_tiles_equal_cublaslt_row_wise(m, tile):
    """Every tile shape of the decode GEMM, split or not, against cuBLASLt's row-wise-scaled
    GEMM at Llama-3-8B's down projection (K not a multiple of every split), deterministic from
    call to call, and with its column-block counters left at zero."""
    from kvfleet.kernels import fp8_gemm

    gen = torch.Generator(device="cuda").manual_seed(m)
    x_fp8, x_scale = quantize_tokens(torch.randn(m, 14336, device="cuda", generator=gen))
    w_fp8, w_scale = quantize_rows(torch.randn(4096, 14336, device="cuda", generator=gen) * 0.02)
    bias = torch.randn(4096, device="cuda", generator=gen).to(torch.bfloat16)
    t = fp8_gemm.GemmTile(*tile)
    got = fp8_gemm.small_batch_gemm(x_fp8, x_scale, w_fp8, w_scale, bias, torch.bfloat16, t)
    again = fp8_gemm.small_batch_gemm(x_fp8, x_scale, w_fp8, w_scale, bias, torch.bfloat16, t)
    want = (
        torch._scaled_mm(
            x_fp8, w_fp8.t(), scale_a=x_scale, scale_b=w_scale.view(1, -1), out_dtype=torch.float32
        )
        + bias.float()
    )
    assert torch.equal(got, again)
    assert not fp8_gemm._counters(x_fp8.device).any()
    assert ((got.float() - want).norm() / want.norm()).item() < 1e-2


def test_decode_gemm_reads_the_output_of_the_norm_launched_before_it():
    """On Hopper the decode GEMM is launched with programmatic dependent launch: it starts while
    the quantizing RMSNorm before it runs and prefetches its weights, then waits. A CUDA graph
    of norm -> GEMM replayed on fresh inputs must give each replay's own product (a GEMM that
    read its input before the wait would give the previous replay's, ~140% off)."""
    from kvfleet.kernels import fp8_gemm
    from kvfleet.kernels.rms_norm import rms_norm

    gen = torch.Generator(device="cuda").manual_seed(0)
    w_fp8, w_scale = quantize_rows(torch.randn(6144, 4096, device="cuda", generator=gen) * 0.02)
    norm_w = torch.ones(4096, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1, 4096, device="cuda", generator=gen).to(torch.bfloat16)

    def step() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, s = rms_norm(x, norm_w, 1e-5, quantize=True)
        return q, s, fp8_gemm.small_batch_gemm(q, s, w_fp8, w_scale, None, torch.bfloat16)

    step()  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q, s, y = step()
    for _ in range(20):
        x.copy_(torch.randn(1, 4096, device="cuda", generator=gen))
        graph.replay()
        want = torch._scaled_mm(
            q, w_fp8.t(), scale_a=s, scale_b=w_scale.view(1, -1), out_dtype=torch.float32
        )
        assert ((y.float() - want).norm() / want.norm()).item() < 1e-2


@pytest.mark.parametrize("static", [False, True])
def test_triton_quantization_equals_the_pytorch_function(static):
    from kvfleet.kernels import fp8_quant

    x = torch.randn(300, 14336, device="cuda").to(torch.bfloat16) * 3
    scale = torch.tensor(4.0 / 448, device="cuda") if static else None
    q, s = fp8_quant.quantize_tokens(x, scale)
    q_ref, s_ref = quantize_tokens(x, scale)
    assert torch.equal(s, s_ref)
    mismatched = (q.float() != q_ref.float()).float().mean().item()
    assert mismatched < 1e-4, mismatched  # only where the division rounds differently


def _stack_config(tmp_path: Path, layers: int) -> Path:
    """Meta-Llama-3-8B's layer shapes and 128k vocabulary, `layers` deep."""
    config = json.loads((BENCH_MODELS / "Meta-Llama-3-8B" / "config.json").read_text())
    config["num_hidden_layers"] = layers
    path = tmp_path / "llama3-8b-stack"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_fp8_weight_logprobs_close_to_bf16_on_an_8b_class_stack(tmp_path):
    """8 Llama-3-8B layers, dummy weights, CUDA graphs on: the first token's top-20 logprobs
    with --quantization fp8 against bf16, within 0.1 nats (fp8 rounds each weight and
    activation by up to 1/16; measured on an H100: see the assertion's message). The fp8
    weights leave more memory to the KV cache."""
    common = dict(
        model=str(_stack_config(tmp_path, 8)),
        load_format="dummy",
        dtype="bfloat16",
        skip_tokenizer_init=True,
        max_model_len=2048,
        max_num_seqs=16,
        gpu_memory_utilization=0.5,
    )
    prompts = long_random_prompts(vocab=128000)
    sp = SamplingParams(temperature=0, max_tokens=4, logprobs=20, ignore_eos=True)
    blocks = {}
    outs = {}
    for name, extra in (("bf16", {}), ("fp8", {"quantization": "fp8"})):
        with LLM(**common, **extra) as llm:
            outs[name] = llm.generate(prompts, sp)
            blocks[name] = llm.engine.runner.num_blocks
            weights = llm.engine.runner.model.model.layers[0].mlp.down_proj.weight
            assert weights.dtype == (torch.float8_e4m3fn if name == "fp8" else torch.bfloat16)
        del llm, weights  # the next engine needs this one's memory
        gc.collect()
        torch.cuda.empty_cache()
    gaps = first_token_logprob_gaps(outs["fp8"], outs["bf16"])
    worst = max(gap for _, gap in gaps)
    assert worst < 0.1, gaps
    assert min(shared for shared, _ in gaps) >= 10, gaps
    print(f"fp8 vs bf16 first-token top-20 logprobs: {gaps}; KV blocks {blocks}")
    assert blocks["fp8"] > blocks["bf16"]


def test_fp8_experts_logprobs_close_to_bf16_on_a_qwen3_30b_a3b_stack(tmp_path):
    """4 Qwen3-30B-A3B layers (128 experts of 768, top 8), dummy weights: the first token's
    top-20 logprobs with --quantization fp8 (every expert quantized per output channel at load,
    the router in bf16; the fused kernel, CUDA graphs on) against bf16, within the dense
    stack's 0.1 nats."""
    config = json.loads((BENCH_MODELS / "Qwen3-30B-A3B" / "config.json").read_text())
    config["num_hidden_layers"] = 4
    path = tmp_path / "qwen3-30b-a3b-stack"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    common = dict(model=str(path), load_format="dummy", dtype="bfloat16",
                  skip_tokenizer_init=True, max_model_len=2048, max_num_seqs=16,
                  gpu_memory_utilization=0.5)  # fmt: skip
    prompts = long_random_prompts(vocab=151000)
    sp = SamplingParams(temperature=0, max_tokens=4, logprobs=20, ignore_eos=True)
    outs = {}
    for name, extra in (("bf16", {}), ("fp8", {"quantization": "fp8"})):
        with LLM(**common, **extra) as llm:
            outs[name] = llm.generate(prompts, sp)
            model = llm.engine.runner.model
            assert isinstance(model, MoeForCausalLM)
            moe = next(m for m in model.modules() if isinstance(m, SparseMoeBlock))
            assert moe.experts.gate_up_proj.dtype == (
                torch.float8_e4m3fn if name == "fp8" else torch.bfloat16
            )
            assert moe.gate.weight.dtype == torch.bfloat16
        del llm, model, moe
        gc.collect()
        torch.cuda.empty_cache()
    gaps = first_token_logprob_gaps(outs["fp8"], outs["bf16"])
    print(f"fp8 vs bf16 experts, first-token top-20 logprobs: {gaps}")
    assert max(gap for _, gap in gaps) < 0.1, gaps
    assert min(shared for shared, _ in gaps) >= 10, gaps
