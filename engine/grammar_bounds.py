"""What the grammar library can survive, checked in Python before a constraint reaches it.

llguidance compiles grammars and JSON schemas by native recursion: a chain of a few thousand rules,
or of `$ref`s through `$defs`, overflows its thread's stack and takes the whole process down; a
counted repetition is unrolled into lexer states, so `a{1000000000}` holds the first mask for
seconds and hundreds of megabytes. Each check here is linear in the constraint's size and never
recursive itself, so a hostile constraint costs a 400, not the engine. The supervised compile in
`grammar_sandbox` catches what these bounds did not foresee.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any

# Rules (or terminals) that reach one another in a chain; a cycle counts as deep as its size.
# The native compiler overflowed a 4 MiB stack between 1,200 and 2,000 chained Lark rules.
MAX_GRAMMAR_RULE_DEPTH = 256
# Alternatives in one rule's body (or values of one enum): what llguidance's parser holds in one
# row (its max_items_in_row limit, which `grammar` sets to this); more fail at a later token.
MAX_RULE_ALTERNATIVES = 2000
# Schema objects and arrays on the deepest path, `$ref`s followed (a cycle counts as its size).
# A chain of 800 referenced object definitions (2,400 such nodes) overflowed a 4 MiB stack.
MAX_SCHEMA_REF_DEPTH = 256
# Positions a regex unrolls to, counted repetitions multiplied out: `a{100000}` is 100,000 lexer
# positions, about 35 MB and 0.1 s for its first mask at a 49k vocabulary.
MAX_REGEX_UNROLLED = 100_000


class GrammarBoundError(ValueError):
    """A constraint beyond what the grammar library is given; the message says which bound."""


def check_regex(regex: str, where: str = "regex") -> None:
    """GrammarBoundError when the regex unrolls to more than MAX_REGEX_UNROLLED positions."""
    size = regex_unrolled_size(regex)
    if size > MAX_REGEX_UNROLLED:
        raise GrammarBoundError(
            f"{where} repeats to {size:,} positions, more than {MAX_REGEX_UNROLLED:,}: "
            "use smaller repetition counts, or * and + for open-ended repetition"
        )


_COUNT = re.compile(r"\{(\d*)(,?)(\d*)\}")


def regex_unrolled_size(regex: str) -> int:
    """Positions the regex stands for once every counted repetition ({n}, {n,}, {n,m}) is
    unrolled: literals and classes count 1, a group the sum of its items, a count multiplies
    what it repeats. * + ? leave their item's size (the lexer loops rather than unrolls)."""
    # One frame per open group: [size of the items so far, size of the last item].
    stack: list[list[int]] = [[0, 0]]
    i, n = 0, len(regex)
    while i < n:
        ch = regex[i]
        frame = stack[-1]
        if ch == "\\":
            i += 2
            if i <= n and regex[i - 1] in "pPxu" and i < n and regex[i] == "{":
                close = regex.find("}", i)
                i = n if close < 0 else close + 1
            frame[0] += 1
            frame[1] = 1
            continue
        if ch == "[":
            i = _class_end(regex, i)
            frame[0] += 1
            frame[1] = 1
            continue
        if ch == "(":
            stack.append([0, 0])
            i += 1
            continue
        if ch == ")" and len(stack) > 1:
            inner = stack.pop()[0]
            stack[-1][0] += inner
            stack[-1][1] = inner
            i += 1
            continue
        if ch == "{":
            m = _COUNT.match(regex, i)
            if m is not None and (m.group(1) or m.group(3)):
                low = int(m.group(1) or 0)
                high = int(m.group(3)) if m.group(3) else low
                times = max(low, high, 1)
                frame[0] += frame[1] * (times - 1)
                frame[1] *= times
                i = m.end()
                continue
        if ch == "|":
            frame[1] = 0
        elif ch not in "*+?":
            frame[0] += 1
            frame[1] = 1
        i += 1
    while len(stack) > 1:  # unbalanced: the library refuses it, its size still counts
        inner = stack.pop()[0]
        stack[-1][0] += inner
    return stack[0][0]


def _class_end(regex: str, start: int) -> int:
    """The index after the character class that opens at `start`."""
    i = start + 1
    if i < len(regex) and regex[i] == "^":
        i += 1
    if i < len(regex) and regex[i] == "]":
        i += 1
    while i < len(regex):
        if regex[i] == "\\":
            i += 2
            continue
        if regex[i] == "]":
            return i + 1
        i += 1
    return i


def check_schema(schema: Any, where: str = "JSON schema") -> None:
    """GrammarBoundError for a JSON schema whose deepest path, `$ref`s followed, passes
    MAX_SCHEMA_REF_DEPTH, whose `enum` passes MAX_RULE_ALTERNATIVES, or whose `pattern`s
    unroll too far."""
    nodes: dict[int, Any] = {}
    edges: dict[int, list[int]] = {}
    refs: list[tuple[int, str]] = []
    # Iterative walk: the schema is bounded in size, not trusted in shape.
    todo: list[Any] = [schema]
    while todo:
        node = todo.pop()
        if id(node) in nodes:
            continue
        nodes[id(node)] = node
        children = list(node.values() if isinstance(node, dict) else node)
        edges[id(node)] = [id(c) for c in children if isinstance(c, dict | list)]
        todo.extend(c for c in children if isinstance(c, dict | list))
        if not isinstance(node, dict):
            continue
        ref = node.get("$ref")
        if isinstance(ref, str):
            refs.append((id(node), ref))
        enum = node.get("enum")
        if isinstance(enum, list) and len(enum) > MAX_RULE_ALTERNATIVES:
            raise GrammarBoundError(
                f"{where} has an enum of {len(enum):,} values, more than {MAX_RULE_ALTERNATIVES:,}"
            )
        pattern = node.get("pattern")
        if isinstance(pattern, str):
            check_regex(pattern, f"{where} pattern")
        pattern_properties = node.get("patternProperties")
        if isinstance(pattern_properties, dict):
            for key in pattern_properties:
                check_regex(key, f"{where} patternProperties")
    for source, ref in refs:
        target = _resolve_pointer(schema, ref)
        if target is not None:
            edges[source].append(id(target))
    depth = longest_chain(list(edges), edges.__getitem__)
    if depth > MAX_SCHEMA_REF_DEPTH:
        raise GrammarBoundError(
            f"{where} nests {depth:,} levels deep with its $refs followed, more than "
            f"{MAX_SCHEMA_REF_DEPTH}: flatten the chain of definitions"
        )


def _resolve_pointer(schema: Any, ref: str) -> Any:
    """The node a local `$ref` ("#", "#/$defs/x", ...) points to; None for a remote or broken
    one (the library reports those itself)."""
    if not ref.startswith("#"):
        return None
    node = schema
    for raw in ref[1:].split("/")[1:] if ref != "#" else []:
        part = raw.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node if isinstance(node, dict | list) else None


def longest_chain(nodes: list[Any], successors: Callable[[Any], Iterable[Any]]) -> int:
    """The most nodes on one path of a directed graph, where a strongly connected component
    counts as many nodes as it has (a recursion through it may go round each once before it
    repeats). Tarjan's algorithm and the longest path over its components, both iterative."""
    index: dict[Any, int] = {}
    low: dict[Any, int] = {}
    on_stack: set[Any] = set()
    stack: list[Any] = []
    component: dict[Any, int] = {}
    sizes: list[int] = []
    for root in nodes:
        if root in index:
            continue
        work: list[tuple[Any, Iterator[Any]]] = [(root, iter(successors(root)))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, it = work[-1]
            advanced = False
            for nxt in it:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(successors(nxt))))
                    advanced = True
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            if advanced:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                size = 0
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component[member] = len(sizes)
                    size += 1
                    if member == node:
                        break
                sizes.append(size)
    # Tarjan numbers components in reverse topological order: successors' components first.
    best = [0] * len(sizes)
    members: list[list[Any]] = [[] for _ in sizes]
    for node, c in component.items():
        members[c].append(node)
    for c, size in enumerate(sizes):
        deepest = 0
        for node in members[c]:
            for nxt in successors(node):
                d = component[nxt]
                if d != c:
                    deepest = max(deepest, best[d])
        best[c] = size + deepest
    return max(best, default=0)


# Lark: a rule or terminal is defined where a line starts with its name (after ? or !, before
# optional [params] and .priority) and a colon.
_LARK_TOKEN = re.compile(
    r"""(?P<comment>//[^\n]*)
    |(?P<string>"(?:\\.|[^"\\\n])*"i?)
    |(?P<regex>/(?:\\.|[^/\\\n])+/[imslux]*)
    |(?P<special><\[[^\]\n]*\]>)
    |(?P<directive>%[A-Za-z_]+)
    |(?P<name>[A-Za-z_][A-Za-z_0-9]*)
    |(?P<newline>\n)
    |(?P<bar>\|)
    |(?P<brace>\{)
    |(?P<other>[^\sA-Za-z_"/<%|{]+|<|\s)""",
    re.VERBOSE,
)
_LARK_DEFINITION = re.compile(
    r"[ \t]*[?!]?([A-Za-z_][A-Za-z_0-9]*)(\[[^\]\n]*\])?(\.-?\d+)?[ \t]*:"
)


def check_lark(grammar: str, where: str = "grammar") -> None:
    """GrammarBoundError for a Lark grammar whose rules chain deeper than
    MAX_GRAMMAR_RULE_DEPTH, a rule with more than MAX_RULE_ALTERNATIVES alternatives, a regex
    terminal that unrolls too far, or an embedded %json schema beyond check_schema's bounds."""
    bodies: dict[str, list[str]] = {}
    alternatives: dict[str, int] = {}
    current: str | None = None
    pos, n = 0, len(grammar)
    at_line_start = True
    while pos < n:
        if at_line_start:
            m = _LARK_DEFINITION.match(grammar, pos)
            if m is not None:
                current = name = m.group(1)
                bodies.setdefault(name, [])
                alternatives[name] = alternatives.get(name, 0) + 1
                pos = m.end()
            at_line_start = False
            continue
        m = _LARK_TOKEN.match(grammar, pos)
        if m is None:  # a lone quote or slash: the library reports the syntax error
            pos += 1
            continue
        kind = m.lastgroup
        pos = m.end()
        if kind == "newline":
            at_line_start = True
        elif kind == "name" and current is not None:
            bodies[current].append(m.group())
        elif kind == "bar" and current is not None:
            alternatives[current] += 1
            if alternatives[current] > MAX_RULE_ALTERNATIVES:
                raise GrammarBoundError(
                    f"{where}: rule {current} has more than {MAX_RULE_ALTERNATIVES:,} alternatives"
                )
        elif kind == "regex":
            body = m.group()
            check_regex(body[1 : body.rindex("/")], f"{where}: a regex of rule {current}")
        elif kind in ("brace", "directive"):
            pos = _skip_json_argument(grammar, pos if kind == "directive" else m.start(), where)
    depth = longest_chain(list(bodies), lambda name: [ref for ref in bodies[name] if ref in bodies])
    if depth > MAX_GRAMMAR_RULE_DEPTH:
        raise GrammarBoundError(
            f"{where}: its rules refer to one another {depth:,} deep, more than "
            f"{MAX_GRAMMAR_RULE_DEPTH}: inline the chain of rules"
        )


def _skip_json_argument(grammar: str, pos: int, where: str) -> int:
    """Past the JSON object that follows a directive (%json {...}, %llguidance {...}) or stands
    at `pos`; an embedded schema is checked as a schema."""
    start = pos
    while start < len(grammar) and grammar[start] in " \t":
        start += 1
    if start >= len(grammar) or grammar[start] != "{":
        return pos
    try:
        value, end = json.JSONDecoder().raw_decode(grammar, start)
    except RecursionError:
        raise GrammarBoundError(f"{where}: an embedded JSON value nests too deep") from None
    except ValueError:
        return start + 1  # not JSON: the library reports it
    check_schema(value, f"{where}: an embedded JSON schema")
    return end
