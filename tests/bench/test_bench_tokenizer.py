"""bench/dummy_tokenizer.py: tokenizers covering a dummy-weight model's whole vocabulary, with
the family's special tokens where the config says, loadable by the engine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from kvfleet.engine import LLM, SamplingParams
from kvfleet.protocol.chat_template import ChatMessage, render_chat
from kvfleet.protocol.json_body import RequestRefused
from tests.support.scripts import load_bench_script

dummy = load_bench_script("dummy_tokenizer")

BENCH_MODELS = Path(__file__).resolve().parents[2] / "bench" / "models"
TEXT = "Explain RAG in 3 sentences, then say: ünïcödé 😀!"


def assert_covers_vocabulary(tok, vocab_size: int) -> None:
    """Every id below vocab_size is a token of its own (id -> token -> the same id), and
    decodes to text."""
    ids = list(range(vocab_size))
    assert len(tok) == vocab_size
    assert tok.convert_tokens_to_ids(tok.convert_ids_to_tokens(ids)) == ids
    # The tokenizers library itself: transformers' batch_decode costs 3x as much per id.
    texts = tok.backend_tokenizer.decode_batch([[i] for i in ids], skip_special_tokens=False)
    assert all(isinstance(t, str) and t for t in texts)


def test_gemma2_real_config(tmp_path: Path) -> None:
    out = dummy.write_model_dir(BENCH_MODELS / "gemma-2-2b-it", tmp_path / "gemma")
    config = json.loads((out / "config.json").read_text())
    assert config == json.loads((BENCH_MODELS / "gemma-2-2b-it" / "config.json").read_text())
    tok = AutoTokenizer.from_pretrained(out)
    assert_covers_vocabulary(tok, 256000)
    assert (tok.pad_token_id, tok.eos_token_id, tok.bos_token_id) == (0, 1, 2)
    assert tok.convert_ids_to_tokens([106, 107]) == ["<start_of_turn>", "<end_of_turn>"]
    assert tok.decode([255999]) == " <255999>"

    ids = tok(TEXT).input_ids
    assert ids[0] == 2 and 2 not in ids[1:]  # <bos> prepended, as Gemma's tokenizer does
    assert tok.decode(ids, skip_special_tokens=True) == TEXT
    assert len(ids) < 3 * len(TEXT.split()) + 20  # trained merges, not one token per byte

    user = [{"role": "user", "content": " Explain RAG in 3 sentences\n"}]
    chat = tok.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
    assert chat == (
        "<bos><start_of_turn>user\nExplain RAG in 3 sentences<end_of_turn>\n<start_of_turn>model\n"
    )
    turns = [*user, {"role": "assistant", "content": "Fine."}, {"role": "user", "content": "Go"}]
    assert "<start_of_turn>model\nFine.<end_of_turn>\n<start_of_turn>user\nGo" in (
        tok.apply_chat_template(turns, tokenize=False)
    )
    with pytest.raises(Exception, match="no system role"):
        tok.apply_chat_template([{"role": "system", "content": "be brief"}, *user], tokenize=False)


def test_gpt2_real_config(tmp_path: Path) -> None:
    out = dummy.write_model_dir(BENCH_MODELS / "gpt2-large", tmp_path / "gpt2")
    tok = AutoTokenizer.from_pretrained(out)
    assert_covers_vocabulary(tok, 50257)
    assert tok.bos_token_id == tok.eos_token_id == 50256 and tok.pad_token_id is None
    assert tok.convert_ids_to_tokens(50256) == "<|endoftext|>"
    ids = tok(TEXT).input_ids
    assert 50256 not in ids and tok.decode(ids) == TEXT  # GPT-2 prepends nothing


def test_llama3_real_config(tmp_path: Path) -> None:
    out = dummy.write_model_dir(BENCH_MODELS / "Llama-3.1-8B", tmp_path / "llama")
    tok = AutoTokenizer.from_pretrained(out)
    assert_covers_vocabulary(tok, 128256)
    assert (tok.bos_token_id, tok.eos_token_id) == (128000, 128001)
    assert tok.convert_ids_to_tokens([128006, 128007, 128009]) == [
        "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"
    ]  # fmt: skip
    ids = tok(TEXT).input_ids
    assert ids[0] == 128000 and tok.decode(ids, skip_special_tokens=True) == TEXT
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Hi "}]
    assert tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nbe brief<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


def test_loads_in_the_engine(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    """The tiny Gemma 2 config (bos 0, eos 1, pad 2, vocab 512): the engine tokenizes, renders
    the chat template and detokenizes random-weight output with it."""
    out = dummy.write_model_dir(model_dirs["gemma2"], tmp_path / "gemma")
    llm = LLM(str(out), load_format="dummy", dtype="float32", max_model_len=256)
    tok = llm.get_tokenizer()
    assert_covers_vocabulary(tok, 512)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 2)

    [res] = llm.generate(TEXT, SamplingParams(max_tokens=12, ignore_eos=True))
    assert res.prompt_token_ids == tok(TEXT).input_ids and res.prompt_token_ids[0] == 0
    assert len(res.outputs[0].token_ids) == 12 and isinstance(res.outputs[0].text, str)

    ids = render_chat(tok, [ChatMessage(role="user", content="Explain RAG")])
    assert ids[:2] == [0, 106] and 107 in ids
    assert tok.decode(ids) == (
        "<bos><start_of_turn>user\nExplain RAG<end_of_turn>\n<start_of_turn>model\n"
    )
    with pytest.raises(RequestRefused):
        render_chat(tok, [ChatMessage(role="system", content="hi")])


def test_rejects_what_it_cannot_lay_out() -> None:
    base = {"vocab_size": 1000, "bos_token_id": 0, "eos_token_id": 1}
    with pytest.raises(ValueError, match="two ids"):  # GPT-2 has one token for both
        dummy.special_tokens({**base, "model_type": "gpt2"}, dummy.FAMILIES["gpt2"])
    with pytest.raises(ValueError, match="no special token"):
        gemma = {**base, "model_type": "gemma2", "eos_token_id": [1, 500]}
        dummy.special_tokens(gemma, dummy.FAMILIES["gemma2"])
    with pytest.raises(ValueError, match="no dummy tokenizer"):
        dummy.build_dummy_tokenizer({**base, "model_type": "mistral"})
