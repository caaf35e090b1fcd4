"""GPT-2 and Gemma 2 beyond the shared HF-equality suite (tests/engine/test_engine_equivalence.py
runs them too): published GPT-2 checkpoint layouts, Gemma 2's soft-caps where they change the
result, and the real public configs building with dummy weights."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from kvfleet.engine import LLM, SamplingParams
from tests.support.engine import MAX_TOKENS, assert_no_leak, hf_greedy
from tests.support.tiny_model import build_tiny_model

BENCH_MODELS = Path(__file__).resolve().parents[2] / "bench" / "models"


def test_tied_embeddings_and_headless_checkpoint_names(tmp_path, prompts):
    """GPT-2 as published: tied LM head, and (the original OpenAI export) tensor names without
    the `transformer.` prefix plus the causal-mask buffers older transformers saved."""
    from safetensors.torch import load_file, save_file

    path = build_tiny_model(tmp_path / "gpt2-tied", "gpt2", tie_word_embeddings=True)
    expected = hf_greedy(path, prompts[:4], 8)
    weights = path / "model.safetensors"
    tensors = load_file(weights)
    assert "lm_head.weight" not in tensors
    renamed = {name.removeprefix("transformer."): t for name, t in tensors.items()}
    mask = torch.tril(torch.ones(1, 1, 1024, 1024, dtype=torch.bool))
    renamed |= {"h.0.attn.bias": mask, "h.0.attn.masked_bias": torch.tensor(-1e4)}
    save_file(renamed, weights, metadata={"format": "pt"})
    llm = LLM(str(path), dtype="float32")
    few = SamplingParams(temperature=0.0, max_tokens=8)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:4]], few)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert_no_leak(llm)


def test_gemma2_soft_caps_that_bite(tmp_path, prompts):
    """Caps small enough to change the result: attention scores capped at 1 change the greedy
    tokens, final logits capped at 2 change the logprobs (never the argmax)."""
    from transformers import AutoModelForCausalLM

    cap = 2.0
    path = build_tiny_model(
        tmp_path / "gemma2-caps", "gemma2", attn_logit_softcapping=1.0, final_logit_softcapping=cap
    )
    some = prompts[:5]
    llm = LLM(str(path), dtype="float32")
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in some], sp)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(path, some, MAX_TOKENS)
    assert_no_leak(llm)

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for prompt, out in zip(some, outs, strict=True):
        with torch.no_grad():
            capped = model(torch.tensor([prompt])).logits[0, -1]
        uncapped = torch.atanh(capped / cap) * cap
        ours = out.outputs[0].logprobs[0]
        for token, lp in ours.items():
            assert math.isclose(lp, capped.log_softmax(-1)[token].item(), abs_tol=1e-4)
        top = out.outputs[0].token_ids[0]
        assert abs(ours[top] - uncapped.log_softmax(-1)[top].item()) > 1e-2


def _reduced_config(tmp_path: Path, name: str, layers: dict[str, int]) -> Path:
    config = json.loads((BENCH_MODELS / name / "config.json").read_text())
    config.update(layers)
    out = tmp_path / name
    out.mkdir()
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize(
    ("name", "layers", "arch"),
    [
        ("gpt2-large", {"n_layer": 2}, "GPT2LMHeadModel"),
        ("gemma-2-2b-it", {"num_hidden_layers": 2}, "Gemma2ForCausalLM"),
    ],
)
def test_real_config_builds_with_dummy_weights(tmp_path, name, layers, arch):
    """The published configs at full width (hidden size, heads, head_dim, vocab), cut to two
    layers so CI memory and time stay small (gemma-2-2b's 26 layers are ~10 GB in fp32)."""
    path = _reduced_config(tmp_path, name, layers)
    common = dict(
        load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", num_gpu_blocks_override=8
    )
    llm = LLM(str(path), max_model_len=64, **common)
    assert llm.engine.model_config.architecture == arch
    assert len(llm.engine.runner.model.attention_layers()) == 2
    sp = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": [5, 6, 7, 8]}, sp)[0]
    assert len(out.outputs[0].token_ids) == 2
    assert_no_leak(llm)
    if arch == "GPT2LMHeadModel":
        # Learned positions: nothing beyond n_positions exists to look up.
        with pytest.raises(ValueError, match="context length of 1024 tokens"):
            LLM(str(path), max_model_len=1025, **common)
