"""Qwen3's per-head q/k RMSNorms run inside the rotary launch (kernels.rotary): a q/k-norm model
takes the fused path (its q_norm / k_norm modules only hold the weights), and with the Triton
kernel itself, through its interpreter, greedy output still equals HF's."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

from collections.abc import Callable

import pytest
import torch

from kvfleet.engine import LLM, SamplingParams
from kvfleet.engine.models.llama import LlamaAttention
from kvfleet.kernels import reference
from tests.support.engine import assert_no_leak, hf_greedy

Rotate = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def _fused_rotations(monkeypatch: pytest.MonkeyPatch, llm: LLM, rotate: Rotate) -> list[bool]:
    """Routes the layers' rotary (their CPU entry, reference.apply_rotary) through `rotate` and
    records, per call, whether the q/k norms came with it; a q_norm or k_norm module run on its
    own fails the test."""
    calls: list[bool] = []

    def spy(q, k, positions, cos, sin, qk_norm=None):
        calls.append(qk_norm is not None)
        return rotate(q, k, positions, cos, sin, qk_norm)

    def unfused(module: torch.nn.Module, args: object, out: object) -> None:
        raise AssertionError("a per-head norm ran as a launch of its own")

    monkeypatch.setattr(reference, "apply_rotary", spy)
    model = llm.engine.runner.model
    assert isinstance(model, torch.nn.Module)
    for module in model.modules():
        if isinstance(module, LlamaAttention):
            module.q_norm.register_forward_hook(unfused)
            module.k_norm.register_forward_hook(unfused)
    return calls


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_qk_norm_models_fuse_the_norms_into_the_rotary(arch, model_dirs, prompts, monkeypatch):
    llm = LLM(str(model_dirs[arch]), dtype="float32", skip_tokenizer_init=True)
    calls = _fused_rotations(monkeypatch, llm, reference.apply_rotary)
    steps = 3
    llm.generate({"prompt_token_ids": prompts[1]}, SamplingParams(temperature=0, max_tokens=steps))
    num_layers = len(llm.engine.runner.model.attention_layers())
    assert calls == [True] * num_layers * steps


def test_fused_triton_kernel_greedy_equals_hf(model_dirs, prompts, monkeypatch):
    """The Triton kernel (interpreted) in every Qwen3 layer, with the Triton attention backend:
    prefill and decode steps give HF's tokens."""
    from kvfleet.kernels.rotary import apply_rotary

    some = prompts[:4]
    llm = LLM(
        str(model_dirs["qwen3"]),
        device="cpu",
        dtype="float32",
        skip_tokenizer_init=True,
        attention_backend="triton",
    )
    calls = _fused_rotations(monkeypatch, llm, apply_rotary)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in some], SamplingParams(temperature=0, max_tokens=8)
    )
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(model_dirs["qwen3"], some, 8)
    assert calls and all(calls)
    assert_no_leak(llm)
