"""The grammar sandbox and what the engine does with its answers: a constraint compiles in a
worker first and answers with its memory; a worker that crashes or overruns its deadline costs
that one constraint a GrammarError (a 400) and is replaced, the next constraint served; the cache
is bounded in bytes as measured there; and an engine whose tokenizer the grammar library cannot
read serves without structured outputs, refusing constrained requests with the reason."""

from __future__ import annotations

import asyncio
import signal
import sys
import textwrap
import time

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from kvfleet.engine import grammar_sandbox
from kvfleet.engine.config import EngineArgs
from kvfleet.engine.engine_core import EngineCore
from kvfleet.engine.grammar import GrammarError, tokenizer_json
from kvfleet.engine.grammar_sandbox import GrammarSandbox, SandboxCrash
from kvfleet.engine.request import InvalidRequestError
from kvfleet.engine.sampling_params import SamplingParams, StructuredOutputsParams
from kvfleet.engine.structured_output import StructuredOutputs

# A stand-in worker that speaks the sandbox's protocol and dies as a native crash would: by a
# signal, on the constraint regex "segv"; it hangs on "hang" and answers 1 KiB otherwise.
FAKE_WORKER = textwrap.dedent(
    """
    import json, os, signal, struct, sys, time
    H = struct.Struct("!I")
    def receive():
        header = sys.stdin.buffer.read(4)
        if len(header) < 4:
            sys.exit(0)
        return json.loads(sys.stdin.buffer.read(H.unpack(header)[0]))
    def send(message):
        data = json.dumps(message).encode()
        sys.stdout.buffer.write(H.pack(len(data)) + data)
        sys.stdout.buffer.flush()
    receive()
    send({"ready": True})
    while True:
        regex = receive().get("regex")
        if regex == "segv":
            os.kill(os.getpid(), signal.SIGSEGV)
        if regex == "hang":
            time.sleep(600)
        send({"bytes": 1024})
    """
)


@pytest.fixture(scope="module")
def tokenizer(model_dirs):
    return AutoTokenizer.from_pretrained(model_dirs["llama"])


@pytest.fixture
def fake_workers(tmp_path, monkeypatch):
    script = tmp_path / "fake_worker.py"
    script.write_text(FAKE_WORKER)
    monkeypatch.setattr(grammar_sandbox, "WORKER_COMMAND", [sys.executable, str(script)])


def test_a_worker_compiles_and_measures_what_the_engine_would(tokenizer):
    sandbox = GrammarSandbox(tokenizer_json(tokenizer), len(tokenizer), [2], workers=1)
    try:
        small = sandbox.check(StructuredOutputsParams(regex="[a-z]{1,8}"), 30)
        # An unrolled 20,000-position lexer holds megabytes.
        big = sandbox.check(StructuredOutputsParams(regex="a{20000}"), 30)
        assert 0 <= small < 2 << 20 < 4 << 20 < big
        with pytest.raises(GrammarError, match="invalid regex"):
            sandbox.check(StructuredOutputsParams(regex="(unclosed"), 30)
        with pytest.raises(GrammarError, match="more than 100,000"):
            sandbox.check(StructuredOutputsParams(regex="a{1000000000}"), 30)
        assert sandbox.crashes == 0
    finally:
        sandbox.close()


def test_a_crash_costs_one_constraint_and_the_worker_is_replaced(tokenizer, fake_workers):
    sandbox = GrammarSandbox(tokenizer_json(tokenizer), len(tokenizer), [2], workers=1)
    try:
        first = sandbox._all[0].proc
        with pytest.raises(SandboxCrash, match="crashed on this constraint \\(signal SIGSEGV\\)"):
            sandbox.check(StructuredOutputsParams(regex="segv"), 30)
        assert first.returncode == -signal.SIGSEGV
        assert sandbox.crashes == 1
        assert sandbox.check(StructuredOutputsParams(regex="ok"), 30) == 1024
        assert sandbox._all[0].proc is not first
    finally:
        sandbox.close()


def test_an_overrun_is_killed_and_the_next_constraint_served(tokenizer, fake_workers):
    sandbox = GrammarSandbox(tokenizer_json(tokenizer), len(tokenizer), [2], workers=1)
    try:
        sandbox.check(StructuredOutputsParams(regex="warm"), 30)  # started, tokenizer read
        hung = sandbox._all[0].proc
        started = time.monotonic()
        with pytest.raises(SandboxCrash, match=r"longer than 0\.5 s"):
            sandbox.check(StructuredOutputsParams(regex="hang"), 0.5)
        assert time.monotonic() - started < 3
        assert hung.wait(5) == -signal.SIGKILL
        assert sandbox.check(StructuredOutputsParams(regex="ok"), 30) == 1024
    finally:
        sandbox.close()


def test_a_worker_killed_while_idle_is_not_blamed_on_the_next_constraint(tokenizer):
    sandbox = GrammarSandbox(tokenizer_json(tokenizer), len(tokenizer), [2], workers=1)
    try:
        sandbox._all[0].proc.kill()
        sandbox._all[0].proc.wait()
        assert sandbox.check(StructuredOutputsParams(regex="x+"), 30) >= 0
        assert sandbox.crashes == 0
    finally:
        sandbox.close()


def test_a_crash_in_the_sandbox_fails_the_request_not_the_compiler(tokenizer, fake_workers):
    """Through StructuredOutputs, as the server submits: the crashing constraint's job fails
    with a GrammarError (the server's 400), nothing is cached, and the next one compiles."""
    structured = StructuredOutputs(tokenizer, len(tokenizer), frozenset([2]))
    try:
        with pytest.raises(GrammarError, match="SIGSEGV"):
            asyncio.run(structured.submit(StructuredOutputsParams(regex="segv")).wait())
        ok = asyncio.run(structured.submit(StructuredOutputsParams(regex="[ab]+")).wait())
        assert ok.kind == "regex"
        stats = structured.stats()
        assert (stats.cache_entries, stats.compiles, stats.crashes) == (1, 1, 1)
    finally:
        structured.close()


def test_the_cache_is_bounded_in_bytes(tokenizer):
    big = [StructuredOutputsParams(regex=f"{c}{{20000}}") for c in "xyz"]
    probe = StructuredOutputs(tokenizer, len(tokenizer), frozenset([2]))
    try:
        probe.grammar(big[0])
        size = probe.stats().cache_bytes
    finally:
        probe.close()
    assert size > 4 << 20
    structured = StructuredOutputs(
        tokenizer, len(tokenizer), frozenset([2]), cache_bytes=int(size * 2.5)
    )
    try:
        for params in big:
            structured.grammar(params)
        stats = structured.stats()
        assert stats.cache_entries == 2 and stats.compiles == 3
        assert stats.cache_bytes <= int(size * 2.5)
        structured.grammar(big[2])  # the newest two stay
        assert structured.stats().compiles == 3
        structured.grammar(big[0])  # the oldest went
        assert structured.stats().compiles == 4
    finally:
        structured.close()


def word_level_tokenizer() -> PreTrainedTokenizerFast:
    """A valid HF tokenizer with no decoder (a WordLevel vocabulary, as some research and
    domain models ship), which llguidance refuses."""
    vocab = {"<unk>": 0, "</s>": 1, **{f"w{i}": i + 2 for i in range(510)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="</s>")


def test_an_unreadable_tokenizer_turns_structured_outputs_off_not_the_engine(model_dirs):
    core = EngineCore(
        EngineArgs(model=str(model_dirs["llama"]), dtype="float32"), word_level_tokenizer()
    )
    try:
        assert core.structured is None
        assert "can't determine decoder type" in (core.structured_unavailable or "")
        constrained = SamplingParams(structured_outputs={"regex": "w1"})
        with pytest.raises(InvalidRequestError, match=r"not available.*decoder type") as e:
            core.admit([3, 4, 5], constrained)
        assert e.value.param == "structured_outputs"
        core.admit([3, 4, 5], SamplingParams(max_tokens=4))  # everything else is served
    finally:
        core.close()
