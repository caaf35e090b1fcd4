"""The offline API's prompts: without a tokenizer, a text prompt is refused with what to pass
instead, and token ids still generate."""

from __future__ import annotations

import pytest

from kvfleet.engine import LLM, SamplingParams


def test_a_text_prompt_without_a_tokenizer_says_to_pass_ids(model_dirs) -> None:
    with LLM(str(model_dirs["llama"]), max_model_len=64, skip_tokenizer_init=True) as llm:
        with pytest.raises(TypeError, match=r"skip_tokenizer_init.*prompt_token_ids"):
            llm.generate("Hello", SamplingParams(max_tokens=2))
        out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=2))
        assert len(out[0].outputs[0].token_ids) == 2
