"""The bounds a constraint meets before the native grammar compiler sees it: each hostile shape
that crashed or stalled llguidance is refused with a message naming the bound, and the shapes
real schemas and grammars have (recursion, enums, patterns, embedded schemas) pass."""

from __future__ import annotations

import pytest

from kvfleet.engine import grammar_bounds as gb
from kvfleet.engine.grammar_bounds import GrammarBoundError


def lark_chain(n: int) -> str:
    """A grammar of n rules, each only the next: ~40 KB at 3,000, which overflowed the
    compiler's stack."""
    return "\n".join(["start: r0"] + [f"r{i}: r{i + 1}" for i in range(n)] + [f'r{n}: "a"'])


def ref_chain(n: int) -> dict:
    """A schema whose $refs chain through n object definitions."""
    defs = {
        f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}}}
        for i in range(n)
    }
    defs[f"d{n}"] = {"type": "string"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


@pytest.mark.parametrize(
    "regex, size",
    [
        ("abc", 3),
        (r"\d{3}-\d{4}", 8),
        ("(ab|cd){3}", 12),
        ("[a-z]{1,64}@x", 66),
        ("a{1000000000}", 1_000_000_000),
        ("^(a{1000}){1000}$", 1_000_002),
        (r"[{]{5}\{2}", 8),  # a brace in a class, or escaped, is a literal
        (r"\p{L}{4}", 4),
        ("a{,5}", 5),
        ("x{2,}", 2),
        ("a*b+c?", 3),
    ],
)
def test_regex_unrolled_size(regex, size):
    assert gb.regex_unrolled_size(regex) == size


@pytest.mark.parametrize("regex", ["a{1000000000}", "^(a{1000}){1000}$", "(x{400}){400}"])
def test_huge_repetition_is_refused(regex):
    with pytest.raises(GrammarBoundError, match=r"repeats to [\d,]+ positions, more than 100,000"):
        gb.check_regex(regex)


def test_a_chain_of_rules_is_refused_and_a_short_one_passes():
    with pytest.raises(GrammarBoundError, match=r"3,002 deep, more than 256"):
        gb.check_lark(lark_chain(3000))
    gb.check_lark(lark_chain(200))


def test_terminals_chain_as_rules_do():
    chain = "\n".join(["start: T0"] + [f"T{i}: T{i + 1}" for i in range(400)] + ['T400: "a"'])
    with pytest.raises(GrammarBoundError, match="deep"):
        gb.check_lark(chain)


def test_recursion_in_a_grammar_counts_once_per_rule():
    """A recursive rule is one node of its cycle, not an infinite chain."""
    gb.check_lark('start: list\nlist: "[" (item ("," item)*)? "]"\nitem: NUMBER | list\n'
                  "NUMBER: /[0-9]+/")  # fmt: skip
    # A cycle through more rules than the bound is as deep as its size.
    cycle = "\n".join(["start: r0"] + [f'r{i}: r{(i + 1) % 300} | "a"' for i in range(300)])
    with pytest.raises(GrammarBoundError, match="deep"):
        gb.check_lark(cycle)


def test_alternatives_per_rule():
    many = "start: " + " | ".join(f'"w{i}"' for i in range(6000))
    with pytest.raises(GrammarBoundError, match="more than 2,000 alternatives"):
        gb.check_lark(many)
    # Alternatives on continuation lines count for the rule they continue.
    gb.check_lark("start: " + "\n  | ".join(f'"w{i}"' for i in range(100)))


def test_strings_comments_and_regexes_hide_no_rules():
    """Names inside literals, comments and regexes are not references, and a regex terminal's
    repetition counts are checked."""
    gb.check_lark('start: "r0: r1" // r2: r3\n  | /r4{3}/\n')
    with pytest.raises(GrammarBoundError, match="a regex of rule start"):
        gb.check_lark("start: /a{200000}/")


def test_an_embedded_schema_is_checked_as_a_schema():
    import json

    gb.check_lark(f"start: %json {json.dumps({'type': 'object'})}")
    with pytest.raises(GrammarBoundError, match="embedded JSON schema"):
        gb.check_lark(f"start: %json {json.dumps(ref_chain(300))}")


def test_a_chain_of_refs_is_refused_and_recursion_passes():
    with pytest.raises(GrammarBoundError, match=r"with its \$refs followed, more than 256"):
        gb.check_schema(ref_chain(1300))
    gb.check_schema(ref_chain(20))
    tree = {
        "$defs": {
            "node": {
                "type": "object",
                "properties": {"children": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
            }
        },
        "$ref": "#/$defs/node",
    }
    gb.check_schema(tree)
    gb.check_schema({"$ref": "#"})  # the library itself says this allows nothing
    gb.check_schema({"$ref": "#/$defs/missing"})  # and this that it is broken
    gb.check_schema({"$ref": "https://example.com/schema"})


def test_schema_patterns_and_enums_are_bounded():
    with pytest.raises(GrammarBoundError, match="pattern repeats"):
        gb.check_schema({"type": "string", "pattern": "^(a{1000}){1000}$"})
    with pytest.raises(GrammarBoundError, match="patternProperties"):
        gb.check_schema({"type": "object", "patternProperties": {"^x{200000}$": {}}})
    with pytest.raises(GrammarBoundError, match="enum of 5,000 values, more than 2,000"):
        gb.check_schema({"enum": list(range(5000))})
    gb.check_schema({"enum": list(range(2000)), "pattern": "^[a-z]{1,64}$"})


def test_longest_chain_counts_a_component_by_its_size():
    graph = {"a": ["b"], "b": ["c"], "c": ["b", "d"], "d": []}
    assert gb.longest_chain(list(graph), graph.__getitem__) == 4  # a, {b, c}, d
    line = {i: [i + 1] for i in range(100_000)} | {100_000: []}
    # Iterative: a chain far beyond Python's recursion limit.
    assert gb.longest_chain(list(line), line.__getitem__) == 100_001
