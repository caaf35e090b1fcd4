"""Which grammar library the engine's structured outputs use: llguidance, xgrammar and
outlines-core measured on this workload, on the CPU (the mask is CPU work on the GPU machine too).

For each library and tokenizer (the real default model's 49k vocabulary, a 128k Llama-3
vocabulary): the one-time tokenizer setup, the compile time of a typical and a nested JSON
schema (and of regex, choice and JSON-object constraints), the time to compute one token
bitmask while following a valid output token by token, which JSON-schema features compile, and
what hostile schemas (deep nesting, huge, exponential regexes) cost. Each hostile compile runs in
a forked child under a time limit, with its peak memory read back from the kernel::

    python bench/grammar_libs.py                      # both tokenizers, all three libraries
    python bench/grammar_libs.py --libs llguidance --hostile-timeout 5

llguidance is kvfleet's dependency; the others are for this comparison only
(`pip install xgrammar outlines-core`). The Llama-3 tokenizer is bench/dummy_tokenizer.py's for
bench/models/Llama-3.1-8B (128256 ids), built into a temporary directory when --llama3-dir is
not given.
"""

from __future__ import annotations

import abc
import argparse
import json
import logging
import os
import pickle
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger("bench.grammar_libs")

TYPICAL = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.[a-z]{2,3}$"},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "email", "role", "tags", "active"],
    "additionalProperties": False,
}
TYPICAL_VALUE = {
    "name": "Alice Smith",
    "age": 42,
    "email": "alice@example.com",
    "role": "admin",
    "tags": ["ops", "kubernetes", "on-call"],
    "active": True,
}

NESTED = {
    "$defs": {
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string", "maxLength": 64},
                "city": {"type": "string"},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["street", "city", "zip"],
            "additionalProperties": False,
        },
        "person": {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "age": {"anyOf": [{"type": "integer", "minimum": 0}, {"type": "null"}]},
                "addresses": {"type": "array", "items": {"$ref": "#/$defs/address"}},
            },
            "required": ["name", "age", "addresses"],
            "additionalProperties": False,
        },
    },
    "type": "object",
    "properties": {
        "team": {"type": "string"},
        "lead": {"$ref": "#/$defs/person"},
        "members": {"type": "array", "items": {"$ref": "#/$defs/person"}, "minItems": 1},
        "budget": {"type": "number", "exclusiveMinimum": 0},
    },
    "required": ["team", "lead", "members", "budget"],
    "additionalProperties": False,
}
_PERSON = {
    "name": "Bob",
    "age": None,
    "addresses": [{"street": "1 Main St", "city": "Springfield", "zip": "12345"}],
}
NESTED_VALUE = {"team": "platform", "lead": _PERSON, "members": [_PERSON, _PERSON], "budget": 1.5}

# One schema a feature, to see which each library compiles (or refuses, or ignores).
FEATURES: dict[str, dict[str, Any]] = {
    "$ref": {"$defs": {"a": {"type": "integer"}}, "$ref": "#/$defs/a"},
    "recursive $ref": {
        "$defs": {
            "node": {
                "type": "object",
                "properties": {"children": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
            }
        },
        "$ref": "#/$defs/node",
    },
    "anyOf": {"anyOf": [{"type": "string"}, {"type": "integer"}]},
    "oneOf": {"oneOf": [{"type": "string"}, {"type": "integer"}]},
    "allOf": {"allOf": [{"type": "object"}, {"required": ["a"]}]},
    "enum": {"enum": ["red", "green", 3]},
    "const": {"const": "fixed"},
    "min/max": {"type": "integer", "minimum": 3, "maximum": 10},
    "exclusiveMinimum": {"type": "number", "exclusiveMinimum": 0},
    "multipleOf": {"type": "integer", "multipleOf": 5},
    "min/maxLength": {"type": "string", "minLength": 2, "maxLength": 8},
    "pattern": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]+$"},
    "format date-time": {"type": "string", "format": "date-time"},
    "format email": {"type": "string", "format": "email"},
    "additionalProperties false": {
        "type": "object",
        "properties": {"a": {"type": "string"}},
        "additionalProperties": False,
    },
    "additionalProperties schema": {"type": "object", "additionalProperties": {"type": "integer"}},
    "patternProperties": {"type": "object", "patternProperties": {"^x-": {"type": "string"}}},
    "min/maxItems": {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3},
    "uniqueItems": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
    "prefixItems": {"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}]},
    "not": {"not": {"type": "string"}},
    "if/then/else": {"if": {"type": "string"}, "then": {"minLength": 1}, "else": {"type": "null"}},
}


def _deep(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"x": schema}, "required": ["x"]}
    return schema


HOSTILE: dict[str, Callable[[], tuple[str, Any]]] = {
    "nested 1000 levels": lambda: ("json", _deep(1000)),
    "nested 20000 levels": lambda: ("json", _deep(20000)),
    "10000 properties": lambda: (
        "json",
        {
            "type": "object",
            "properties": {f"p{i}": {"type": "string"} for i in range(10000)},
            "required": [f"p{i}" for i in range(10000)],
        },
    ),
    "anyOf of 2000": lambda: ("json", {"anyOf": [{"const": f"v{i}"} for i in range(2000)]}),
    "regex (a|aa)*b x30": lambda: ("regex", "((a|aa)*b){30}"),
    "regex .{0,100000}": lambda: ("regex", "[a-z]{0,100000}"),
    "string maxLength 10^6": lambda: ("json", {"type": "string", "maxLength": 1000000}),
    "invalid $ref": lambda: ("json", {"$ref": "#/$defs/missing"}),
}


class Library(abc.ABC):
    """One grammar library behind the same few calls."""

    name = ""

    def __init__(self, hf_tokenizer: Any, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    @abc.abstractmethod
    def compile(self, kind: str, spec: Any) -> Any: ...

    @abc.abstractmethod
    def matcher(self, compiled: Any) -> Any: ...

    def new_bitmask(self) -> torch.Tensor:
        return torch.zeros((1, (self.vocab_size + 31) // 32), dtype=torch.int32)

    @abc.abstractmethod
    def fill(self, matcher: Any, bitmask: torch.Tensor) -> None: ...

    @abc.abstractmethod
    def consume(self, matcher: Any, token: int) -> bool: ...


class LLGuidance(Library):
    name = "llguidance"

    def __init__(self, hf_tokenizer: Any, vocab_size: int) -> None:
        super().__init__(hf_tokenizer, vocab_size)
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.ll = llguidance
        self.llt = llguidance.torch
        self.tok = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size)

    def compile(self, kind: str, spec: Any) -> Any:
        m = self.ll.LLMatcher
        if kind == "json":
            grammar = m.grammar_from_json_schema(spec, defaults={"whitespace_flexible": False})
        elif kind == "json_object":
            grammar = m.grammar_from_json_schema({"type": "object"})
        elif kind == "regex":
            grammar = m.grammar_from_regex(spec)
        else:
            grammar = m.grammar_from_regex("|".join(_re_escape(c) for c in spec))
        matcher = m(self.tok, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return grammar

    def matcher(self, compiled: Any) -> Any:
        return self.ll.LLMatcher(self.tok, compiled, log_level=0)

    def fill(self, matcher: Any, bitmask: torch.Tensor) -> None:
        self.llt.fill_next_token_bitmask(matcher, bitmask, 0)

    def consume(self, matcher: Any, token: int) -> bool:
        return matcher.consume_token(token) and not matcher.is_error()


class XGrammar(Library):
    name = "xgrammar"

    def __init__(self, hf_tokenizer: Any, vocab_size: int) -> None:
        super().__init__(hf_tokenizer, vocab_size)
        import xgrammar

        self.xgr = xgrammar
        self.info = xgrammar.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size)
        # Caching off: every compile is measured cold, as for a new schema.
        self.compiler = xgrammar.GrammarCompiler(self.info, max_threads=2, cache_enabled=False)

    def compile(self, kind: str, spec: Any) -> Any:
        c = self.compiler
        if kind == "json":
            return c.compile_json_schema(
                json.dumps(spec), any_whitespace=False, separators=(",", ":")
            )
        if kind == "json_object":
            return c.compile_builtin_json_grammar()
        if kind == "regex":
            return c.compile_regex(spec)
        return c.compile_regex("|".join(_re_escape(s) for s in spec))

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matcher: Any, bitmask: torch.Tensor) -> None:
        matcher.fill_next_token_bitmask(bitmask, 0)

    def consume(self, matcher: Any, token: int) -> bool:
        return matcher.accept_token(token)


def _byte_decoder() -> dict[str, int]:
    # GPT-2's byte-level alphabet: printable bytes stand for themselves, the rest are shifted
    # to code points from 256 up.
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


class OutlinesCore(Library):
    name = "outlines-core"

    def __init__(self, hf_tokenizer: Any, vocab_size: int) -> None:
        super().__init__(hf_tokenizer, vocab_size)
        import outlines_core
        from outlines_core.json_schema import build_regex_from_schema

        self.oc = outlines_core
        self.schema_regex = build_regex_from_schema
        decoder = _byte_decoder()
        special = set(hf_tokenizer.all_special_ids)
        vocab: dict[bytes, list[int]] = {}
        for token, i in hf_tokenizer.get_vocab().items():
            if i in special or i >= vocab_size:
                continue
            try:
                key = bytes(decoder[ch] for ch in token)
            except KeyError:
                key = token.encode()
            vocab.setdefault(key, []).append(i)
        self.eos = hf_tokenizer.eos_token_id
        self.vocab = outlines_core.Vocabulary(self.eos, vocab)

    def compile(self, kind: str, spec: Any) -> Any:
        if kind == "json":
            regex = self.schema_regex(json.dumps(spec))
        elif kind == "json_object":
            raise ValueError("outlines-core has no any-JSON-object grammar (regular languages)")
        elif kind == "regex":
            regex = spec
        else:
            regex = "|".join(_re_escape(s) for s in spec)
        return self.oc.Index(regex, self.vocab)

    def matcher(self, compiled: Any) -> Any:
        return self.oc.Guide(compiled)

    def fill(self, matcher: Any, bitmask: torch.Tensor) -> None:
        matcher.write_mask_into(bitmask.data_ptr(), bitmask.numel(), bitmask.element_size())

    def consume(self, matcher: Any, token: int) -> bool:
        matcher.advance(token)
        return True


LIBRARIES: dict[str, type[Library]] = {c.name: c for c in (LLGuidance, XGrammar, OutlinesCore)}


def _re_escape(text: str) -> str:
    return "".join("\\" + ch if ch in ".^$*+?()[]{}|\\/" else ch for ch in text)


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def _mask_times(lib: Library, compiled: Any, tokens: list[int]) -> list[float]:
    """Seconds per bitmask while following `tokens`, a valid output, one token at a time."""
    matcher = lib.matcher(compiled)
    bitmask = lib.new_bitmask()
    times = []
    for token in tokens:
        t = time.perf_counter()
        lib.fill(matcher, bitmask)
        times.append(time.perf_counter() - t)
        allowed = bool((bitmask[0, token // 32] >> (token % 32)) & 1)
        if not allowed or not lib.consume(matcher, token):
            raise RuntimeError(f"{lib.name} refused token {token} of a valid output")
    return times


def _in_child(timeout: float, fn: Callable[[], str]) -> tuple[str, float, float]:
    """fn() in a forked child: (its result or what stopped it, seconds, peak RSS in MiB)."""
    read_fd, write_fd = os.pipe()
    start = time.perf_counter()
    pid = os.fork()
    if pid == 0:
        os.close(read_fd)
        try:
            result = fn()
        except BaseException as e:
            result = f"error: {str(e).splitlines()[0][:100] if str(e) else type(e).__name__}"
        os.write(write_fd, pickle.dumps(result))
        os._exit(0)
    os.close(write_fd)
    deadline = start + timeout
    status = None
    while time.perf_counter() < deadline:
        wpid, status, usage = os.wait4(pid, os.WNOHANG)
        if wpid:
            break
        time.sleep(0.005)
    else:
        os.kill(pid, signal.SIGKILL)
        _, status, usage = os.wait4(pid, 0)
        os.close(read_fd)
        return f"killed after {timeout:g} s", time.perf_counter() - start, usage.ru_maxrss / 1024
    elapsed = time.perf_counter() - start
    with os.fdopen(read_fd, "rb") as f:
        data = f.read()
    result = pickle.loads(data) if data else f"died (status {status})"
    return result, elapsed, usage.ru_maxrss / 1024


def bench_tokenizer(
    label: str, hf_tokenizer: Any, vocab_size: int, libs: list[str], hostile_timeout: float
) -> dict[str, Any]:
    results: dict[str, Any] = {}
    typical_tokens = hf_tokenizer.encode(
        json.dumps(TYPICAL_VALUE, separators=(",", ":")), add_special_tokens=False
    )
    nested_tokens = hf_tokenizer.encode(
        json.dumps(NESTED_VALUE, separators=(",", ":")), add_special_tokens=False
    )
    for name in libs:
        r: dict[str, Any] = {}
        r["tokenizer_setup_s"], lib = _timed(lambda n=name: LIBRARIES[n](hf_tokenizer, vocab_size))
        compiled = {}
        for case, kind, spec in (
            ("typical schema", "json", TYPICAL),
            ("nested schema", "json", NESTED),
            ("json_object", "json_object", None),
            ("regex", "regex", "[0-9]{3}-[0-9]{3}-[0-9]{4}"),
            ("choice", "choice", ["positive", "negative", "neutral"]),
        ):
            try:
                r[f"compile {case} ms"], compiled[case] = _timed(
                    lambda lib=lib, k=kind, s=spec: lib.compile(k, s)
                )
                r[f"compile {case} ms"] *= 1000
            except Exception as e:
                r[f"compile {case} ms"] = f"error: {str(e)[:80]}"
        for case, tokens in (("typical schema", typical_tokens), ("nested schema", nested_tokens)):
            if case not in compiled:
                continue
            try:
                times = _mask_times(lib, compiled[case], tokens)
                r[f"mask {case} us (median/p99/max)"] = (
                    f"{statistics.median(times) * 1e6:.0f}/"
                    f"{sorted(times)[int(len(times) * 0.99)] * 1e6:.0f}/{max(times) * 1e6:.0f}"
                )
            except Exception as e:
                r[f"mask {case} us (median/p99/max)"] = f"error: {str(e)[:80]}"
        features = {}
        for feature, schema in FEATURES.items():
            try:
                lib.compile("json", schema)
                features[feature] = "ok"
            except Exception as e:
                features[feature] = f"refused: {str(e).splitlines()[0][:60]}"
        r["features"] = features
        hostile = {}
        for case, make in HOSTILE.items():

            def attempt(lib: Library = lib, make: Callable[[], tuple[str, Any]] = make) -> str:
                kind, spec = make()
                lib.compile(kind, spec)
                return "compiled"

            result, seconds, rss = _in_child(hostile_timeout, attempt)
            hostile[case] = f"{result} ({seconds:.2f} s, peak RSS {rss:.0f} MiB)"
        r["hostile"] = hostile
        results[name] = r
        logger.info("%s %s: %s", label, name, json.dumps(r, indent=1))
    return results


def engine_batch_masks(hf_tokenizer: Any, vocab_size: int, rows: int) -> dict[str, str]:
    """The engine's own per-step cost (kvfleet's StructuredOutputs.masks, llguidance's parallel
    executor) for `rows` sequences under the typical schema, each following the valid output,
    and the bitmask's application to logits on the CPU."""
    from kvfleet.engine.request import Request
    from kvfleet.engine.sampling_params import SamplingParams, StructuredOutputsParams
    from kvfleet.engine.structured_output import StructuredOutputs, apply_bitmask

    eos = frozenset([hf_tokenizer.eos_token_id])
    so = StructuredOutputs(hf_tokenizer, vocab_size, eos)
    params = StructuredOutputsParams(json=TYPICAL, disable_any_whitespace=True)
    first = _timed(lambda: so.grammar(params))[0]
    cached = _timed(lambda: so.grammar(params))[0]
    grammar = so.grammar(params)
    reqs = [
        Request(f"r{i}", [1], SamplingParams(), eos, max_tokens=16, grammar=grammar)
        for i in range(rows)
    ]
    tokens = hf_tokenizer.encode(
        json.dumps(TYPICAL_VALUE, separators=(",", ":")), add_special_tokens=False
    )
    logits = torch.zeros(rows, vocab_size)
    fill, apply = [], []
    for token in tokens:
        seconds, masks = _timed(lambda: so.masks(reqs))
        fill.append(seconds)
        apply.append(_timed(lambda m=masks: apply_bitmask(logits, m.bitmask))[0])
        for req in reqs:
            req.grammar.accept(token)
    return {
        "compile (new schema) ms": f"{first * 1e3:.2f}",
        "compile (cached) us": f"{cached * 1e6:.0f}",
        f"masks() for {rows} rows, us per step (median/max)": (
            f"{statistics.median(fill) * 1e6:.0f}/{max(fill) * 1e6:.0f}"
        ),
        f"apply_bitmask on CPU, {rows} rows, us (median)": f"{statistics.median(apply) * 1e6:.0f}",
    }


def _llama3_tokenizer(path: Path | None) -> tuple[Any, int]:
    from transformers import AutoTokenizer

    if path is None:
        path = Path(tempfile.mkdtemp(prefix="llama31-tok-"))
        subprocess.run(
            [
                sys.executable,
                str(Path(__file__).with_name("dummy_tokenizer.py")),
                str(Path(__file__).parent / "models" / "Llama-3.1-8B"),
                str(path),
            ],
            check=True,
        )
    config = json.loads((path / "config.json").read_text())
    return AutoTokenizer.from_pretrained(path), int(config["vocab_size"])


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--libs", nargs="+", default=list(LIBRARIES), choices=list(LIBRARIES))
    parser.add_argument("--llama3-dir", type=Path, default=None)
    parser.add_argument("--hostile-timeout", type=float, default=10.0)
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    parser.add_argument("--rows", type=int, default=32, help="batch rows for the engine's masks")
    parser.add_argument(
        "--engine-only", action="store_true", help="only the engine's batch masks (kvfleet)"
    )
    args = parser.parse_args()

    from kvfleet.engine.default_model import default_model_path
    from kvfleet.engine.models import gguf_checkpoint

    gguf = default_model_path()
    smol = gguf_checkpoint.load_tokenizer(gguf)
    smol_vocab = int(gguf_checkpoint.load_config(gguf).vocab_size)
    llama, llama_vocab = _llama3_tokenizer(args.llama3_dir)
    engine = {
        f"SmolLM2 ({smol_vocab})": engine_batch_masks(smol, smol_vocab, args.rows),
        f"Llama-3 ({llama_vocab})": engine_batch_masks(llama, llama_vocab, args.rows),
    }
    logger.info("engine masks: %s", json.dumps(engine, indent=1))
    if args.engine_only:
        print(json.dumps(engine, indent=1))
        return
    results: dict[str, Any] = {
        "kvfleet engine": engine,
        f"SmolLM2 ({smol_vocab})": bench_tokenizer(
            "smollm2", smol, smol_vocab, args.libs, args.hostile_timeout
        ),
        f"Llama-3 ({llama_vocab})": bench_tokenizer(
            "llama3", llama, llama_vocab, args.libs, args.hostile_timeout
        ),
    }
    text = json.dumps(results, indent=1)
    if args.out:
        args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
