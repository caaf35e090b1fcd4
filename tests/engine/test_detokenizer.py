"""Incremental detokenization: the streamed text equals a one-shot decode, characters split
across tokens are held until whole, stop strings are cut and never streamed."""

from __future__ import annotations

import pytest

from kvfleet.engine.detokenizer import IncrementalDetokenizer
from tests.support.tiny_model import build_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


def _stream(tokenizer, text: str, stop: list[str]) -> tuple[IncrementalDetokenizer, list[str]]:
    prompt = tokenizer("Q:").input_ids
    ids = tokenizer(text, add_special_tokens=False).input_ids
    detok = IncrementalDetokenizer(tokenizer, prompt, stop)
    deltas = []
    for i, t in enumerate(ids):
        hit = detok.add_token(t)
        last = hit is not None or i == len(ids) - 1
        deltas.append(detok.take_delta(finished=last))
        if hit:
            break
    return detok, deltas


@pytest.mark.parametrize(
    "text",
    [
        "the quick brown fox jumps over the lazy dog",
        "héllo wörld 你好 🙂 done",
        "  spaced\n\tout  ",
    ],
)
def test_streamed_text_equals_decode(tokenizer, text):
    detok, deltas = _stream(tokenizer, text, [])
    assert "".join(deltas) == text == detok.output_text
    assert all("\ufffd" not in d for d in deltas)


def test_multibyte_characters_are_held_until_complete(tokenizer):
    ids = tokenizer("🙂", add_special_tokens=False).input_ids
    assert len(ids) > 1, "the emoji should take several byte-level tokens"
    detok = IncrementalDetokenizer(tokenizer, [0], [])
    for t in ids[:-1]:
        detok.add_token(t)
        assert detok.take_delta(finished=False) == ""
    detok.add_token(ids[-1])
    assert detok.take_delta(finished=True) == "🙂"


def test_stop_string_across_tokens_is_cut_and_never_streamed(tokenizer):
    text = "the weather is sunny today and tomorrow"
    detok, deltas = _stream(tokenizer, text, ["sunny to"])
    assert detok.stopped_by == "sunny to"
    assert "".join(deltas) == "the weather is "
    assert not any("sun" in d for d in deltas)


def test_no_stop_match_releases_held_text_at_the_end(tokenizer):
    detok, deltas = _stream(tokenizer, "ending with sun", ["sunny"])
    assert detok.stopped_by is None
    assert "".join(deltas) == "ending with sun"
