"""kvfleet.protocol.json_body: the bounded, strict JSON decoding the engine's server and the
router share. Valid JSON within the bounds decodes as json.loads does; each bound is refused with
its status and code; the shape is measured without recursion and without being fooled by
strings."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfleet.protocol import json_body
from kvfleet.protocol.json_body import (
    MAX_NUMBER_CHARS,
    JsonLimits,
    RequestRefused,
    check_content_encoding,
    check_headers,
    decode_json,
    json_shape,
    nesting_exceeds,
)

ROUTER = JsonLimits()
ENGINE = JsonLimits(max_depth=64, max_int_digits=20, max_values=1 << 18)


def refusal(body: bytes, limits: JsonLimits = ROUTER) -> RequestRefused:
    with pytest.raises(RequestRefused) as e:
        decode_json(body, limits)
    assert e.value.message and e.value.status == 400
    return e.value


def depth(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + max(map(depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(depth, value), default=0)
    return 0


# Strings full of what the shape scan must not count: brackets, commas, quotes, backslashes.
tricky_text = st.text(alphabet=st.sampled_from('ab[]{},"\\\n\u00e9\U0001f600'), max_size=12)
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64)
    | st.floats(allow_nan=False, allow_infinity=False)
    | tricky_text,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(tricky_text, inner, max_size=4),
    max_leaves=40,
)


@settings(max_examples=300, deadline=None)
@given(json_values, st.booleans(), st.integers(1, 12))
def test_valid_json_decodes_as_json_loads_and_its_depth_is_measured(value, ascii_only, limit):
    body = json.dumps(value, ensure_ascii=ascii_only).encode()
    assert nesting_exceeds(body, limit) == (depth(value) > limit)
    assert decode_json(body, ROUTER) == json.loads(body)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.lists(tricky_text | st.integers(0, 9), max_size=5), max_size=8), st.integers(0, 30)
)
def test_values_are_counted_by_their_commas_outside_strings(value, limit):
    body = json.dumps(value).encode()
    structural_commas = json.dumps(value, separators=(";", ":")).count(";")
    assert json_shape(body, 64, limit)[1] == (structural_commas > limit)


# The strings of a JSON text, escapes included: what _outside_strings cuts, as a regex would.
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)


@settings(max_examples=300, deadline=None)
@given(json_values, st.integers(1, 9))
def test_strings_are_cut_alike_at_every_slice_boundary(value, size):
    """Strings are cut out a slice at a time; wherever a slice ends (inside a run of
    backslashes, between one and what it escapes, inside a string) the text outside strings
    is what a one-pass regex leaves."""
    body = json.dumps(value, ensure_ascii=False).encode()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(json_body, "_CUT_SLICE", size)
        assert json_body._outside_strings(body) == _STRING.sub(b"", body)


def test_many_flat_lists_are_not_deep():
    """Many brackets side by side are no depth: a batch of token lists is served."""
    body = json.dumps({"prompt": [[5, 6]] * 64}).encode()
    assert decode_json(body, ENGINE) == {"prompt": [[5, 6]] * 64}


def test_nesting_is_refused_before_parsing():
    for body in (b"[" * 100_000 + b"]" * 100_000, b"[" * 100_000, b'{"a":' * 65 + b"1" + b"}" * 65):
        assert refusal(body).code == "nesting_too_deep"
    at_limit = b"[" * 64 + b"]" * 64
    assert decode_json(at_limit, ROUTER) is not None
    # Past what the parser itself follows, where a process sets its bound that high.
    deep = b"[" * 5000 + b"]" * 5000
    assert refusal(deep, JsonLimits(max_depth=10_000)).code == "nesting_too_deep"


def test_brackets_inside_strings_are_text():
    body = json.dumps({"prompt": "[{" * 200_000}).encode()
    assert decode_json(body, ENGINE)["prompt"] == "[{" * 200_000
    assert not nesting_exceeds(b'{"a":"[[[[[[[[[[\\"[[[[[[[["}', 8)


def test_values_are_bounded_where_a_limit_is_set():
    body = b'{"tokens": [' + b"5," * 300_000 + b"5]}"
    assert refusal(body, ENGINE).code == "too_many_values"
    assert len(decode_json(body, ROUTER)["tokens"]) == 300_001
    # Commas inside strings are text.
    assert decode_json(json.dumps({"prompt": "," * 300_000}).encode(), ENGINE)


def test_numbers():
    assert refusal(b'{"seed": ' + b"9" * 5000 + b"}").code == "number_too_long"
    assert refusal(b"[0." + b"1" * MAX_NUMBER_CHARS + b"]").code == "number_too_long"
    big = b'{"seed": 18446744073709551616}'  # 2**64: 20 digits, a range for the schema to judge
    assert decode_json(big, ENGINE) == decode_json(big, ROUTER) == {"seed": 2**64}
    assert refusal(b'{"seed": -' + b"9" * 21 + b"}", ENGINE).code == "number_too_long"
    assert decode_json(b'{"seed": -' + b"9" * 21 + b"}", ROUTER) == {"seed": -int("9" * 21)}
    assert refusal(b'{"temperature": 1e999}').code == "number_out_of_range"
    assert decode_json(b"[1e308, -0.0, 5e-324]", ROUTER) == [1e308, -0.0, 5e-324]
    for constant in (b"NaN", b"Infinity", b"-Infinity"):
        assert refusal(b'{"temperature": ' + constant + b"}").code == "invalid_json"


@pytest.mark.parametrize(
    ("body", "code"),
    [
        (b'{"prompt": "a\\ud800b"}', "invalid_unicode"),
        (b'{"prompt": "\\udfff"}', "invalid_unicode"),
        (b'{"\\udc00": 1}', "invalid_unicode"),
        (b'{"prompt": "\xff\xfe"}', "invalid_unicode"),
        (b"prompt=hi", "invalid_json"),
        (b"", "invalid_json"),
        (b'{"a": [}', "invalid_json"),
    ],
)
def test_malformed_bodies(body, code):
    assert refusal(body, ENGINE).code == refusal(body, ROUTER).code == code


def test_a_surrogate_pair_is_one_character():
    assert decode_json(b'{"prompt": "\\ud83d\\ude00 ok"}', ENGINE) == {"prompt": "\U0001f600 ok"}


def test_headers_must_be_utf8():
    check_headers([(b"X-Session-Id", "ünï".encode()), (b"Authorization", b"Bearer k")])
    with pytest.raises(RequestRefused) as e:
        check_headers([(b"Authorization", b"Bearer \xff\xfe")])
    assert (e.value.status, e.value.code, e.value.param) == (400, "invalid_header", "Authorization")


def test_content_encoding():
    for fine in (None, "", "identity", " IDENTITY "):
        check_content_encoding(fine)
    for compressed in ("gzip", "deflate", "br", "gzip, identity"):
        with pytest.raises(RequestRefused) as e:
            check_content_encoding(compressed)
        assert (e.value.status, e.value.code) == (415, "unsupported_content_encoding")


def test_the_protocol_needs_neither_torch_nor_aiohttp():
    code = (
        "import sys, kvfleet.protocol.json_body, kvfleet.protocol.chat_template\n"
        "print(' '.join(sys.modules))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    loaded = proc.stdout.split()
    assert not {m.split(".")[0] for m in loaded} & {"torch", "aiohttp", "transformers", "numpy"}
    assert not [m for m in loaded if m.startswith(("kvfleet.engine", "kvfleet.router"))]
