"""SamplingParams.prompt_logprobs: the logprob of each prompt token given the ones before it
(and the top N), as HF transformers' log_softmax of the same prompt gives them, whether the
prompt runs in one chunk or several (a long one in chunks by default on the CPU, beside other
requests' decodes), next to a cached prefix, and for n > 1."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from kvfleet.engine.engine_args import CPU_MAX_NUM_BATCHED_TOKENS, EngineArgs
from kvfleet.engine.engine_core import EngineCore
from kvfleet.engine.llm import LLM
from kvfleet.engine.sampling_params import SamplingParams
from tests.support.engine import assert_no_leak, hf_prompt_logprobs

# fp32 on both sides; the engine's attention and matmul order differ from HF's.
ATOL = 1e-4


def _check(out_prompt_logprobs, prompt: list[int], ref: torch.Tensor, top_n: int) -> None:
    assert len(out_prompt_logprobs) == len(prompt)
    assert out_prompt_logprobs[0] is None
    for pos in range(1, len(prompt)):
        entry = out_prompt_logprobs[pos]
        row = ref[pos - 1]
        token = prompt[pos]
        assert abs(entry[token] - row[token].item()) < ATOL, (pos, entry[token], row[token])
        top = row.topk(top_n)
        want = dict(zip(top.indices.tolist(), top.values.tolist(), strict=True))
        # The prompt token, plus the top N (which may include it).
        assert set(entry) == set(want) | {token}
        for tok, lp in want.items():
            assert abs(entry[tok] - lp) < ATOL


@pytest.mark.parametrize("chunk", [2048, 16])
def test_prompt_logprobs_equal_hf(model_dirs, prompts, chunk: int) -> None:
    """Every prompt length of the shared set, in one chunk and in 16-token chunks; the prompt of
    length 1 has only the None entry."""
    path = model_dirs["llama"]
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=3)
    with LLM(
        str(path),
        dtype="float32",
        skip_tokenizer_init=True,
        max_num_batched_tokens=chunk,
        enable_prefix_caching=True,
    ) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert_no_leak(llm)
    for prompt, out in zip(prompts, outs, strict=True):
        _check(out.prompt_logprobs, prompt, hf_prompt_logprobs(path, prompt), 3)


def test_a_long_prompt_is_scored_in_chunks_by_default_while_others_decode(model_dirs) -> None:
    """A 1,000-token scoring request on the CPU's default budget: no step computes more than 512
    tokens, so a running request decodes between its chunks instead of waiting for one long
    step; the chunks' logprobs together equal HF's over the whole prompt."""
    path = model_dirs["llama"]
    rng = random.Random(35)
    prompt = [rng.randrange(3, 500) for _ in range(1000)]
    core = EngineCore(EngineArgs(model=str(path), dtype="float32", skip_tokenizer_init=True))
    assert core.args.max_num_batched_tokens == CPU_MAX_NUM_BATCHED_TOKENS == 512
    schedule = core.scheduler.schedule
    steps: list[dict[str, int]] = []  # each step's tokens per request

    def spy():
        out = schedule()
        steps.append({req.request_id: n for req, n in out.scheduled})
        return out

    core.scheduler.schedule = spy  # type: ignore[method-assign]
    decode = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    core.add_request("decode", core.admit([5, 17, 99], decode))
    core.step()
    scoring = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=3)
    core.add_request("score", core.admit(prompt, scoring))
    scored = None
    while core.has_unfinished_requests():
        for delta in core.step():
            if delta.prompt_logprobs is not None:
                scored = delta.prompt_logprobs
    core.close()

    assert max(sum(s.values()) for s in steps) <= 512
    chunks = [i for i, s in enumerate(steps) if "score#0" in s]
    assert len(chunks) >= 2
    assert all("decode#0" in steps[i] for i in range(chunks[0], chunks[-1] + 1))
    _check(scored, prompt, hf_prompt_logprobs(path, prompt), 3)


def test_prompt_logprobs_skip_the_prefix_cache(model_dirs, prompts) -> None:
    """The same prompt twice: the second run scores every position (no cache hit), and a
    request without prompt_logprobs still takes its hit; n > 1 gets one list."""
    path = model_dirs["llama"]
    prompt = prompts[-1]
    ref = hf_prompt_logprobs(path, prompt)
    with LLM(
        str(path), dtype="float32", skip_tokenizer_init=True, enable_prefix_caching=True
    ) as llm:
        plain = SamplingParams(max_tokens=1)
        scoring = SamplingParams(max_tokens=1, prompt_logprobs=0, n=2, temperature=1.0, seed=1)
        llm.generate([{"prompt_token_ids": prompt}], plain, use_tqdm=False)
        [again] = llm.generate([{"prompt_token_ids": prompt}], scoring, use_tqdm=False)
        assert again.num_cached_tokens == 0
        _check(again.prompt_logprobs, prompt, ref, 0)
        [hit] = llm.generate([{"prompt_token_ids": prompt}], plain, use_tqdm=False)
        assert hit.num_cached_tokens > 0
        assert hit.prompt_logprobs is None
        assert_no_leak(llm)


def test_prompt_logprobs_bounds() -> None:
    SamplingParams(prompt_logprobs=20)
    for bad in (-1, 21):
        with pytest.raises(ValueError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)


def test_prompt_logprobs_real_default_model(smollm2_gguf: Path) -> None:
    """SmolLM2-135M-Instruct (the GGUF's Q4_1/Q8_0 matrices dequantized on both sides): a
    sentence scored in 8-token chunks against HF on the same file."""
    file = smollm2_gguf
    with LLM(str(file), dtype="float32", max_num_batched_tokens=8) as llm:
        prompt = llm.get_tokenizer().encode("The quick brown fox jumps over the lazy dog.")
        params = SamplingParams(max_tokens=1, prompt_logprobs=5)
        [out] = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    ref = hf_prompt_logprobs(file.parent, prompt, gguf_file=file.name)
    _check(out.prompt_logprobs, prompt, ref, 5)
