"""Sampling through the whole engine: seeds, top-k, logprobs against HF, penalties against HF,
stop conditions; and the Sampler's filters on hand-made distributions."""

from __future__ import annotations

import math

import pytest
import torch

from kvfleet.engine import LLM, SamplingParams
from kvfleet.engine.request import Request
from kvfleet.engine.sampler import Sampler
from tests.support.engine import assert_no_leak, hf_greedy


@pytest.fixture(scope="module")
def llm(model_dirs) -> LLM:
    return LLM(str(model_dirs["llama"]), dtype="float32")


@pytest.fixture(autouse=True)
def _no_leak_after(request):
    yield
    if "llm" in request.fixturenames:
        assert_no_leak(request.getfixturevalue("llm"))


def _tok(prompt):
    return {"prompt_token_ids": prompt}


def test_seeded_sampling_is_reproducible_whatever_the_batch(llm, prompts):
    sp = SamplingParams(temperature=1.0, max_tokens=24, seed=7)
    alone = llm.generate(_tok(prompts[3]), sp)[0].outputs[0].token_ids
    again = llm.generate(_tok(prompts[3]), sp)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=24)
    batch = llm.generate([_tok(p) for p in prompts], [others] * 3 + [sp] + [others] * 4)
    assert alone == again == batch[3].outputs[0].token_ids
    other_seed = llm.generate(_tok(prompts[3]), sp.model_copy(update={"seed": 8}))[0]
    assert other_seed.outputs[0].token_ids != alone


def test_seeded_sampling_survives_preemption(model_dirs, prompts):
    sp = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=32, seed=3)
    roomy = LLM(str(model_dirs["llama"]), dtype="float32")
    tight = LLM(str(model_dirs["llama"]), dtype="float32", num_gpu_blocks_override=20)
    expected = [o.outputs[0].token_ids for o in roomy.generate([_tok(p) for p in prompts], sp)]
    got = [o.outputs[0].token_ids for o in tight.generate([_tok(p) for p in prompts], sp)]
    assert tight.engine.stats().num_preemptions > 0
    assert got == expected
    assert_no_leak(roomy)
    assert_no_leak(tight)


def test_top_k_1_equals_greedy(llm, prompts):
    greedy = llm.generate([_tok(p) for p in prompts], SamplingParams(temperature=0, max_tokens=16))
    top1 = llm.generate(
        [_tok(p) for p in prompts], SamplingParams(temperature=1.0, top_k=1, max_tokens=16)
    )
    assert [o.outputs[0].token_ids for o in greedy] == [o.outputs[0].token_ids for o in top1]


def test_n_completions_with_seed(llm, prompts):
    sp = SamplingParams(n=3, temperature=1.0, max_tokens=12, seed=11)
    first = llm.generate(_tok(prompts[2]), sp)[0]
    second = llm.generate(_tok(prompts[2]), sp)[0]
    ids = [c.token_ids for c in first.outputs]
    assert [c.index for c in first.outputs] == [0, 1, 2]
    assert ids == [c.token_ids for c in second.outputs]
    assert len({tuple(i) for i in ids}) > 1


def test_logprobs_match_hf_log_softmax(llm, model_dirs, prompts):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dirs["llama"], dtype=torch.float32).eval()
    for prompt in prompts[1:6]:
        out = llm.generate(_tok(prompt), SamplingParams(temperature=0, max_tokens=8, logprobs=5))[0]
        choice = out.outputs[0]
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + choice.token_ids])).logits[0].float()
        ref = torch.log_softmax(logits, dim=-1)[len(prompt) - 1 : -1]
        assert choice.logprobs is not None and len(choice.logprobs) == len(choice.token_ids)
        total = 0.0
        for step, (token, entry) in enumerate(zip(choice.token_ids, choice.logprobs, strict=True)):
            assert abs(entry[token] - ref[step, token].item()) < 1e-4
            total += entry[token]
            top_vals, top_ids = ref[step].topk(5)
            for tid, val in zip(top_ids.tolist(), top_vals.tolist(), strict=True):
                assert abs(entry[tid] - val) < 1e-4
            assert len(entry) <= 6
        assert math.isclose(choice.cumulative_logprob, total, rel_tol=1e-6, abs_tol=1e-6)


def test_repetition_penalty_equals_hf(llm, model_dirs, prompts):
    subset = prompts[:5]
    expected = hf_greedy(model_dirs["llama"], subset, 20, repetition_penalty=1.5)
    outs = llm.generate(
        [_tok(p) for p in subset],
        SamplingParams(temperature=0, max_tokens=20, repetition_penalty=1.5),
    )
    assert [o.outputs[0].token_ids for o in outs] == expected
    plain = llm.generate(_tok(subset[4]), SamplingParams(temperature=0, max_tokens=20))[0]
    assert plain.outputs[0].token_ids != outs[4].outputs[0].token_ids


def test_max_tokens_gives_length(llm, prompts):
    out = llm.generate(_tok(prompts[4]), SamplingParams(temperature=0, max_tokens=5))[0].outputs[0]
    assert len(out.token_ids) == 5
    assert out.finish_reason == "length"


def test_stop_token_ids_and_min_tokens(llm, prompts):
    ref = llm.generate(_tok(prompts[5]), SamplingParams(temperature=0, max_tokens=24))[0]
    ids = ref.outputs[0].token_ids
    k = 6
    stop_id = ids[k]
    first = ids.index(stop_id)
    out = llm.generate(
        _tok(prompts[5]), SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_id])
    )[0].outputs[0]
    assert out.token_ids == ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id

    held = llm.generate(
        _tok(prompts[5]),
        SamplingParams(
            temperature=0, max_tokens=24, stop_token_ids=[stop_id], min_tokens=first + 3
        ),
    )[0].outputs[0]
    assert stop_id not in held.token_ids[: first + 3]
    assert len(held.token_ids) >= first + 3


def test_eos_and_ignore_eos(llm, prompts):
    ref = llm.generate(_tok(prompts[6]), SamplingParams(temperature=0, max_tokens=20))[0]
    ids = ref.outputs[0].token_ids
    eos = ids[4]
    saved = llm.engine.eos_token_ids
    llm.engine.eos_token_ids = frozenset({eos})
    try:
        stopped = llm.generate(_tok(prompts[6]), SamplingParams(temperature=0, max_tokens=20))[0]
        ignored = llm.generate(
            _tok(prompts[6]), SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
        )[0]
    finally:
        llm.engine.eos_token_ids = saved
    assert stopped.outputs[0].token_ids == ids[: ids.index(eos) + 1]
    assert stopped.outputs[0].finish_reason == "stop"
    assert stopped.outputs[0].stop_reason is None
    assert ignored.outputs[0].token_ids == ids
    assert ignored.outputs[0].finish_reason == "length"


def test_stop_string_is_cut_from_the_text(llm):
    sp = SamplingParams(temperature=0, max_tokens=40)
    ref = llm.generate("the weather today is", sp)[0].outputs[0]
    text = ref.text
    assert len(text) > 12
    stop = text[8:11]
    out = llm.generate("the weather today is", sp.model_copy(update={"stop": [stop]}))[0].outputs[0]
    assert out.text == text[: text.index(stop)]
    assert stop not in out.text
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert len(out.token_ids) < len(ref.token_ids)


# -- the Sampler alone ---------------------------------------------------------------------


def _req(rid: str, **sp) -> Request:
    return Request(rid, [5, 6, 7], SamplingParams(**sp), frozenset({1}), max_tokens=16)


def _tokens(sampler: Sampler, logits: torch.Tensor, *reqs: Request) -> list[int]:
    return sampler.sample(logits, list(reqs)).read()[0]


def _sample_counts(sampler: Sampler, logits: torch.Tensor, req: Request, n: int) -> torch.Tensor:
    counts = torch.zeros(logits.shape[-1])
    for _ in range(n):
        tok = _tokens(sampler, logits.clone().unsqueeze(0), req)[0]
        counts[tok] += 1
        sampler.forget(req.request_id)
    return counts


def test_top_p_top_k_min_p_keep_the_right_tokens():
    sampler = Sampler(vocab_size=6, device=torch.device("cpu"), seed=0)
    probs = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.04, 0.01])
    logits = probs.log()
    # top_p 0.7: {0, 1} reach 0.7; nothing else may be drawn.
    counts = _sample_counts(sampler, logits, _req("a", top_p=0.7), 300)
    assert counts[2:].sum() == 0 and counts[0] > 0 and counts[1] > 0
    counts = _sample_counts(sampler, logits, _req("b", top_k=3), 300)
    assert counts[3:].sum() == 0 and (counts[:3] > 0).all()
    # min_p 0.3: tokens under 0.3 * 0.4 = 0.12 are out.
    counts = _sample_counts(sampler, logits, _req("c", min_p=0.3), 300)
    assert counts[3:].sum() == 0 and (counts[:3] > 0).all()
    # Unfiltered sampling at temperature 1 follows the distribution.
    counts = _sample_counts(sampler, logits, _req("d"), 2000)
    assert torch.allclose(counts / 2000, probs, atol=0.04)


def test_presence_and_frequency_penalties():
    sampler = Sampler(vocab_size=4, device=torch.device("cpu"), seed=0)
    req = _req("p", temperature=0, frequency_penalty=0.5, presence_penalty=0.25)
    for t in (2, 2, 3):
        req.append_token(t)
    logits = torch.tensor([[1.0, 1.0, 2.0, 1.4]])
    penalized = logits.clone()
    sampler._apply_penalties_and_bans(penalized[0], req)
    # token 2: 2 - 0.5*2 - 0.25 = 0.75; token 3: 1.4 - 0.5 - 0.25 = 0.65; prompt tokens untouched.
    assert torch.allclose(penalized, torch.tensor([[1.0, 1.0, 0.75, 0.65]]))
    assert _tokens(sampler, logits.clone(), req) == [0]


def test_min_tokens_bans_eos_and_stop_ids():
    sampler = Sampler(vocab_size=4, device=torch.device("cpu"), seed=0)
    req = _req("m", temperature=0, min_tokens=2, stop_token_ids=[3])
    logits = torch.tensor([[0.0, 9.0, 1.0, 8.0]])  # eos (1) and stop id (3) lead
    assert _tokens(sampler, logits.clone(), req) == [2]
    req.append_token(2)
    req.append_token(2)
    assert _tokens(sampler, logits.clone(), req) == [1]
