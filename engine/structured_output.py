"""Structured outputs: grammars compiled from a request's `structured_outputs` constraint, each
sequence's matcher, and the batch's token bitmask.

The grammar library is llguidance, chosen by measurement (bench/grammar_libs.py, RESULTS.md):
JSON schemas compile in about a millisecond where xgrammar takes up to seconds and outlines-core
tens of seconds, a mask takes microseconds at a 128k vocabulary, and its resource limits are
deterministic fuel counts rather than a thread to kill.

A compiled grammar is a validated matcher that every sequence copies (copies share the
compiled lexer and grammar); compiled grammars are cached by constraint in a bounded LRU. A
sequence's matcher lives on its Request, so it survives preemption and recompute with the
output tokens it has seen: the sampler advances it exactly once per sampled token.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import llguidance
import llguidance.gbnf_to_lark
import llguidance.hf
import numpy as np
import torch

from kvfleet.engine.host_cpus import usable_cpus
from kvfleet.engine.request import InvalidRequestError, Request
from kvfleet.engine.sampling_params import StructuredOutputsParams, TagStructure
from kvfleet.kernels import reference
from kvfleet.kernels.availability import triton_available

logger = logging.getLogger(__name__)

# Compiled grammars kept; a hit costs a dict lookup and a matcher copy.
GRAMMAR_CACHE_SIZE = 256
# Wall-clock bound on one compilation, counted from when a compile thread takes it up (the fuel
# limits below bound the work itself, so a thread left behind by a timeout still ends).
COMPILE_TIMEOUT_S = 10.0
# Threads that compile grammars; their own pool, so compilations neither queue behind other
# blocking work nor, in a burst of new schemas, count their wait for a thread as compile time.
COMPILE_THREADS = 4
# llguidance's defaults, tightened where a hostile request could make one step slow: the mask
# of one step (step_lexer_fuel, step_max_items) must stay far below a decode step's time.
_LIMITS = dict(
    max_items_in_row=2000,
    initial_lexer_fuel=1_000_000,
    step_lexer_fuel=200_000,
    step_max_items=50_000,
    max_lexer_states=100_000,
    max_grammar_size=200_000,
    verbose_errors=False,
)
_ALL_ALLOWED = -1  # an int32 bitmask word with every bit set


def mask_threads(cpus: int) -> int:
    """Threads that compute a step's bitmasks: a quarter of the usable CPUs, 1 to 8.
    llguidance's default, 80% of the cores, was no faster on an H100 host of 16 (32 rows under
    a JSON schema, 128k vocabulary, bench/profile_step.py: a step's masks took 0.78-1.02 ms at
    p50 with its 12 threads, 0.57-0.77 ms with 4, 0.85 ms with 1), and in a pod with a CPU
    limit it would size itself by cores the quota does not let it use."""
    return max(1, min(8, cpus // 4))


class GrammarError(InvalidRequestError):
    """A constraint that cannot be compiled: invalid, unsupported, or beyond the limits."""


def _close_objects(schema: Any) -> Any:
    """The schema with additionalProperties false wherever an object schema does not set it
    (disable_additional_properties). StructuredOutputsParams bounds its depth."""
    if isinstance(schema, list):
        return [_close_objects(v) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _close_objects(v) for k, v in schema.items()}
    is_object = out.get("type") == "object" or "properties" in out
    if is_object and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


_REGEX_META = set("\\.+*?()|[]{}^$#&-~")


def _regex_literal(text: str) -> str:
    return "".join("\\" + ch if ch in _REGEX_META else ch for ch in text)


# The whitespace JSON may have between two tokens unless the request says otherwise: enough for
# pretty-printing (a newline and indentation), bounded, because a grammar that allows unbounded
# whitespace lets a model spend its whole budget on it and return truncated JSON (a failure
# vLLM users meet with any-whitespace JSON grammars, and what a random-weight model always does).
DEFAULT_WHITESPACE_PATTERN = r"[\x20\x0A\x0D\x09]{0,32}"


def _json_options(params: StructuredOutputsParams) -> dict[str, Any]:
    if params.disable_any_whitespace:
        return {"whitespace_flexible": False}
    return {
        "whitespace_flexible": True,
        "whitespace_pattern": params.whitespace_pattern or DEFAULT_WHITESPACE_PATTERN,
    }


def _special_token(tokenizer: Any, text: str) -> int | None:
    """The id of the special token spelled `text`, if the tokenizer has one."""
    if tokenizer is None or not text:
        return None
    ids = tokenizer.tokenize_str(text)
    return ids[0] if len(ids) == 1 and tokenizer.is_special_token(ids[0]) else None


def _lark_literal(tokenizer: Any, text: str) -> str:
    """Lark for literal text; a special token of the model is that token, which the model emits
    as one id, never as the text that spells it."""
    special = _special_token(tokenizer, text)
    return json.dumps(text) if special is None else f"<[{special}]>"


def _structure_schema(params: StructuredOutputsParams, structure: TagStructure) -> dict[str, Any]:
    """A structural tag's structure's schema as compiled: any JSON object when it gives none,
    under the request's JSON options (whitespace, closed objects) unless the schema's own
    x-guidance sets them."""
    schema = structure.tag_schema if structure.tag_schema is not None else {"type": "object"}
    if params.disable_additional_properties:
        schema = _close_objects(schema)
    own = schema.get("x-guidance", {})
    options = _json_options(params)
    return {**schema, "x-guidance": {**options, **own} if isinstance(own, dict) else own}


def _structural_tag_lark(params: StructuredOutputsParams, tokenizer: Any) -> str:
    """The Lark grammar of a structural tag: free text in which each text trigger is a lazy
    lexeme (it matches where the text first holds it, so the text cannot hold it and go on
    freely) and each special-token trigger that token, followed by one of the structures it
    opens: the rest of its begin, its JSON, its end; then free text again. Structures that
    share a trigger share its lexeme and the model picks among them after it. (llguidance's
    StructTag makes a lexeme per structure and takes any <...> trigger for a special token,
    which SmolLM2's <tool_call>, say, is not: a grammar that does not compile.)"""
    tag = params.structural_tag
    assert tag is not None
    bodies: dict[str, list[str]] = {}
    for structure in tag.structures:
        trigger = tag.trigger_of(structure)
        assert trigger is not None  # StructuralTag checks that every begin has one
        parts = [_lark_literal(tokenizer, structure.begin[len(trigger) :])]
        parts.append(f"%json {json.dumps(_structure_schema(params, structure))}")
        parts.append(_lark_literal(tokenizer, structure.end))
        bodies.setdefault(trigger, []).append(" ".join(p for p in parts if p != '""'))
    names = [f"tag_{i}" for i in range(len(bodies))]
    lines = ["%llguidance {}", f"start: ({' | '.join(names)})* TEXT", r"TEXT: /(.|\n)*/"]
    for name, (trigger, alternatives) in zip(names, bodies.items(), strict=True):
        opened = " | ".join(alternatives)
        if _special_token(tokenizer, trigger) is not None:
            lines.append(f"{name}: TEXT {_lark_literal(tokenizer, trigger)} ({opened})")
        else:
            lines.append(f"{name}_trigger[lazy]: TEXT {json.dumps(trigger)}")
            lines.append(f"{name}: {name}_trigger ({opened})")
    return "\n".join(lines)


def grammar_spec(params: StructuredOutputsParams, tokenizer: Any = None) -> tuple[str, str]:
    """(kind, llguidance grammar) for a constraint; GrammarError for one refused before
    compiling. `tokenizer` (an llguidance one) tells which structural-tag triggers are special
    tokens; without it every trigger is text."""
    if params.json is not None:
        schema = params.json
        if params.disable_additional_properties:
            schema = _close_objects(schema)
        return "json", llguidance.LLMatcher.grammar_from_json_schema(
            schema, defaults=_json_options(params)
        )
    if params.json_object:
        return "json_object", llguidance.LLMatcher.grammar_from_json_schema(
            {"type": "object"}, defaults=_json_options(params)
        )
    if params.regex is not None:
        return "regex", llguidance.LLMatcher.grammar_from_regex(params.regex)
    if params.choice is not None:
        alternatives = "|".join(f"({_regex_literal(c)})" for c in params.choice)
        return "choice", llguidance.LLMatcher.grammar_from_regex(alternatives)
    if params.structural_tag is not None:
        return "structural_tag", llguidance.LLMatcher.grammar_from_lark(
            _structural_tag_lark(params, tokenizer)
        )
    assert params.grammar is not None  # StructuredOutputsParams holds exactly one constraint
    try:
        lark = llguidance.gbnf_to_lark.any_to_lark(params.grammar)
    except Exception as e:  # the converter raises its own error types for malformed GBNF
        raise GrammarError(f"invalid grammar: {e}", "structured_outputs") from None
    return "grammar", llguidance.LLMatcher.grammar_from_lark(lark)


class GrammarMatcher:
    """One sequence's position in its grammar."""

    __slots__ = ("_matcher",)

    def __init__(self, matcher: Any) -> None:
        self._matcher = matcher

    def accept(self, token_id: int) -> None:
        """Advance past a sampled token; ValueError if the grammar does not allow it."""
        if not self._matcher.consume_token(token_id) or self._matcher.is_error():
            raise ValueError(f"the grammar refused token {token_id}: {self.error}")

    @property
    def terminated(self) -> bool:
        """The grammar is complete and allows no further token."""
        return bool(self._matcher.is_stopped())

    @property
    def error(self) -> str | None:
        return self._matcher.get_error() if self._matcher.is_error() else None

    @property
    def raw(self) -> Any:
        return self._matcher


class CompiledGrammar:
    """A validated grammar; matcher() starts a sequence at its beginning."""

    __slots__ = ("_prototype", "kind")

    def __init__(self, kind: str, prototype: Any) -> None:
        self.kind = kind
        self._prototype = prototype

    def matcher(self) -> GrammarMatcher:
        return GrammarMatcher(self._prototype.deep_copy())


def _cache_key(params: StructuredOutputsParams) -> str:
    return json.dumps(params.model_dump(exclude_defaults=True), sort_keys=True)


class GrammarJob:
    """A constraint's compilation in a compile thread. The engine may queue the request before
    it is done: the prompt prefills meanwhile and only its first sampled token waits (the
    scheduler polls `future`). The server awaits wait() for the outcome, its 400 included."""

    __slots__ = ("future", "started")

    def __init__(self) -> None:
        self.future: Future[CompiledGrammar] = Future()
        self.started: float | None = None  # time.monotonic() when a compile thread took it up

    @classmethod
    def done(cls, compiled: CompiledGrammar) -> GrammarJob:
        job = cls()
        job.future.set_result(compiled)
        job.started = time.monotonic()
        return job

    async def wait(self, timeout: float = COMPILE_TIMEOUT_S) -> CompiledGrammar:
        """The compiled grammar, or GrammarError: the constraint's own, or a timeout counted
        from when a compile thread took the job up (a wait for a free thread, in a burst of new
        schemas, is not held against the request)."""
        if self.future.done():
            return self.future.result()
        outcome = asyncio.wrap_future(self.future)
        # Read, so that a failure after this waiter has gone (timed out, cancelled) is not
        # logged as an exception nobody retrieved.
        outcome.add_done_callback(lambda f: f.cancelled() or f.exception())
        while True:
            started = self.started
            left = timeout if started is None else started + timeout - time.monotonic()
            if left <= 0:
                raise GrammarError(
                    f"the constraint took longer than {timeout:g} s to compile: simplify it",
                    "structured_outputs",
                )
            done, _ = await asyncio.wait([outcome], timeout=left)
            if done:
                return outcome.result()


class StructuredOutputs:
    """The engine's grammar compiler and cache, for one tokenizer and vocabulary."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: frozenset[int],
        cache_size: int = GRAMMAR_CACHE_SIZE,
    ) -> None:
        # The logits may be wider than the tokenizer (a padded vocabulary) or, rarely, narrower:
        # the masks cover both, and ids without a token are never allowed.
        self.mask_vocab = max(vocab_size, len(tokenizer))
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.tokenizer = llguidance.hf.from_tokenizer(
            tokenizer, n_vocab=self.mask_vocab, eos_token=sorted(eos_token_ids) or None
        )
        self.limits = llguidance.LLParserLimits(**_LIMITS)
        self.cache_size = cache_size
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self._compilers = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="grammar")
        self._compiling: dict[str, GrammarJob] = {}
        self.executor = llguidance.LLExecutor(num_threads=mask_threads(usable_cpus()))
        self.compiles = 0  # cache misses, for tests and metrics
        self._buffer: torch.Tensor | None = None

    def grammar(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """The compiled grammar of a constraint, from the cache or compiled now (blocking, in
        the caller's thread; bounded by the parser limits). GrammarError for a bad one."""
        key = _cache_key(params)
        hit = self._lookup(key)
        if hit is not None:
            return hit
        try:
            kind, spec = grammar_spec(params, self.tokenizer)
            if params.structural_tag is not None:
                self._check_structures(params)
        except GrammarError:
            raise
        except ValueError as e:  # llguidance's own check of what it is handed
            raise GrammarError(str(e) or "invalid constraint", "structured_outputs") from None
        compiled = CompiledGrammar(kind, self._matcher(kind, spec))
        with self._lock:
            self.compiles += 1
            self._cache[key] = compiled
            self._cache.move_to_end(key)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _lookup(self, key: str) -> CompiledGrammar | None:
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
            return hit

    def _check_structures(self, params: StructuredOutputsParams) -> None:
        """Each distinct schema of a structural tag compiled alone, so that a bad one is an
        error that names its structure, and one that no JSON satisfies is refused: the tag's
        grammar would compile (its free text allows output), but the structure, once
        triggered, could never end."""
        tag = params.structural_tag
        assert tag is not None
        seen: set[str] = set()
        for i, structure in enumerate(tag.structures):
            schema = _structure_schema(params, structure)
            key = json.dumps(schema, sort_keys=True)
            if key in seen:
                continue
            seen.add(key)
            where = f"structures[{i}].schema: "
            try:
                spec = llguidance.LLMatcher.grammar_from_json_schema(schema)
            except ValueError as e:
                raise GrammarError(f"{where}{e}", "structured_outputs") from None
            self._matcher("json", spec, where)

    def _matcher(self, kind: str, spec: str, where: str = "") -> Any:
        """A matcher at the start of a grammar; GrammarError (its message after `where`) when
        the grammar is in error or no output satisfies it."""
        # The constructor validates and builds the lexer, without the GIL.
        matcher = llguidance.LLMatcher(self.tokenizer, spec, log_level=0, limits=self.limits)
        if matcher.is_error():
            raise GrammarError(where + _explain(kind, matcher.get_error()), "structured_outputs")
        if not self._can_start(matcher):
            # A schema that only refers to itself, say: it compiles, but no output satisfies it.
            raise GrammarError(
                f"{where}the {_KIND_NAMES[kind]} allows no output at all", "structured_outputs"
            )
        return matcher

    def _can_start(self, matcher: Any) -> bool:
        """Whether some output satisfies the grammar: a first token other than EOS is allowed,
        or the empty output is complete. Computing this first mask also warms the lexer."""
        mask = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8).copy()
        for eos in self.eos_token_ids:
            mask[eos // 8] &= ~(1 << (eos % 8)) & 0xFF
        return bool(mask.any()) or bool(matcher.is_accepting())

    def submit(self, params: StructuredOutputsParams) -> GrammarJob:
        """Start compiling a constraint in a compile thread: a job already done for a cached one,
        the job in progress when the same constraint is compiling for another request (a burst
        of one new schema compiles it once)."""
        key = _cache_key(params)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return GrammarJob.done(hit)
            job = self._compiling.get(key)
            if job is not None:
                return job
            job = self._compiling[key] = GrammarJob()
        try:
            self._compilers.submit(self._run, key, job, params)
        except BaseException:
            self._forget(key)
            raise
        return job

    def _run(self, key: str, job: GrammarJob, params: StructuredOutputsParams) -> None:
        job.started = time.monotonic()
        try:
            compiled = self.grammar(params)  # cached before the job leaves _compiling
        except BaseException as e:  # the request fails with it, never the compile thread
            self._forget(key)
            job.future.set_exception(e)
        else:
            self._forget(key)
            job.future.set_result(compiled)

    def _forget(self, key: str) -> None:
        with self._lock:
            del self._compiling[key]

    def masks(self, reqs: list[Request]) -> GrammarMasks | None:
        """The allowed-token bitmask of every row of a batch (int32, bit t of a row: token t
        allowed; every bit set for a row without a grammar), the constrained rows computed in
        parallel off the GIL; None when no row has a grammar. Rows whose matcher is in error
        fail alone. The buffer is reused by the next call: the sampler copies it first."""
        if all(req.grammar is None for req in reqs):
            return None
        width = (self.mask_vocab + 31) // 32
        if self._buffer is None or self._buffer.shape[0] < len(reqs):
            # Pinned, so the copy to the GPU is asynchronous.
            self._buffer = torch.empty(
                (max(len(reqs), 64), width),
                dtype=torch.int32,
                pin_memory=torch.cuda.is_available(),
            )
        view = self._buffer[: len(reqs)]
        # numpy's fill: no trip through torch's intra-op thread pool for a few kilobytes.
        view.numpy().fill(_ALL_ALLOWED)
        failed: dict[int, Exception] = {}
        rows: list[tuple[Any, int]] = []
        for i, req in enumerate(reqs):
            m = req.grammar
            if m is None:
                continue
            if m.error is not None:
                failed[i] = ValueError(f"grammar: {m.error}")
                continue
            rows.append((m.raw, i))
        if rows:
            # The executor writes each listed row of the contiguous int32 buffer in parallel.
            # (llguidance.torch wraps this same call, but importing it imports torch.compile and
            # with it Triton, seconds of start-up and a Triton not in interpreter mode on CPUs.)
            assert view.dtype == torch.int32 and view.is_contiguous() and not view.is_cuda
            self.executor.unsafe_compute_mask_ptr(
                rows, view.data_ptr(), view.shape[1] * 4, view.shape[0]
            )
        return GrammarMasks(view, failed)


@dataclass
class GrammarMasks:
    """A batch's token bitmask (on the CPU) and the rows that failed to compute theirs."""

    bitmask: torch.Tensor
    failed: dict[int, Exception]


_KIND_NAMES = {
    "json": "JSON schema",
    "json_object": "JSON object",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
    "structural_tag": "structural tag",
}


def _explain(kind: str, error: str) -> str:
    first = error.strip().splitlines()[0] if error.strip() else "unknown error"
    if kind in ("json", "json_object"):
        if "Unimplemented keys" in first:
            return f"the JSON schema uses unsupported features: {first}"
        return f"invalid JSON schema: {first}"
    if kind == "grammar":
        return f"invalid grammar: {first}"
    return f"invalid {_KIND_NAMES[kind]}: {first}"


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Ban, in one step for the whole batch, every token whose bit is clear: logits
    [rows, vocab], bitmask int32 [rows, >= vocab / 32] on the logits' device."""
    if logits.is_cuda and triton_available():
        # Imported here: the engine imports no Triton on the CPU.
        from kvfleet.kernels.grammar_mask import apply_token_bitmask

        apply_token_bitmask(logits, bitmask)
    else:
        reference.apply_token_bitmask(logits, bitmask)
