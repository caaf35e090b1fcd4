"""The --help of every command and subcommand (kvfleet-engine, its serve and generate,
kvfleet-router, kvfleet-operator, its run and print-rbac) reads as plain text, every option and
subcommand has a help line, and every option with a default shows the parser's real one; the
engine's parser is built without importing torch or the engine."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys

import pytest

from kvfleet.engine.cli import build_parser as engine_parser
from kvfleet.operator.main import build_parser as operator_parser
from kvfleet.router.main import build_parser as router_parser

# reStructuredText (and Markdown) markup: literals, roles, references.
_MARKUP = re.compile(r"`|:(class|func|meth|mod|attr|ref|doc|data|obj|envvar|option):")
_SHOWN_DEFAULT = re.compile(r"default: ")


def _parsers(
    parser: argparse.ArgumentParser, parent: argparse.ArgumentParser | None = None
) -> list[tuple[argparse.ArgumentParser, argparse.ArgumentParser | None]]:
    found = [(parser, parent)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found += _parsers(sub, parser)
    return found


ALL = [
    pair for build in (engine_parser, router_parser, operator_parser) for pair in _parsers(build())
]


def _squeezed(text: str) -> str:
    # argparse wraps lines, at hyphens too: compare with all whitespace removed.
    return re.sub(r"\s+", "", text)


def _unset(default: object) -> bool:
    return default is None or default == argparse.SUPPRESS or default in ([], "")


def _parent_default(parent: argparse.ArgumentParser | None, dest: str) -> object:
    actions = [] if parent is None else [a for a in parent._actions if a.dest == dest]
    return actions[0].default if actions else argparse.SUPPRESS


@pytest.mark.parametrize("parser,parent", ALL, ids=[p.prog for p, _ in ALL])
def test_help_is_plain_text_with_the_real_defaults(parser, parent) -> None:
    text = parser.format_help()
    assert not _MARKUP.search(text), _MARKUP.search(text)
    formatter = parser._get_formatter()
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
            continue
        shown = formatter._expand_help(action) if action.help else ""
        name = "/".join(action.option_strings) or action.dest
        assert _squeezed(shown) in _squeezed(text), name
        default = action.default
        if default == argparse.SUPPRESS:
            # A subcommand's copy of a parent flag: the parent's value applies when it is left
            # out, so that is the one its help may name.
            default = _parent_default(parent, action.dest)
        if _unset(default):
            # No value to show: the help says in words what leaving it out means, if anything.
            assert "(default: None)" not in shown and "(default: [])" not in shown, name
            continue
        assert f"(default: {default})" in shown, f"{name}: {shown!r} lacks its default {default!r}"
        assert len(_SHOWN_DEFAULT.findall(shown)) == 1, f"{name} names two defaults: {shown!r}"


def test_a_default_from_the_environment_is_the_one_shown(monkeypatch) -> None:
    monkeypatch.setenv("KVFLEET_SCRAPE_TIMEOUT", "7.5")
    run = next(p for p, _ in _parsers(operator_parser()) if p.prog.endswith(" run"))
    assert "(default: 7.5)" in " ".join(run.format_help().split())


@pytest.mark.parametrize("parser,parent", ALL, ids=[p.prog for p, _ in ALL])
def test_every_option_and_subcommand_has_a_help_line(parser, parent) -> None:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:
                assert (choice.help or "").strip(), f"{parser.prog} {choice.dest}"
        elif not isinstance(action, argparse._HelpAction):
            name = "/".join(action.option_strings) or action.dest
            assert (action.help or "").strip(), f"{parser.prog} {name} has no help"


def _engine_sub(name: str) -> argparse.ArgumentParser:
    return next(p for p, _ in _parsers(engine_parser()) if p.prog == f"kvfleet-engine {name}")


def _help_of(parser: argparse.ArgumentParser, flag: str) -> str:
    (action,) = [a for a in parser._actions if flag in a.option_strings]
    return " ".join(parser._get_formatter()._expand_help(action).split())


def test_the_defaults_that_depend_on_the_machine_say_both() -> None:
    serve = _engine_sub("serve")
    kv = _help_of(serve, "--kv-cache-memory-bytes")
    assert "on a GPU" in kv and "on the CPU: 1/64 of the memory" in kv, kv
    assert "on a GPU" in _help_of(serve, "--max-num-seqs")
    assert "on the CPU" in _help_of(serve, "--max-num-seqs")
    assert "8192 on a GPU, 512 on the CPU" in _help_of(serve, "--max-num-batched-tokens")
    assert "0.05 on the CPU, 0.001 on a GPU" in _help_of(serve, "--health-seconds-per-token")


# Modules that take seconds to import: none of them is needed to print help or refuse a flag.
HEAVY = ("torch", "transformers", "numpy", "llguidance", "gguf", "aiohttp", "tokenizers")


@pytest.mark.parametrize(
    "argv", [["--help"], ["serve", "--help"], ["generate", "--help"], ["serve", "--max-num-seq"]]
)
def test_help_and_usage_errors_import_nothing_heavy(argv: list[str]) -> None:
    """In a fresh interpreter: what `kvfleet-engine ARGV` imports before it prints and exits
    (speed is not timed here; the set of modules is what makes it fast)."""
    code = (
        "import sys\n"
        "from kvfleet.engine.cli import main\n"
        "try:\n"
        f"    main({argv!r})\n"
        "except SystemExit:\n"
        "    pass\n"
        f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r})))\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines()[-1] == "[]", run.stdout[-2000:]
