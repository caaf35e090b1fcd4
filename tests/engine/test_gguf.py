"""GGUF checkpoints: tiny random HF checkpoints written as GGUF files (llama.cpp's tensor names,
q/k permutation, quantized matrices) load into the engine, whose greedy output equals HF
transformers loading the same file; unsupported files are one-line errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from kvfleet.engine.llm import LLM
from kvfleet.engine.sampling_params import SamplingParams
from tests.support.engine import MAX_TOKENS, assert_no_leak, hf_greedy
from tests.support.gguf_files import write_gguf
from tests.support.tiny_model import build_tiny_model

# The quantized types gguf's Python package can write; the K-quants it only reads.
TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")


def _hf_greedy(file: Path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    return hf_greedy(file.parent, prompts, max_tokens, gguf_file=file.name)


def _engine_greedy(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert_no_leak(llm)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def gguf_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gguf")


def _written(root: Path, model_dir: Path, arch: str, qtype: str, **kwargs) -> Path:
    folder = root / f"{arch}-{qtype}-{'-'.join(map(str, kwargs.values()))}"
    folder.mkdir(exist_ok=True)
    file = folder / "model.gguf"
    return file if file.is_file() else write_gguf(model_dir, file, qtype, arch=arch, **kwargs)


@pytest.mark.parametrize(
    "arch,qtype",
    [("llama", t) for t in TYPES] + [("qwen2", "Q8_0"), ("qwen3", "Q8_0")],
)
def test_greedy_equals_hf_on_the_same_gguf(model_dirs, prompts, gguf_root, arch, qtype) -> None:
    model_dir = model_dirs[arch]
    if arch == "qwen3":
        # transformers' GGUF reader takes Qwen3's head size as its class default, 128.
        model_dir = build_tiny_model(gguf_root / "qwen3-hf", "qwen3", head_dim=128)
    file = _written(gguf_root, model_dir, arch, qtype)
    expected = _hf_greedy(file, prompts, MAX_TOKENS)
    with LLM(str(file), dtype="float32") as llm:
        assert _engine_greedy(llm, prompts, MAX_TOKENS) == expected


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
@pytest.mark.parametrize(
    "engine_args",
    [{"max_num_batched_tokens": 48}, {"enable_prefix_caching": False}],
    ids=["chunked-prefill", "no-prefix-caching"],
)
def test_greedy_equals_hf_chunked_and_uncached(
    model_dirs, prompts, gguf_root, qtype, engine_args
) -> None:
    file = _written(gguf_root, model_dirs["llama"], "llama", qtype)
    expected = _hf_greedy(file, prompts, MAX_TOKENS)
    # The shared 64-token prefix makes the cached run hit its blocks.
    shared = [prompts[4] + p for p in prompts[:4]]
    with LLM(str(file), dtype="float32", **engine_args) as llm:
        assert _engine_greedy(llm, prompts, MAX_TOKENS) == expected
        assert _engine_greedy(llm, shared, MAX_TOKENS) == _hf_greedy(file, shared, MAX_TOKENS)


def test_directory_with_one_gguf_and_its_tokenizer(model_dirs, gguf_root) -> None:
    file = _written(gguf_root, model_dirs["llama"], "llama", "Q8_0")
    text = "The quick brown fox jumps over the lazy dog."
    reference = AutoTokenizer.from_pretrained(model_dirs["llama"])
    with LLM(str(file.parent), dtype="float32") as llm:
        assert llm.engine.model_config.path == file
        assert llm.get_tokenizer()(text).input_ids == reference(text).input_ids
        out = llm.generate(text, SamplingParams(max_tokens=4, temperature=0.0))
        assert len(out[0].outputs[0].token_ids) == 4


def test_gguf_without_tokenizer_needs_the_override(model_dirs, gguf_root) -> None:
    file = _written(gguf_root, model_dirs["llama"], "llama", "F32", tokenizer=False)
    with pytest.raises(ValueError, match="carries no tokenizer: pass --tokenizer"):
        LLM(str(file), dtype="float32")
    with LLM(str(file), dtype="float32", tokenizer=str(model_dirs["llama"])) as llm:
        assert llm.get_tokenizer()("hello").input_ids[0] == 0


def test_a_file_read_again_in_the_process_is_not_parsed_again(
    model_dirs, gguf_root, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Loading a file again in the process reuses its config, tokenizer and tensor table
    (parsing every metadata field again costs seconds for a real vocabulary); each load gets
    its own config and tokenizer to change, and a file replaced at the same path is read anew."""
    import shutil

    from kvfleet.engine.models import gguf_checkpoint

    parsed = []
    reader = gguf.GGUFReader

    def counted(path, *args, **kwargs):
        parsed.append(Path(path).name)
        return reader(path, *args, **kwargs)

    # Ours and transformers' (the config's, the tokenizer's) import it when they parse.
    monkeypatch.setattr(gguf, "GGUFReader", counted)

    def load(file: Path) -> tuple[Any, Any, dict[str, torch.Tensor]]:
        # In the engine's order.
        config, tok = gguf_checkpoint.load_config(file), gguf_checkpoint.load_tokenizer(file)
        return config, tok, dict(gguf_checkpoint.iter_tensors(file, progress=False))

    file = tmp_path / "model.gguf"
    shutil.copy(_written(gguf_root, model_dirs["llama"], "llama", "Q8_0"), file)
    config, tok, tensors = load(file)
    assert parsed
    first_parses = len(parsed)
    config.architectures = ["Changed"]
    tok.chat_template = "changed"
    again, again_tok, again_tensors = load(file)
    assert len(parsed) == first_parses
    assert again.architectures == ["LlamaForCausalLM"]
    assert again_tok.chat_template != "changed"
    assert again_tok("hello").input_ids == tok("hello").input_ids
    assert again_tensors.keys() == tensors.keys()
    assert all(torch.equal(t, tensors[name]) for name, t in again_tensors.items())

    shutil.copy(_written(gguf_root, model_dirs["qwen2"], "qwen2", "Q8_0"), file)
    qwen2, _, qwen2_tensors = load(file)
    assert len(parsed) == 2 * first_parses
    assert qwen2.architectures == ["Qwen2ForCausalLM"]
    assert "model.layers.0.self_attn.q_proj.bias" in qwen2_tensors


def _tiny_gguf(path: Path, arch: str, qtype: gguf.GGMLQuantizationType) -> Path:
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(1)
    rows = 4
    if qtype == gguf.GGMLQuantizationType.F32:
        writer.add_tensor("token_embd.weight", np.zeros((rows, 32), dtype=np.float32))
    else:
        block_bytes = gguf.GGML_QUANT_SIZES[qtype][1]
        raw = np.zeros((rows, block_bytes), dtype=np.uint8)
        writer.add_tensor("token_embd.weight", raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_unsupported_quant_type_is_one_line(tmp_path: Path) -> None:
    file = _tiny_gguf(tmp_path / "m.gguf", "llama", gguf.GGMLQuantizationType.TQ1_0)
    with pytest.raises(ValueError) as err:
        LLM(str(file))
    message = str(err.value)
    assert "\n" not in message
    assert "TQ1_0 not supported; supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1" in message
    assert "Q4_K, Q5_K, Q6_K" in message


def test_unsupported_architecture_is_one_line(tmp_path: Path) -> None:
    file = _tiny_gguf(tmp_path / "m.gguf", "phi3", gguf.GGMLQuantizationType.F32)
    with pytest.raises(ValueError) as err:
        LLM(str(file))
    assert str(err.value) == (
        "m.gguf: GGUF architecture 'phi3' is not supported; supported: llama, mistral, qwen2, qwen3"
    )


def test_smollm2_q4_1_chat_equals_hf(smollm2_gguf: Path) -> None:
    """The real SmolLM2-135M-Instruct Q4_1 (its matrices Q4_1 and Q8_0): chat prompts of 32+
    tokens, greedy, engine against HF on the same file."""
    file = smollm2_gguf
    questions = ["What is the capital of France?", "Name three primary colours."]
    with LLM(str(file), dtype="float32", max_num_batched_tokens=32) as llm:
        tok = llm.get_tokenizer()
        prompts = [
            tok.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True
            )["input_ids"]
            for q in questions
        ]
        assert all(len(p) >= 32 for p in prompts)
        got = _engine_greedy(llm, prompts, 12)
    assert got == _hf_greedy(file, prompts, 12)
    assert "Paris" in tok.decode(got[0])
