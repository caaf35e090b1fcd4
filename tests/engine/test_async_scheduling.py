"""Async scheduling through the whole engine: each step is launched before the host reads the
previous step's tokens, and what comes out is what the synchronous loop gives."""

from __future__ import annotations

import pytest

from kvfleet.engine import LLM, SamplingParams
from tests.support.engine import assert_no_leak

# Seeded or greedy, so the tokens do not depend on which requests share a batch (the two loops
# admit requests at different steps).
PARAMS = [
    SamplingParams(temperature=0, max_tokens=20),
    SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_tokens=24, logprobs=3),
    SamplingParams(temperature=1.0, top_k=5, seed=2, n=2, max_tokens=16),
    SamplingParams(temperature=0, repetition_penalty=1.3, frequency_penalty=0.5, max_tokens=18),
    SamplingParams(temperature=0.7, seed=3, min_tokens=6, max_tokens=12, presence_penalty=0.4),
    SamplingParams(temperature=0, max_tokens=30, logit_bias={5: 3.0, 9: -100.0}),
]


def _outputs(llm: LLM, prompts: list[list[int]]) -> list:
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts[: len(PARAMS)]], PARAMS, use_tqdm=False
    )
    return [
        (c.token_ids, c.finish_reason, c.logprobs, c.cumulative_logprob)
        for o in outs
        for c in o.outputs
    ]


@pytest.mark.parametrize("blocks", [None, 12], ids=["roomy", "preempting"])
def test_async_scheduling_gives_what_the_synchronous_loop_gives(model_dirs, prompts, blocks):
    path = str(model_dirs["llama"])
    args = {"dtype": "float32", "num_gpu_blocks_override": blocks, "max_num_batched_tokens": 32}
    sync = LLM(path, async_scheduling=False, **args)
    expected = _outputs(sync, prompts)
    eager = LLM(path, **args)
    assert eager.engine.args.async_scheduling  # the default
    got = _outputs(eager, prompts)
    for (tokens, reason, logprobs, total), want in zip(got, expected, strict=True):
        assert (tokens, reason) == want[:2]
        # A recomputed sequence runs in other batches than before: float sums may differ.
        if logprobs is not None:
            assert [list(d) for d in logprobs] == [list(d) for d in want[2]]
            for d, w in zip(logprobs, want[2], strict=True):
                assert list(d.values()) == pytest.approx(list(w.values()), abs=1e-4)
            assert total == pytest.approx(want[3], abs=1e-3)
    if blocks is not None:
        assert eager.engine.stats().num_preemptions > 0
    # Stopped at EOS or a stop token the stop is read a step late: the wasted row is freed too.
    first = expected[0][0]
    stops = [SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[t]) for t in first[2:5]]
    stop_prompts = [{"prompt_token_ids": prompts[0]}] * len(stops)
    want = [o.outputs[0].token_ids for o in sync.generate(stop_prompts, stops, use_tqdm=False)]
    got_stops = eager.generate(stop_prompts, stops, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got_stops] == want
    assert all(o.outputs[0].finish_reason == "stop" for o in got_stops)
    assert_no_leak(sync)
    assert_no_leak(eager)


def test_the_next_step_is_launched_before_the_last_tokens_are_read(model_dirs, prompts):
    llm = LLM(str(model_dirs["llama"]), dtype="float32")
    core, calls = llm.engine, []
    runner = core.runner
    step, launch, sample, resolve = core.step, runner.launch, runner.sample, runner.resolve

    def spy_step():
        calls.append("step")
        return step()

    def spy_launch(out, prev=None):
        calls.append("launch after a step in flight" if prev is not None else "launch")
        return launch(out, prev)

    def spy_sample(launched):
        calls.append("sample")
        return sample(launched)

    def spy_resolve(flight):
        calls.append("resolve")
        return resolve(flight)

    core.step = spy_step
    runner.launch, runner.sample, runner.resolve = spy_launch, spy_sample, spy_resolve
    out = llm.generate({"prompt_token_ids": prompts[0]}, SamplingParams(max_tokens=4))[0]
    assert len(out.outputs[0].token_ids) == 4
    # Prefill, then decodes each launched with the step before still in flight (its token fed
    # from the device); every resolve comes after the next launch, and a step returns its
    # outputs right after the resolve: the launched step is sampled (its grammar masks
    # computed) at the start of the next call.
    assert calls[:11] == ["step", "launch"] + [
        "step",
        "sample",
        "launch after a step in flight",
        "resolve",
    ] * 2 + ["step"]
    assert_no_leak(llm)


def test_a_request_aborted_with_its_step_launched_leaves_nothing(model_dirs, prompts):
    llm = LLM(str(model_dirs["llama"]), dtype="float32")
    core = llm.engine
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=1.2)
    alone = llm.generate({"prompt_token_ids": prompts[2]}, sp)[0].outputs[0].token_ids
    core.add_request("a", core.admit(prompts[1], sp))
    core.add_request("b", core.admit(prompts[2], sp))
    for _ in range(4):
        core.step()
    # Between steps, the last one is launched and not yet sampled: "a" has a row in it.
    assert core._launched is not None and "a#0" in {r.request_id for r in core._launched.reqs}
    assert core.abort_request("a")
    deltas = []
    while core.has_unfinished_requests():
        deltas.extend(core.step())
    assert {d.request_id for d in deltas} == {"b"}
    tokens = [t for d in deltas for t in d.outputs[0].token_ids]
    assert tokens == alone[-len(tokens) :] and deltas[-1].finished
    assert not core.runner.sampler._penalties
    assert_no_leak(llm)
