"""`kvfleet-operator run --log-format json`: the operator's lines and kopf's own, its
per-object ones included, are each one JSON object, the latter naming their object."""

from __future__ import annotations

import logging

import pytest

from kvfleet.operator.main import build_parser
from tests.support.kmock import LLAMA, LLAMA_CHILDREN, children_of, create, eventually, operator
from tests.support.logs import captured_logs, json_lines


def test_run_takes_the_log_flags_after_the_subcommand():
    ns = build_parser().parse_args(["run", "--log-format", "json", "--log-level", "debug"])
    assert (ns.log_format, ns.log_level) == ("json", "DEBUG")
    assert build_parser().parse_args(["run"]).log_format == "text"


@pytest.mark.asyncio
async def test_kopf_and_the_operator_log_json_lines(cluster):
    # main() keeps kopf's per-object lines to warnings (and an earlier test in this process may
    # have run it): here they are wanted, at any level, to check their shape.
    per_object = logging.getLogger("kopf.objects")
    level = per_object.level
    per_object.setLevel(logging.NOTSET)
    try:
        with captured_logs("json", "DEBUG") as stream:
            async with operator(cluster):
                await create(cluster, LLAMA, "llama")
                await eventually(lambda: set(children_of(cluster, "llama")) == LLAMA_CHILDREN)
    finally:
        per_object.setLevel(level)
    lines = json_lines(stream)
    loggers = {e["logger"] for e in lines}
    assert any(name.startswith("kopf.") for name in loggers), loggers
    assert any(name.startswith("kvfleet.operator") for name in loggers), loggers
    about_llama = [e for e in lines if e.get("object", {}).get("name") == "llama"]
    assert about_llama and all(e["logger"].startswith("kopf.objects") for e in about_llama)
    for entry in lines:
        assert {"time", "level", "logger", "message"} <= entry.keys()
