"""Admission alone, no model: each limit a request must fit, the error that names it, and the
max_tokens it resolves once for the scheduler and the Request."""

from __future__ import annotations

from concurrent.futures import Future

import pytest

from kvfleet.engine.admission import CONTEXT_LENGTH_EXCEEDED, Admission, completion_budget
from kvfleet.engine.grammar import GrammarError
from kvfleet.engine.request import InvalidRequestError
from kvfleet.engine.sampling_params import SamplingParams, StructuredOutputsParams
from kvfleet.engine.structured_output import CompiledGrammar

# 5 KV blocks of 16 tokens: 80 KV slots, so a sequence of up to 81 tokens (its last sampled
# token is never fed back).
LIMITS = Admission(max_model_len=100, vocab_size=50, block_size=16, num_kv_blocks=5)
PROMPT = list(range(10))
REGEX = StructuredOutputsParams(regex="a+")


def refusal(params: SamplingParams, prompt: list[int] = PROMPT, **kwargs) -> InvalidRequestError:
    admission = kwargs.pop("admission", LIMITS)
    with pytest.raises(InvalidRequestError) as e:
        admission.admit(prompt, params, **kwargs)
    return e.value


# -- the completion budget -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("requested", "refuse", "budget"),
    [(None, False, 90), (None, True, 90), (5, True, 5), (90, True, 90), (500, False, 90)],
)
def test_the_budget_is_the_request_within_the_room_the_prompt_leaves(requested, refuse, budget):
    assert completion_budget(10, requested, 100, refuse_past_context=refuse) == budget


def test_a_budget_past_the_room_is_refused_when_asked_to_be():
    with pytest.raises(InvalidRequestError) as e:
        completion_budget(10, 91, 100, refuse_past_context=True)
    assert str(e.value) == (
        "This model's maximum context length is 100 tokens. However, you requested 101 tokens "
        "(10 in the prompt, 91 for the completion). Reduce the prompt or max_tokens."
    )
    assert (e.value.param, e.value.code) == ("max_tokens", CONTEXT_LENGTH_EXCEEDED)


@pytest.mark.parametrize("num_prompt_tokens", [100, 150])
@pytest.mark.parametrize("refuse", [False, True])
def test_a_prompt_that_leaves_no_room_is_refused(num_prompt_tokens, refuse):
    with pytest.raises(InvalidRequestError) as e:
        completion_budget(num_prompt_tokens, None, 100, refuse_past_context=refuse)
    assert str(e.value) == (
        f"This model's maximum context length is 100 tokens. However, your prompt has "
        f"{num_prompt_tokens} tokens, leaving no room for a completion."
    )
    assert (e.value.param, e.value.code) == ("prompt", CONTEXT_LENGTH_EXCEEDED)


# -- what admission resolves ---------------------------------------------------------------------


def test_admission_resolves_max_tokens_into_the_request_and_keeps_the_params_as_asked():
    params = SamplingParams(max_tokens=None)
    wide = Admission(100, 50, 16, num_kv_blocks=7)
    admitted = wide.admit(PROMPT, params, "text")
    assert admitted.max_tokens == 90 and admitted.params is params
    assert admitted.prompt_token_ids == PROMPT and admitted.prompt_token_ids is not PROMPT
    assert admitted.prompt == "text" and admitted.grammar is None
    assert wide.admit(PROMPT, SamplingParams(max_tokens=500)).max_tokens == 90
    assert wide.admit(PROMPT, SamplingParams(max_tokens=7)).max_tokens == 7


def test_past_the_context_a_request_is_clipped_offline_and_refused_by_the_api():
    params = SamplingParams(max_tokens=95)
    wide = Admission(100, 50, 16, num_kv_blocks=7)
    assert wide.admit(PROMPT, params).max_tokens == 90
    e = refusal(params, admission=wide, refuse_past_context=True)
    assert (e.param, e.code) == ("max_tokens", CONTEXT_LENGTH_EXCEEDED)


# -- each limit ----------------------------------------------------------------------------------


def test_an_empty_prompt_is_refused():
    e = refusal(SamplingParams(), prompt=[])
    assert (str(e), e.param, e.code) == ("the prompt is empty", "prompt", None)


def test_a_prompt_that_fills_the_context_is_refused_before_any_other_check():
    e = refusal(SamplingParams(top_k=500), prompt=[99] * 100)
    assert e.param == "prompt" and e.code == CONTEXT_LENGTH_EXCEEDED


def test_stop_strings_need_a_tokenizer():
    without = Admission(100, 50, 16, 5, has_tokenizer=False)
    e = refusal(SamplingParams(stop=["x"]), admission=without)
    assert (str(e), e.param) == ("stop strings need a tokenizer (the engine runs without one)",
                                 "stop")  # fmt: skip
    without.admit(PROMPT, SamplingParams(stop_token_ids=[3]))


@pytest.mark.parametrize(
    ("prompt", "params", "message", "param"),
    [
        ([1, 50, -1], SamplingParams(),
         "prompt token ids [50, -1] are outside the vocabulary [0, 50)", "prompt"),
        (PROMPT, SamplingParams(stop_token_ids=[3, 50]),
         "stop_token_ids [50] are outside the vocabulary [0, 50)", "stop_token_ids"),
        (PROMPT, SamplingParams(logit_bias={49: 1.0, 50: 1.0}),
         "logit_bias token ids [50] are outside the vocabulary [0, 50)", "logit_bias"),
        (PROMPT, SamplingParams(top_k=51),
         "top_k (51) must not exceed the vocabulary size (50)", "top_k"),
    ],
)  # fmt: skip
def test_token_ids_and_top_k_must_be_within_the_vocabulary(prompt, params, message, param):
    e = refusal(params, prompt=prompt)
    assert (str(e), e.param, e.code) == (message, param, None)


def test_the_vocabulary_edges_are_admitted():
    params = SamplingParams(top_k=50, stop_token_ids=[49], logit_bias={49: -1.0})
    LIMITS.admit([0, 49], params)


def test_a_sequence_must_fit_the_kv_cache_alone():
    # 10 + 71 = 81 tokens need 80 KV slots: five blocks.
    LIMITS.admit(PROMPT, SamplingParams(max_tokens=71))
    e = refusal(SamplingParams(max_tokens=72))
    assert str(e) == (
        "the request needs up to 82 tokens (6 KV blocks) but the KV cache holds only 5 blocks; "
        "lower max_tokens or give the engine more KV-cache memory"
    )
    assert (e.param, e.code) == ("max_tokens", None)
    # Without max_tokens the request may run to the context length: 100 tokens.
    assert refusal(SamplingParams(max_tokens=None)).param == "max_tokens"


def test_min_tokens_must_fit_the_room_the_prompt_leaves():
    wide = Admission(100, 50, 16, num_kv_blocks=7)
    wide.admit(PROMPT, SamplingParams(max_tokens=None, min_tokens=90))
    e = refusal(SamplingParams(max_tokens=None, min_tokens=91), admission=wide)
    assert str(e) == (
        "min_tokens (91) exceeds the 90 tokens the context length (max_model_len 100) leaves "
        "after the prompt"
    )
    assert e.param == "min_tokens"


# -- structured outputs --------------------------------------------------------------------------


def test_structured_outputs_refused_when_off_say_why():
    off = Admission(100, 50, 16, 5, structured_unavailable="the engine runs without a tokenizer")
    e = refusal(SamplingParams(structured_outputs=REGEX), admission=off)
    assert str(e) == "structured outputs are not available: the engine runs without a tokenizer"
    assert e.param == "structured_outputs"


def test_a_structured_request_is_admitted_with_its_grammar_compiled_or_compiling():
    params = SamplingParams(structured_outputs=REGEX)
    with pytest.raises(ValueError, match="with its grammar"):
        LIMITS.admit(PROMPT, params)
    compiled = CompiledGrammar("regex", None)
    assert LIMITS.admit(PROMPT, params, grammar=compiled).grammar is compiled
    compiling: Future[CompiledGrammar] = Future()
    assert LIMITS.admit(PROMPT, params, grammar=compiling).grammar is compiling
    compiling.set_result(compiled)  # done by admission: the request takes the grammar itself
    assert LIMITS.admit(PROMPT, params, grammar=compiling).grammar is compiled
    failed: Future[CompiledGrammar] = Future()
    failed.set_exception(GrammarError("invalid regex", "structured_outputs"))
    with pytest.raises(GrammarError, match="invalid regex"):
        LIMITS.admit(PROMPT, params, grammar=failed)
