"""Hostile HTTP requests as hypothesis strategies, a raw sender, and the rules a response must
keep. The API fuzzer (tests/server/test_api_fuzz.py) and the soak (bench/soak.py) both draw
from here.

A case starts from a valid request to one of the OpenAI endpoints and breaks it: fields set to
extreme or wrongly typed values, text with lone surrogates and control characters, deep nesting,
numbers too long to parse, bodies that are not JSON or not UTF-8, odd Content-Type and
Content-Encoding headers, Authorization values that are not UTF-8. Heavy cases (heavy_case) stay
within every size bound and put the cost in a constraint's or a message's structure instead:
chains of grammar rules and of $refs, JSON nested deep inside strings, huge repetition counts,
megabytes of tool-call arguments. Whatever is sent, the server must answer with a status below
500 and, for errors, OpenAI's JSON error shape without a trace.
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from hypothesis import strategies as st

MODEL = "fuzz"
API_KEY = "fuzz-key"

_INT_EXTREMES = [
    0, -1, 1, 2, 16, 255, 256, 511, 512, 2**31 - 1, 2**31, 2**53 + 1, 2**63 - 1, 2**63,
    2**64 - 1, 2**64, -(2**63), -(2**63) - 1, 10**30, -(10**30),
]  # fmt: skip
_FLOAT_EXTREMES = [
    0.0, -0.0, 1e-320, 0.5, 1.0, 2.0, 2.0000001, 1e308, -1e308, float("nan"), float("inf"),
    float("-inf"),
]  # fmt: skip
_SPECIAL_TEXT = [
    "", " ", "\x00", "a\ud800b", "\udfff", "\U0010ffff", "\u202e", "<|im_start|>system\n",
    "<|im_end|>", "{{ 7 * 7 }}", "{% for x in range(10**9) %}x{% endfor %}", "\r\n\r\n",
    "\\", '"', "é" * 100, "🙂" * 50,
]  # fmt: skip

# Sentinels swapped into the serialized body for what json.dumps cannot write.
_BIG_INT = "__KVFLEET_BIG_INT__"
_BAD_BYTES = "__KVFLEET_BAD_BYTES__"

_SAMPLING = [
    "model", "max_tokens", "n", "temperature", "top_p", "top_k", "min_p", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "seed", "stop", "stop_token_ids", "ignore_eos",
    "min_tokens", "logprobs", "stream", "stream_options", "user", "logit_bias",
    "skip_special_tokens",
]  # fmt: skip
# The fields each endpoint knows (a few it refuses too): mutations mostly keep to them.
_FIELDS = {
    "/v1/completions": [*_SAMPLING, "prompt", "best_of", "echo", "suffix"],
    "/v1/chat/completions": [*_SAMPLING, "messages", "max_completion_tokens", "top_logprobs",
                             "add_generation_prompt", "chat_template_kwargs", "tools",
                             "tool_choice", "response_format"],
    "/tokenize": ["model", "prompt", "messages", "add_special_tokens", "add_generation_prompt"],
    "/detokenize": ["model", "tokens"],
}  # fmt: skip

_BASES: dict[str, dict[str, Any]] = {
    "/v1/completions": {"model": MODEL, "prompt": "Hello there", "max_tokens": 4},
    "/v1/chat/completions": {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Say hello"}],
        "max_tokens": 4,
    },
    "/tokenize": {"model": MODEL, "prompt": "Hello there"},
    "/detokenize": {"model": MODEL, "tokens": [5, 6, 7]},
}


GOOD_HEADERS = [
    ("Authorization", f"Bearer {API_KEY}".encode()),
    ("Content-Type", b"application/json"),
]


@dataclass
class Case:
    method: str
    path: str
    headers: list[tuple[str, bytes]]
    body: bytes = b""
    note: str = ""

    def describe(self) -> str:
        body = self.body[:300]
        more = "..." if len(self.body) > 300 else ""
        return f"{self.method} {self.path} {self.headers} {body!r}{more}"


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes
    problems: list[str] = field(default_factory=list)


def texts() -> st.SearchStrategy[str]:
    # Surrogates included: a lone one is valid in a JSON escape but not in UTF-8.
    return st.one_of(
        st.sampled_from(_SPECIAL_TEXT),
        st.text(st.characters(exclude_categories=()), max_size=40),
    )


def scalars() -> st.SearchStrategy[Any]:
    return st.one_of(
        st.none(),
        st.booleans(),
        st.sampled_from(_INT_EXTREMES),
        st.integers(min_value=-1000, max_value=1000),
        st.sampled_from(_FLOAT_EXTREMES),
        st.floats(allow_nan=True, allow_infinity=True),
        texts(),
        st.sampled_from(["16", "yes", "true", "1e3", "0x10", _BIG_INT]),
    )


def values() -> st.SearchStrategy[Any]:
    return st.recursive(
        scalars(),
        lambda inner: st.one_of(
            st.lists(inner, max_size=4),
            st.dictionaries(
                st.sampled_from(["role", "content", "type", "text", "x"]), inner, max_size=4
            ),
        ),
        max_leaves=8,
    )


def _messages(text: st.SearchStrategy[str], content: st.SearchStrategy[Any]) -> st.SearchStrategy:
    message = st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant", "tool", "developer", "root"]),
         "content": st.one_of(text, content)},
        optional={"name": text},
    )  # fmt: skip
    return st.lists(message, min_size=1, max_size=5)


def _plain_text() -> st.SearchStrategy[str]:
    return st.text(st.characters(codec="utf-8"), min_size=1, max_size=40)


_TOKEN = st.integers(0, 600)  # the test models' vocabularies hold 512 ids

# Values a client might well send: the right type, mostly in range, some just past it.
_PLAUSIBLE: dict[str, st.SearchStrategy[Any]] = {
    "model": st.sampled_from([MODEL, MODEL, "other"]),
    "prompt": st.one_of(_plain_text(), st.lists(_TOKEN, min_size=1, max_size=20),
                        st.lists(_plain_text(), min_size=1, max_size=3)),
    "messages": _messages(_plain_text(), st.nothing()),
    "max_tokens": st.integers(0, 64),
    "max_completion_tokens": st.integers(0, 64),
    "n": st.integers(0, 4),
    "best_of": st.integers(1, 4),
    "temperature": st.floats(0, 2.5),
    "top_p": st.floats(0, 1),
    "top_k": st.integers(-2, 600),
    "min_p": st.floats(0, 1),
    "presence_penalty": st.floats(-2.5, 2.5),
    "frequency_penalty": st.floats(-2.5, 2.5),
    "repetition_penalty": st.floats(0, 2.5),
    "seed": st.integers(-(2**64), 2**64),
    "stop": st.one_of(_plain_text(), st.lists(_plain_text(), max_size=4)),
    "stop_token_ids": st.lists(_TOKEN, max_size=4),
    "min_tokens": st.integers(0, 70),
    "logprobs": st.one_of(st.booleans(), st.integers(0, 21)),
    "top_logprobs": st.integers(0, 21),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans(),
                                                          "continuous_usage_stats": st.booleans()}),
    "user": _plain_text(),
    "tokens": st.lists(_TOKEN, max_size=20),
    "chat_template_kwargs": st.dictionaries(st.sampled_from(["enable_thinking", "tokenize"]),
                                            st.booleans(), max_size=1),
    "logit_bias": st.dictionaries(st.integers(0, 600).map(str), st.floats(-100, 100), max_size=2),
    "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"}]),
}  # fmt: skip


def _field_value(name: str) -> st.SearchStrategy[Any]:
    plausible = _PLAUSIBLE.get(name, st.booleans())
    if name == "messages":
        hostile = _messages(texts(), values())
    elif name in ("prompt", "tokens", "stop_token_ids"):
        token_lists = st.lists(st.sampled_from(_INT_EXTREMES), max_size=6)
        hostile = st.one_of(texts(), token_lists, st.lists(token_lists, max_size=4),
                            st.lists(texts(), min_size=0, max_size=300))  # fmt: skip
    elif name == "stop":
        hostile = st.one_of(texts(), st.lists(texts(), max_size=20))
    else:
        hostile = values()
    return st.one_of(*[plausible] * 6, hostile, values())


@st.composite
def json_case(draw: st.DrawFn) -> Case:
    path = draw(st.sampled_from(sorted(_BASES)))
    body = dict(_BASES[path])
    names = st.sampled_from(_FIELDS[path])
    for name in draw(st.lists(names, min_size=1, max_size=3, unique=True)):
        if draw(st.integers(0, 9)) == 0:
            body.pop(name, None)
        else:
            body[name] = draw(_field_value(name))
    if draw(st.integers(0, 19)) == 0:
        body[draw(texts())] = draw(values())
    raw = json.dumps(body, allow_nan=True)  # NaN/Infinity are not JSON: the server must say so
    raw = raw.replace(json.dumps(_BIG_INT), "9" * draw(st.sampled_from([20, 400, 5000, 50_000])))
    data = raw.encode("utf-8", "surrogatepass")
    good = st.just(GOOD_HEADERS)
    return Case("POST", path, draw(st.one_of(good, good, good, headers())), data, "json")


@st.composite
def raw_case(draw: st.DrawFn) -> Case:
    """Bodies broken below the JSON level."""
    path = draw(st.sampled_from(sorted(_BASES)))
    kind = draw(
        st.sampled_from(
            [
                "deep_list",
                "deep_dict",
                "bad_utf8",
                "truncated",
                "not_json",
                "empty",
                "not_object",
                "big_number",
                "huge_string",
            ]
        )
    )
    depth = draw(st.sampled_from([64, 65, 1000, 5000, 100_000]))
    base = json.dumps(_BASES[path]).encode()
    if kind == "deep_list":
        body = (
            b'{"model": "' + MODEL.encode() + b'", "prompt": ' + b"[" * depth + b"]" * depth + b"}"
        )
    elif kind == "deep_dict":
        body = b'{"x":' * depth + b"1" + b"}" * depth
    elif kind == "bad_utf8":
        cut = draw(st.integers(0, len(base)))
        body = (
            base[:cut]
            + draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x80"]))
            + base[cut:]
        )
    elif kind == "truncated":
        body = base[: draw(st.integers(0, len(base) - 1))]
    elif kind == "not_json":
        body = draw(st.binary(max_size=64))
    elif kind == "empty":
        body = b""
    elif kind == "not_object":
        body = draw(st.sampled_from([b"[]", b"null", b"1", b'"x"', b"true", b"[{}]"]))
    elif kind == "big_number":
        digits = b"9" * draw(st.sampled_from([4301, 5000, 100_000]))
        body = base[:-1] + b', "max_tokens": ' + digits + b"}"
    else:
        size = draw(st.sampled_from([10_000, 70_000, 2_000_000]))
        body = base[:-1] + b', "user": "' + b"x" * size + b'"}'
    return Case("POST", path, draw(headers()), body, kind)


# --------------------------------------------------------------------------------------------
# Heavy cases: bodies within every size bound whose constraints or messages are costly by
# their structure. Each kind is a strategy of (path, body); the sizes are those of issue 35.
# --------------------------------------------------------------------------------------------

_CONSTRAINED = ["/v1/chat/completions", "/v1/completions"]
_WITH_MESSAGES = ["/v1/chat/completions", "/tokenize"]


def nested_json(depth: int) -> str:
    """JSON text nested `depth` levels deep, objects and lists in turn."""
    return '{"a":[' * (depth // 2) + "1" + "]}" * (depth // 2)


def lark_chain(rules: int) -> str:
    """A Lark grammar whose start rule reaches its one terminal through `rules` rules, each
    naming the next."""
    chain = [f"r{i}: r{i + 1}" for i in range(rules - 1)]
    return "\n".join(["start: r0", *chain, f'r{rules - 1}: "a"'])


def gbnf_alternatives(count: int) -> str:
    """A GBNF grammar whose root is one rule of `count` alternatives."""
    return "root ::= " + " | ".join(f'"a{i}"' for i in range(count))


def defs_chain(defs: int) -> dict[str, Any]:
    """A JSON schema whose $ref resolves through `defs` definitions, each a $ref to the next."""
    chain: dict[str, Any] = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(defs - 1)}
    chain[f"d{defs - 1}"] = {"type": "string"}
    return {"$ref": "#/$defs/d0", "$defs": chain}


@st.composite
def _constrained(draw: st.DrawFn, constraint: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """A chat or completion request under `constraint` (structured_outputs); a JSON schema
    goes as an object, as its JSON text, or as response_format."""
    path = draw(st.sampled_from(_CONSTRAINED))
    body = {**_BASES[path], "stream": draw(st.booleans())}
    schema = constraint.get("json")
    how = draw(st.sampled_from(["object", "text", "response_format"]))
    if isinstance(schema, dict) and how == "text":
        constraint = {**constraint, "json": json.dumps(schema)}
    if isinstance(schema, dict) and how == "response_format":
        body["response_format"] = {
            "type": "json_schema", "json_schema": {"name": "heavy", "schema": schema}
        }  # fmt: skip
    else:
        body["structured_outputs"] = constraint
    return path, body


def _schema_in_place(schema: dict[str, Any]) -> st.SearchStrategy[dict[str, Any]]:
    """The schema itself, or as the one property of an object."""
    wrapped = {"type": "object", "properties": {"x": schema}, "required": ["x"]}
    return st.sampled_from([schema, wrapped])


def _assistant_call(arguments: str) -> list[dict[str, Any]]:
    """A conversation whose assistant turn made one tool call with `arguments`."""
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    return [
        {"role": "user", "content": "Call f"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "done"},
    ]


@st.composite
def _lark_rule_chain(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    rules = draw(st.sampled_from([3300, 4500]))  # about 40 and 56 KB
    return draw(_constrained({"grammar": lark_chain(rules)}))


@st.composite
def _gbnf_alternatives(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    return draw(_constrained({"grammar": gbnf_alternatives(draw(st.sampled_from([6000, 500])))}))


@st.composite
def _ref_chain(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    schema = defs_chain(draw(st.sampled_from([1300, 1500])))
    return draw(_constrained({"json": schema}))


@st.composite
def _regex_repetition(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    regex = draw(st.sampled_from(["a{1000000000}", "(a{1000}){1000}", "[ab]{0,4294967296}"]))
    return draw(_constrained({"regex": regex}))


@st.composite
def _pattern_repetition(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    pattern = draw(st.sampled_from(["^(a{1000}){1000}$", "^a{1000000000}$"]))
    schema = draw(_schema_in_place({"type": "string", "pattern": pattern}))
    return draw(_constrained({"json": schema}))


@st.composite
def _bad_multiple_of(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    kind = draw(st.sampled_from(["number", "integer"]))
    # Negative and zero steps are no valid schema; 1e-300 is a step no float counts in.
    step = draw(st.sampled_from([-1, -0.5, 0, 1e-300]))
    schema = draw(_schema_in_place({"type": kind, "multipleOf": step}))
    return draw(_constrained({"json": schema}))


@st.composite
def _deep_schema_text(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    path = draw(st.sampled_from(_CONSTRAINED))
    depth = draw(st.sampled_from([1000, 3000]))
    return path, {**_BASES[path], "structured_outputs": {"json": nested_json(depth)}}


@st.composite
def _deep_structural_tag_text(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    path = draw(st.sampled_from(_CONSTRAINED))
    deep = nested_json(draw(st.sampled_from([1000, 3000])))
    if draw(st.booleans()):
        text = deep  # the tag itself
    else:
        text = (
            '{"type": "structural_tag", "triggers": ["<f>"], '
            f'"structures": [{{"begin": "<f>", "schema": {deep}, "end": "</f>"}}]}}'
        )
    return path, {**_BASES[path], "structured_outputs": {"structural_tag": text}}


def _with_messages(path: str, messages: list[dict[str, Any]]) -> dict[str, Any]:
    return {"model": MODEL, "messages": messages, **({"max_tokens": 4} if "chat" in path else {})}


@st.composite
def _deep_tool_arguments(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    path = draw(st.sampled_from(_WITH_MESSAGES))
    arguments = nested_json(draw(st.sampled_from([1000, 3000])))
    return path, _with_messages(path, _assistant_call(arguments))


@st.composite
def _big_tool_arguments(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    path = draw(st.sampled_from(_WITH_MESSAGES))
    size = draw(st.sampled_from([1 << 20, 3 << 20, 6 << 20]))
    arguments = json.dumps({"text": "word " * (size // 5)})
    return path, _with_messages(path, _assistant_call(arguments))


@st.composite
def _required_tools_with_refs(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    item = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "next": {"$ref": "#/$defs/Item"}},
        "required": ["name"],
    }
    defs = draw(
        st.sampled_from(
            [
                {"Item": {"type": "object", "properties": {"name": {"type": "string"}}}},
                {"Item": item},  # recursive
                defs_chain(1300)["$defs"] | {"Item": {"$ref": "#/$defs/d0"}},
            ]
        )
    )
    parameters = {
        "type": "object",
        "properties": {"item": {"$ref": "#/$defs/Item"}},
        "required": ["item"],
        "$defs": defs,
    }
    tools = [
        {"type": "function", "function": {"name": name, "parameters": parameters}}
        for name in draw(st.sampled_from([["f"], ["f", "g"]]))
    ]
    choice = draw(st.sampled_from(["required", {"type": "function", "function": {"name": "f"}}]))
    path = "/v1/chat/completions"
    body = {**_BASES[path], "tools": tools, "tool_choice": choice, "stream": draw(st.booleans())}
    return path, body


HEAVY_KINDS: dict[str, Callable[[], st.SearchStrategy[tuple[str, dict[str, Any]]]]] = {
    "lark_rule_chain": _lark_rule_chain,
    "gbnf_alternatives": _gbnf_alternatives,
    "ref_chain": _ref_chain,
    "regex_repetition": _regex_repetition,
    "pattern_repetition": _pattern_repetition,
    "bad_multiple_of": _bad_multiple_of,
    "deep_schema_text": _deep_schema_text,
    "deep_structural_tag_text": _deep_structural_tag_text,
    "deep_tool_arguments": _deep_tool_arguments,
    "big_tool_arguments": _big_tool_arguments,
    "required_tools_with_refs": _required_tools_with_refs,
}


@st.composite
def heavy_case(draw: st.DrawFn, kinds: Sequence[str] = tuple(HEAVY_KINDS)) -> Case:
    """One of the heavy `kinds`, sent well formed (auth, JSON), so that it reaches the code
    its structure is meant to load."""
    kind = draw(st.sampled_from(list(kinds)))
    path, body = draw(HEAVY_KINDS[kind]())
    return Case("POST", path, GOOD_HEADERS, json.dumps(body).encode(), kind)


def _header_bytes() -> st.SearchStrategy[bytes]:
    # Bytes HTTP allows in a field value (visible ASCII, space, tab, and 0x80-0xFF, which is
    # rarely UTF-8); control characters are malformed HTTP, refused by the parser itself.
    legal = [9, 32, *range(33, 127), *range(128, 256)]
    return st.lists(st.sampled_from(legal), min_size=1, max_size=40).map(
        lambda b: bytes(b).strip(b" \t") or b"\xff"
    )


@st.composite
def headers(draw: st.DrawFn) -> list[tuple[str, bytes]]:
    out: list[tuple[str, bytes]] = []
    auth = draw(st.sampled_from(["good"] * 12 + ["lower", "none", "wrong", "bytes"]))
    if auth == "good":
        out.append(("Authorization", f"Bearer {API_KEY}".encode()))
    elif auth == "lower":
        out.append(("Authorization", f"bearer {API_KEY}".encode()))
    elif auth == "wrong":
        out.append(("Authorization", b"Bearer nope"))
    elif auth == "bytes":
        out.append(("Authorization", b"Bearer " + draw(_header_bytes())))
    ctype = draw(
        st.sampled_from(
            [
                *["application/json"] * 6,
                "text/plain",
                None,
                "application/json; charset=latin-1",
                "multipart/form-data",
            ]
        )
    )
    if ctype is not None:
        out.append(("Content-Type", ctype.encode()))
    encoding = draw(st.sampled_from([None] * 12 + ["gzip", "deflate", "br", "identity", "x"]))
    if encoding is not None:
        out.append(("Content-Encoding", encoding.encode()))
    if draw(st.integers(0, 9)) == 0:
        name = draw(st.sampled_from(["X-Session-Id", "User-Agent", "traceparent"]))
        out.append((name, draw(_header_bytes())))
    return out


@st.composite
def other_case(draw: st.DrawFn) -> Case:
    """Methods and paths off the beaten track."""
    method = draw(st.sampled_from(["GET", "PUT", "DELETE", "PATCH", "OPTIONS"]))
    path = draw(
        st.sampled_from(
            [
                "/v1/models",
                "/v1/models/" + MODEL,
                "/v1/completions",
                "/x",
                "/v1/../../etc/passwd",
                "/v1/%ff",
                "/tokenize",
            ]
        )
    )
    return Case(method, path, draw(headers()), b"", "other")


def hostile_case() -> st.SearchStrategy[Case]:
    return st.one_of(
        json_case(), json_case(), json_case(), json_case(), raw_case(), other_case(), heavy_case()
    )


def send(host: str, port: int, case: Case, timeout: float = 60.0) -> Reply:
    """The case byte for byte, over a fresh connection; the whole reply, streams included."""
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.putrequest(case.method, case.path, skip_accept_encoding=True)
        for name, value in case.headers:
            conn.putheader(name, value)
        conn.putheader("Content-Length", str(len(case.body)))
        conn.endheaders(case.body)
        resp = conn.getresponse()
        return Reply(resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read())
    finally:
        conn.close()


def check(reply: Reply) -> list[str]:
    """What is wrong with a reply: a server error, a trace, an error body not in OpenAI's shape,
    a stream that breaks off or carries a server-side error."""
    problems = []
    text = reply.body.decode("utf-8", "replace")
    if reply.status >= 500:
        problems.append(f"server error {reply.status}")
    if "Traceback" in text or 'File "' in text:
        problems.append("a traceback in the body")
    if reply.status >= 400:
        try:
            err = json.loads(reply.body)["error"]
            if not isinstance(err.get("message"), str) or "type" not in err:
                problems.append("error JSON without message/type")
        except (ValueError, KeyError, TypeError):
            problems.append(f"error body is not OpenAI JSON: {text[:200]!r}")
    elif reply.headers.get("content-type", "").startswith("text/event-stream"):
        events = [ln[6:] for ln in text.split("\n") if ln.startswith("data: ")]
        if not events or events[-1] != "[DONE]":
            problems.append("stream did not end with [DONE]")
        for ev in events[:-1]:
            payload = json.loads(ev)
            if "error" in payload:
                problems.append(f"error event in stream: {payload['error']}")
    return problems


def problems_of(host: str, port: int, case: Case) -> list[str]:
    try:
        reply = send(host, port, case)
    except (OSError, http.client.HTTPException) as e:
        return [f"no reply: {e!r}"]
    return check(reply)
