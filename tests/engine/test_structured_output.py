"""Structured outputs in the engine: the constraint's shape, the grammar cache and its bounds, the
batch bitmask (vocabulary padding included), per-row failure isolation, and constrained
generation through the tiny random model (whose output only the grammar makes valid): JSON
schemas, choice, regex, mixed batches, n > 1 with seeds, preemption, logprobs."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import jsonschema
import llguidance
import llguidance.hf
import pytest
import torch
from pydantic import ValidationError
from transformers import AutoTokenizer

from kvfleet.engine import LLM, SamplingParams
from kvfleet.engine.async_engine import AsyncEngine
from kvfleet.engine.grammar import GrammarError, grammar_spec
from kvfleet.engine.request import Request
from kvfleet.engine.sampler import Sampler
from kvfleet.engine.sampling_params import MAX_SCHEMA_DEPTH, StructuredOutputsParams
from kvfleet.engine.structured_output import StructuredOutputs, apply_bitmask
from tests.support.engine import assert_no_leak
from tests.support.tiny_model import tiny_model_path

# A finite language: every constrained sequence must end, with "stop", well within max_tokens.
SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "size": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
    },
    "required": ["color", "size", "ok"],
    "additionalProperties": False,
}
COMPACT = {"json": SCHEMA, "disable_any_whitespace": True}


@pytest.fixture(scope="module")
def tokenizer(model_dirs):
    return AutoTokenizer.from_pretrained(model_dirs["llama"])


@pytest.fixture(scope="module")
def structured(tokenizer) -> StructuredOutputs:
    return StructuredOutputs(tokenizer, len(tokenizer), frozenset([tokenizer.eos_token_id]))


@pytest.fixture(scope="module")
def llm(model_dirs) -> LLM:
    return LLM(str(model_dirs["llama"]), dtype="float32")


@pytest.fixture(autouse=True)
def _no_leak_after(request):
    yield
    if "llm" in request.fixturenames:
        assert_no_leak(request.getfixturevalue("llm"))


def _allowed(bitmask_row: torch.Tensor, vocab: int) -> list[int]:
    return [t for t in range(vocab) if (int(bitmask_row[t // 32]) >> (t % 32)) & 1]


def _req(rid: str, structured: StructuredOutputs, so: dict | None, **sp) -> Request:
    params = SamplingParams(structured_outputs=so, **sp)
    grammar = None if so is None else structured.grammar(params.structured_outputs)
    return Request(rid, [5, 6, 7], params, frozenset([1]), max_tokens=16, grammar=grammar)


# -- the constraint ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "bad, message",
    [
        ({}, "exactly one of"),
        ({"regex": "a", "choice": ["x"]}, "got regex, choice"),
        ({"json_object": False}, "got none"),
        ({"json": "[1]"}, "JSON schema object"),
        ({"json": "{nope"}, "not valid JSON"),
        ({"guided_json": {}}, "Extra inputs"),
        ({"choice": []}, "at least 1"),
        (
            {"json_object": True, "disable_any_whitespace": True, "whitespace_pattern": " "},
            "exclude",
        ),
    ],
)
def test_constraint_shape_is_checked(bad, message):
    with pytest.raises(ValidationError, match=message):
        StructuredOutputsParams(**bad)


def test_json_schema_as_text_is_the_same_constraint():
    assert StructuredOutputsParams(json=json.dumps(SCHEMA)) == StructuredOutputsParams(json=SCHEMA)


# -- compiling and caching --------------------------------------------------------------------
def test_grammars_are_cached_by_constraint_in_a_bounded_lru(tokenizer):
    so = StructuredOutputs(tokenizer, len(tokenizer), frozenset([1]), cache_size=2)
    a, b, c = (StructuredOutputsParams(regex=r) for r in ("a+", "b+", "c+"))
    first = so.grammar(a)
    assert so.grammar(StructuredOutputsParams(regex="a+")) is first
    so.grammar(b)
    so.grammar(a)  # a is now the most recent: c evicts b
    so.grammar(c)
    assert so.compiles == 3
    assert so.grammar(a) is first
    so.grammar(b)
    assert so.compiles == 4


@pytest.mark.parametrize(
    "params, message",
    [
        ({"json": {"$ref": "#/$defs/missing"}}, "invalid JSON schema"),
        ({"regex": "(unclosed"}, "invalid regex"),
        ({"grammar": "start: undefined_rule"}, "invalid grammar"),
        ({"json": {"$ref": "#"}}, "allows no output"),
        ({"json": {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}}, "no output"),
    ],
)
def test_bad_constraints_are_grammar_errors(structured, params, message):
    with pytest.raises(GrammarError, match=message) as e:
        structured.grammar(StructuredOutputsParams(**params))
    assert e.value.param == "structured_outputs"


def test_the_compiler_refuses_unsupported_keywords_too(structured):
    """A request's schema with a keyword the grammar does not implement is refused when the
    request is validated (kvfleet.engine.schema_keywords); one built past that check still
    meets the compiler's own refusal."""
    with pytest.raises(ValidationError, match=r'unsupported features.*"not"'):
        StructuredOutputsParams(json={"not": {"type": "string"}})
    unchecked = StructuredOutputsParams.model_construct(json={"not": {"type": "string"}})
    with pytest.raises(GrammarError, match=r'unsupported features.*"not"'):
        structured.grammar(unchecked)


def test_hostile_schemas_are_refused_quickly(structured):
    deep: dict = {"type": "string"}
    for _ in range(20000):
        deep = {"type": "object", "properties": {"x": deep}}
    start = time.monotonic()
    with pytest.raises(ValidationError, match=f"deeper than {MAX_SCHEMA_DEPTH}"):
        StructuredOutputsParams(json=deep)
    wide = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(2000)}}
    structured.grammar(StructuredOutputsParams(json=wide))
    assert time.monotonic() - start < 5


def test_compile_off_the_loop_times_out(structured, monkeypatch):
    monkeypatch.setattr(structured, "grammar", lambda params: time.sleep(0.5))
    job = structured.submit(StructuredOutputsParams(regex="a"))
    with pytest.raises(GrammarError, match=r"longer than 0\.05 s"):
        asyncio.run(job.wait(timeout=0.05))


def test_a_wait_for_a_compile_thread_is_not_compile_time(structured, monkeypatch):
    """A burst of new schemas queues for the compile threads; a quick one behind slow ones
    still compiles, since its timeout counts from when a thread takes it up."""
    monkeypatch.setattr(structured, "_compilers", ThreadPoolExecutor(1))
    structured._compilers.submit(time.sleep, 0.5)  # the one thread, busy for 0.5 s
    job = structured.submit(StructuredOutputsParams(regex="ab"))
    assert job.started is None
    compiled = asyncio.run(job.wait(timeout=0.3))
    assert compiled.kind == "regex"


def test_a_cached_constraint_comes_back_without_a_compile_thread(structured, monkeypatch):
    params = StructuredOutputsParams(regex="cached[0-9]")
    first = asyncio.run(structured.submit(params).wait())
    idle = ThreadPoolExecutor(1)
    idle.shutdown()  # any submit now raises
    monkeypatch.setattr(structured, "_compilers", idle)
    hit = structured.submit(params)
    assert hit.future.done() and asyncio.run(hit.wait()) is first
    with pytest.raises(RuntimeError, match="shutdown"):
        structured.submit(StructuredOutputsParams(regex="uncached[0-9]"))
    assert not structured._compiling  # a submit that failed leaves no job behind


def test_one_new_constraint_compiles_once_for_a_burst(structured, monkeypatch):
    """Requests that bring the same new schema at once share its compilation."""
    release = threading.Event()
    real = structured.grammar

    def slow(params):
        release.wait(5)
        return real(params)

    monkeypatch.setattr(structured, "grammar", slow)
    params = StructuredOutputsParams(regex="burst[0-9]")
    jobs = [structured.submit(params) for _ in range(8)]
    assert all(job is jobs[0] for job in jobs) and not jobs[0].future.done()
    release.set()
    compiled = jobs[0].future.result(timeout=5)
    assert structured.submit(params).future.result() is compiled
    assert not structured._compiling


def test_a_failed_compile_is_the_jobs_error(structured):
    job = structured.submit(StructuredOutputsParams(regex="(unclosed"))
    with pytest.raises(GrammarError, match="invalid regex"):
        asyncio.run(job.wait())
    with pytest.raises(GrammarError):
        job.future.result()


# -- masks ------------------------------------------------------------------------------------
def test_bitmask_rows_and_padded_vocabulary(tokenizer):
    vocab = len(tokenizer) + 40  # the model's logits are wider than the tokenizer
    so = StructuredOutputs(tokenizer, vocab, frozenset([tokenizer.eos_token_id]))
    free = _req("free", so, None)
    yes_no = _req("c", so, {"choice": ["yes", "no"]})
    masks = so.masks([free, yes_no])
    assert masks is not None and not masks.failed
    assert _allowed(masks.bitmask[0], vocab) == list(range(vocab))
    allowed = _allowed(masks.bitmask[1], vocab)
    assert allowed and all(t < len(tokenizer) for t in allowed)
    assert tokenizer.eos_token_id not in allowed  # nothing is complete yet
    assert {tokenizer.decode([t])[0] for t in allowed} == {"y", "n"}
    logits = torch.zeros(2, vocab)
    apply_bitmask(logits, masks.bitmask)
    assert torch.isfinite(logits[0]).all()
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == allowed
    assert so.masks([free]) is None


def test_a_failing_matcher_fails_its_row_alone(structured, tokenizer):
    good = _req("good", structured, {"choice": ["yes", "no"]})
    bad = _req("bad", structured, {"choice": ["yes", "no"]})
    bad.grammar.raw.consume_token(tokenizer.encode("zzz", add_special_tokens=False)[0])
    reqs = [good, bad, _req("free", structured, None)]
    masks = structured.masks(reqs)
    assert list(masks.failed) == [1]
    sampler = Sampler(structured.vocab_size, torch.device("cpu"), 0)
    batch = sampler.sample(torch.randn(3, structured.vocab_size), reqs, masks)
    assert list(batch.failed) == [1]
    assert tokenizer.decode([batch.read()[0][0]])[0] in "yn"


# -- through the engine -----------------------------------------------------------------------
def _texts(outs) -> list[str]:
    return [c.text for o in outs for c in o.outputs]


def test_json_schema_choice_regex_and_grammar_outputs_are_valid(llm, prompts):
    cases = [
        (COMPACT, lambda t: jsonschema.validate(json.loads(t), SCHEMA)),
        ({"json_object": True, "disable_any_whitespace": True}, None),
        ({"choice": ["alpha", "beta (b)", "c|d"]}, lambda t: t in ("alpha", "beta (b)", "c|d")),
        ({"regex": "[0-9]{3}-[a-c]{2}"}, lambda t: len(t) == 6 and t[3] == "-"),
        ({"grammar": 'root ::= "go " ("left" | "right")'}, lambda t: t in ("go left", "go right")),
        ({"grammar": 'start: "n=" /[0-9]/'}, lambda t: t.startswith("n=") and len(t) == 3),
    ]
    params = [
        SamplingParams(max_tokens=64, temperature=0.9, seed=i, structured_outputs=so)
        for i, (so, _) in enumerate(cases)
    ]
    outs = llm.generate([{"prompt_token_ids": prompts[1]}] * len(cases), params)
    for (so, check), out in zip(cases, outs, strict=True):
        c = out.outputs[0]
        if check is None:  # json_object: any object, maybe cut by max_tokens on a random model
            assert c.text.startswith("{"), c.text
            continue
        assert c.finish_reason == "stop", (so, c.text)
        assert check(c.text) is not False, (so, c.text)


def test_mixed_batch_n2_seeds_and_logprobs(llm, prompts):
    free = SamplingParams(max_tokens=12, temperature=0)
    alone = llm.generate({"prompt_token_ids": prompts[2]}, free)[0].outputs[0].token_ids
    constrained = SamplingParams(
        max_tokens=64, temperature=1.0, seed=11, n=2, logprobs=3, structured_outputs=COMPACT
    )
    outs = llm.generate(
        [{"prompt_token_ids": prompts[2]}, {"prompt_token_ids": prompts[3]}], [free, constrained]
    )
    assert outs[0].outputs[0].token_ids == alone  # the masks leave free rows alone
    children = outs[1].outputs
    assert len(children) == 2
    for c in children:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.text), SCHEMA)
        # Logprobs are of the raw distribution: its top token need not be allowed.
        assert len(c.logprobs) == len(c.token_ids)
    again = llm.generate({"prompt_token_ids": prompts[3]}, constrained)[0].outputs
    assert [c.token_ids for c in again] == [c.token_ids for c in children]
    raw = (
        llm.generate(
            {"prompt_token_ids": prompts[3]},
            SamplingParams(max_tokens=1, temperature=0, logprobs=3),
        )[0]
        .outputs[0]
        .logprobs[0]
    )
    # {chosen token and top 3: logprob}: the top 3 are the unconstrained model's, same values.
    for token, logprob in raw.items():
        assert children[0].logprobs[0][token] == pytest.approx(logprob, abs=1e-5)


def test_constrained_generation_survives_preemption(llm, model_dirs, prompts):
    sp = SamplingParams(max_tokens=48, temperature=0.9, seed=3, structured_outputs=COMPACT)
    batch = [{"prompt_token_ids": p} for p in prompts[:5]]
    tight = LLM(str(model_dirs["llama"]), dtype="float32", num_gpu_blocks_override=12)
    expected = _texts(llm.generate(batch, sp))
    got = _texts(tight.generate(batch, sp))
    assert tight.engine.stats().num_preemptions > 0
    assert got == expected
    for text in got:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert_no_leak(tight)


def test_grammar_end_finishes_with_stop_even_ignoring_eos(llm, prompts):
    sp = SamplingParams(
        max_tokens=50,
        temperature=1.0,
        seed=2,
        ignore_eos=True,
        structured_outputs={"choice": ["ok"]},
    )
    c = llm.generate({"prompt_token_ids": prompts[0]}, sp)[0].outputs[0]
    assert (c.text, c.finish_reason) == ("ok", "stop")


def test_constraint_with_penalties_min_tokens_stop_and_logit_bias(llm, prompts):
    sp = SamplingParams(
        max_tokens=48,
        temperature=0.7,
        seed=9,
        repetition_penalty=1.5,
        presence_penalty=1.0,
        min_tokens=4,
        stop=["never seen"],
        # +100 on 300 ids: a token the grammar forbids stays forbidden whatever its bias.
        logit_bias={t: 100.0 for t in range(3, 303)},
        structured_outputs=COMPACT,
    )
    c = llm.generate({"prompt_token_ids": prompts[4]}, sp)[0].outputs[0]
    assert c.finish_reason == "stop"
    jsonschema.validate(json.loads(c.text), SCHEMA)


def test_tensor_parallel_samples_under_the_grammar_on_rank_0(llm, model_dirs, prompts):
    sp = SamplingParams(max_tokens=48, temperature=0, structured_outputs=COMPACT)
    batch = [{"prompt_token_ids": p} for p in prompts[:3]]
    one_rank = _texts(llm.generate(batch, sp))
    path = str(model_dirs["llama"])
    with LLM(path, tensor_parallel_size=2, device="cpu", dtype="float32") as two:
        assert two.engine.runner.structured is not None  # rank 0's runner; workers have none
        assert _texts(two.generate(batch, sp)) == one_rank
    for text in one_rank:
        jsonschema.validate(json.loads(text), SCHEMA)


# -- a grammar that compiles while its prompt runs (how the server queues a new schema) -------
def _drain(core) -> dict[str, list]:
    deltas: dict[str, list] = {}
    for _ in range(500):
        if not core.has_unfinished_requests():
            return deltas
        for out in core.step():
            deltas.setdefault(out.request_id, []).append(out)
    raise AssertionError("the engine did not finish")


def _spy_step_backs(core, monkeypatch) -> list[str]:
    backs: list[str] = []
    real = core.scheduler.step_back

    def step_back(req):
        backs.append(req.request_id)
        real(req)

    monkeypatch.setattr(core.scheduler, "step_back", step_back)
    return backs


@pytest.mark.parametrize("ready_after_steps", [1, 3])
def test_a_prompt_prefills_while_its_grammar_compiles(llm, prompts, monkeypatch, ready_after_steps):
    """The server queues a request whose schema is new while it compiles. Done by the time
    the prompt's step samples (the usual case), it costs nothing; later, the request steps
    back and its last position alone waits for it. Either way, the output is the one a
    grammar compiled first gives."""
    sp = SamplingParams(max_tokens=48, temperature=0.9, seed=5, structured_outputs=COMPACT)
    expected = _texts(llm.generate({"prompt_token_ids": prompts[1]}, sp))
    core = llm.engine
    backs = _spy_step_backs(core, monkeypatch)
    compiling: Future = Future()
    core.add_request("late", core.admit(prompts[1], sp, grammar=compiling))
    late = core.scheduler.requests["late#0"]
    for _ in range(ready_after_steps):
        assert core.step() == []
    if ready_after_steps > 1:
        assert backs == ["late#0"] and core.idle
        assert late.num_computed_tokens == len(prompts[1]) - 1 and late.num_output_tokens == 0
    compiling.set_result(core.structured.grammar(sp.structured_outputs))
    deltas = _drain(core)["late"]
    assert deltas[-1].finished and ["".join(c.text for d in deltas for c in d.outputs)] == expected
    assert len(backs) == (ready_after_steps > 1)
    assert_no_leak(llm)


def test_a_grammar_that_fails_once_queued_fails_its_request_alone(llm, prompts):
    greedy = SamplingParams(max_tokens=8, temperature=0)
    alone = llm.generate({"prompt_token_ids": prompts[2]}, greedy)[0].outputs[0].token_ids
    core = llm.engine
    failing: Future = Future()
    sp = SamplingParams(max_tokens=8, n=2, structured_outputs={"regex": "(unclosed"})
    core.add_request("bad", core.admit(prompts[1], sp, grammar=failing))
    core.add_request("free", core.admit(prompts[2], greedy))
    core.step()
    with pytest.raises(GrammarError) as compile_error:
        core.structured.grammar(sp.structured_outputs)
    failing.set_exception(compile_error.value)
    deltas = _drain(core)
    assert len(deltas["bad"]) == 1
    bad = deltas["bad"][0]
    assert bad.finished and bad.error.startswith("structured_outputs failed: invalid regex")
    assert [c.finish_reason for c in bad.outputs] == ["error", "error"]
    assert [t for d in deltas["free"] for c in d.outputs for t in c.token_ids] == alone
    assert_no_leak(llm)


@pytest.mark.asyncio
async def test_the_engine_loop_sleeps_while_every_request_waits_for_its_grammar(llm, prompts):
    steps: list[list] = []
    engine = AsyncEngine(llm.engine, on_step=steps.append)
    engine.start()
    try:
        sp = SamplingParams(max_tokens=48, temperature=0, structured_outputs=COMPACT)
        compiling: Future = Future()
        admitted = llm.engine.admit(prompts[1], sp, grammar=compiling)
        deltas = []

        async def consume():
            async for delta in engine.generate("r", admitted):
                deltas.append(delta)

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.3)
        assert len(steps) < 10  # not a loop that spins until the grammar is done
        compiling.set_result(llm.engine.structured.grammar(sp.structured_outputs))
        async with asyncio.timeout(10):
            await task
        jsonschema.validate(json.loads("".join(c.text for d in deltas for c in d.outputs)), SCHEMA)
    finally:
        await engine.stop()
    assert_no_leak(llm)


def test_json_whitespace_between_tokens_is_bounded_by_default() -> None:
    """A model cannot loop on grammar-legal whitespace: 32 in a row at most, unless the request
    sets its own pattern."""

    tok = llguidance.hf.from_tokenizer(AutoTokenizer.from_pretrained(tiny_model_path()))

    def accepts(params: StructuredOutputsParams, text: str) -> bool:
        m = llguidance.LLMatcher(tok, grammar_spec(params)[1])
        return m.consume_tokens(tok.tokenize_str(text)) and m.is_accepting()

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    default = StructuredOutputsParams(json=schema)
    assert accepts(default, '{\n    "a": 1\n}')
    assert accepts(default, "{" + " " * 32 + '"a":1}')
    assert not accepts(default, "{" + " " * 33 + '"a":1}')
    assert not accepts(StructuredOutputsParams(json_object=True), "{" + "\n" * 40 + "}")
    assert accepts(StructuredOutputsParams(json=schema, whitespace_pattern=r"[ ]*"),
                   "{" + " " * 40 + '"a":1}')  # fmt: skip
    compact = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    assert not accepts(compact, '{ "a":1}')
