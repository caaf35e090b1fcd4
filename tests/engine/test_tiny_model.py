"""Tests for tests.support.tiny_model: locally built random checkpoints, no hub access."""

from __future__ import annotations

import gc
import json
import weakref
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from kvfleet.engine import LLM
from tests.support.tiny_model import (
    ARCHITECTURES,
    MARKER_NAME,
    build_tiny_model,
    build_tokenizer,
)

UNICODE_TEXT = "héllo wörld 你好 🙂"
SHARD_SIZE = "100KB"


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {
        arch: build_tiny_model(root / arch, arch, max_shard_size=SHARD_SIZE)
        for arch in ARCHITECTURES
    }


def _load(path: Path) -> tuple[object, torch.nn.Module]:
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    model.eval()
    return tokenizer, model


def test_build_tokenizer_ids_and_files(tmp_path: Path) -> None:
    tok = build_tokenizer(tmp_path)
    assert len(tok) == 512
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 2)
    assert tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [3, 4]
    assert (tmp_path / "tokenizer.json").is_file()
    assert (tmp_path / "tokenizer_config.json").is_file()
    # Deterministic training: a second build writes the same tokenizer.json.
    first = (tmp_path / "tokenizer.json").read_bytes()
    build_tokenizer(tmp_path / "again")
    assert (tmp_path / "again" / "tokenizer.json").read_bytes() == first


def test_build_tokenizer_rejects_tiny_vocab(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        build_tokenizer(tmp_path, vocab_size=100)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_tokenizer_roundtrip_bos_and_chat(built: dict[str, Path], arch: str) -> None:
    tok = AutoTokenizer.from_pretrained(built[arch], local_files_only=True)
    ids = tok(UNICODE_TEXT).input_ids
    assert ids[0] == tok.bos_token_id == 0
    assert ids.count(tok.bos_token_id) == 1
    assert tok.decode(ids, skip_special_tokens=True) == UNICODE_TEXT
    assert tok.decode(ids) == "<|bos|>" + UNICODE_TEXT
    # Specials of every kind vanish with skip_special_tokens.
    specials = tok.convert_tokens_to_ids(["<|im_start|>", "<|eos|>", "<|pad|>", "<|im_end|>"])
    assert tok.decode(specials + ids[1:], skip_special_tokens=True) == UNICODE_TEXT
    # Merges are real: common English words take fewer tokens than bytes.
    text = "The weather today is cloudy with a chance of rain in the afternoon."
    assert len(tok(text, add_special_tokens=False).input_ids) < len(text.encode()) // 2

    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": UNICODE_TEXT},
    ]
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == (
        "<|bos|><|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        f"<|im_start|>user\n{UNICODE_TEXT}<|im_end|>\n<|im_start|>assistant\n"
    )
    no_prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert not no_prompt.endswith("<|im_start|>assistant\n")
    chat_ids = tok(rendered, add_special_tokens=False).input_ids
    assert chat_ids[:2] == [0, 3]
    assert chat_ids.count(0) == 1


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_checkpoint_files_and_config(built: dict[str, Path], arch: str) -> None:
    path = built[arch]
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1
    assert all((path / shard).is_file() for shard in shards)
    assert not (path / "model.safetensors").exists()

    config = AutoConfig.from_pretrained(path, local_files_only=True)
    assert config.model_type == arch
    assert config.architectures == [
        {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3"}[arch]
        + "ForCausalLM"
    ]
    assert (config.vocab_size, config.hidden_size, config.num_hidden_layers) == (512, 64, 2)
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (0, 1, 2)
    if arch == "qwen3":
        assert config.head_dim == 16
    if arch == "mistral":
        assert config.sliding_window is None
    generation = json.loads((path / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 1


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_weights_are_not_default_init(built: dict[str, Path], arch: str) -> None:
    _, model = _load(built[arch])
    params = dict(model.named_parameters())
    norms = [p for n, p in params.items() if "norm" in n]
    assert norms
    for p in norms:
        assert 0.05 < p.detach().std().item() < 0.2
        assert abs(p.detach().mean().item() - 1.0) < 0.1
    if arch == "qwen2":
        biases = [p for n, p in params.items() if n.endswith("proj.bias")]
        assert len(biases) == 6
        assert all(b.detach().abs().min() > 0 for b in biases)
    if arch == "qwen3":
        assert any("q_norm" in n for n in params) and any("k_norm" in n for n in params)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_generate_and_logit_gap(built: dict[str, Path], arch: str) -> None:
    tok, model = _load(built[arch])
    prompt = tok("The weather today is", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(
            **prompt, max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=2
        )
    assert out.shape == (1, prompt.input_ids.shape[1] + 8)

    gen = torch.Generator().manual_seed(1234)
    ids = torch.randint(5, 512, (64, 16), generator=gen)
    ids[:, 0] = tok.bos_token_id
    with torch.no_grad():
        logits = model(ids).logits[:, -1].float()
        top2 = logits.topk(2, dim=-1).values
        gap = top2[:, 0] - top2[:, 1]
        assert gap.median().item() > 0.1
        assert (gap > 1e-2).float().mean().item() > 0.9
        # The prediction depends on context, not just on the last token: changing one early
        # token changes the greedy choice for a good share of prompts.
        changed = ids.clone()
        changed[:, 1] = torch.randint(5, 512, (64,), generator=gen)
        other = model(changed).logits[:, -1].float()
    assert (other.argmax(-1) != logits.argmax(-1)).float().mean().item() > 0.2


def test_idempotent_and_rebuild(tmp_path: Path) -> None:
    path = tmp_path / "model"
    build_tiny_model(path, "llama", max_shard_size=SHARD_SIZE)
    marker = path / MARKER_NAME
    stamp = marker.stat().st_mtime_ns
    weights_before = {p.name: p.read_bytes() for p in path.glob("*.safetensors")}
    assert build_tiny_model(path, "llama", max_shard_size=SHARD_SIZE) == path
    assert marker.stat().st_mtime_ns == stamp

    # Other arguments rebuild in place, leaving no stale shards behind.
    build_tiny_model(path, "llama", seed=1)
    assert marker.stat().st_mtime_ns != stamp
    assert sorted(p.name for p in path.glob("*.safetensors")) == ["model.safetensors"]
    assert not (path / "model.safetensors.index.json").exists()
    assert json.loads(marker.read_text())["seed"] == 1

    # Same arguments in a fresh directory give identical bytes.
    again = build_tiny_model(tmp_path / "again", "llama", max_shard_size=SHARD_SIZE)
    assert {p.name: p.read_bytes() for p in again.glob("*.safetensors")} == weights_before

    # A half-written directory (no marker) is rebuilt.
    marker.unlink()
    build_tiny_model(path, "llama", seed=1)
    assert marker.is_file()


def test_overrides_dtype_and_tied(tmp_path: Path) -> None:
    rope_scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256,
    }
    path = build_tiny_model(
        tmp_path / "llama3",
        "llama",
        rope_scaling=rope_scaling,
        rope_theta=500000.0,
        tie_word_embeddings=True,
        dtype=torch.bfloat16,
    )
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    rope = config.rope_parameters
    assert rope["rope_type"] == "llama3" and rope["factor"] == 8.0
    assert rope["rope_theta"] == 500000.0
    assert config.tie_word_embeddings
    _, model = _load(path)
    assert model.dtype == torch.bfloat16
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    with torch.no_grad():
        logits = model(torch.tensor([[0, 100, 200, 300]])).logits[0, -1].float()
    top2 = logits.topk(2).values
    assert (top2[0] - top2[1]).item() > 0  # finite, not flat

    window = build_tiny_model(tmp_path / "mistral", "mistral", sliding_window=8)
    assert AutoConfig.from_pretrained(window, local_files_only=True).sliding_window == 8


def test_rejects_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown arch"):
        build_tiny_model(tmp_path / "x", "falcon")
    with pytest.raises(ValueError, match="num_kv_heads"):
        build_tiny_model(tmp_path / "x", "llama", num_heads=4, num_kv_heads=3)


def test_shutdown_gives_the_memory_back(model_dirs) -> None:
    """A stopped engine frees its KV cache and weights even while the LLM object lives on."""
    llm = LLM(str(model_dirs["llama"]), dtype="float32")
    runner = llm.engine.runner
    cache = weakref.ref(runner.kv_caches[0])
    weight = weakref.ref(next(runner.model.parameters()))
    llm.shutdown()
    llm.shutdown()  # twice is harmless
    gc.collect()
    assert cache() is None and weight() is None
    assert runner.kv_caches == [] and runner.released and not hasattr(runner, "model")
