"""spec.engine.toolCallParser: the engine's --tool-call-parser, set by the operator (extraArgs may
not set it), with the engine's parser names in the model, the CRD and the engine alike; a change
rolls the engine out with the new flag."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvfleet.operator.config import OperatorConfig
from kvfleet.operator.engine_flags import TOOL_CALL_PARSERS
from kvfleet.operator.resources import Owner, build_children
from kvfleet.operator.spec import MANAGED_FLAGS, SpecError, parse_spec
from kvfleet.protocol import tool_prompt
from tests.support.kmock import (
    DEMO,
    DEPLOYMENTS,
    ISVCS,
    NS,
    api,
    create,
    eventually,
    operator,
    settled,
    url,
)

ROOT = Path(__file__).resolve().parents[2]
OWNER = Owner(name="llm", namespace="team-a", uid="u")
CONFIG = OperatorConfig(engine_image="registry/engine:1", router_image="registry/operator:1")


def engine_args(raw: dict[str, Any]) -> list[str]:
    children = build_children(OWNER, parse_spec("llm", raw), CONFIG)
    deploy = next(
        c for c in children if c["kind"] == "Deployment" and c["metadata"]["name"] == "llm-engine"
    )
    return deploy["spec"]["template"]["spec"]["containers"][0]["args"]


def _flag(args: list[str]) -> str | None:
    return args[args.index("--tool-call-parser") + 1] if "--tool-call-parser" in args else None


def test_the_field_becomes_the_flag_and_extra_args_cannot_set_it() -> None:
    for parser in TOOL_CALL_PARSERS:
        assert _flag(engine_args({"engine": {"toolCallParser": parser}})) == parser
    assert _flag(engine_args({})) is None  # the engine picks it from the chat template
    assert "--tool-call-parser" in MANAGED_FLAGS
    for extra in (["--tool-call-parser", "mistral"], ["--tool-call-parser=hermes"], ["--tool"]):
        with pytest.raises(SpecError, match="a flag the operator manages"):
            parse_spec("llm", {"engine": {"extraArgs": extra}})
    # The engine's other tool flags stay extraArgs.
    args = engine_args({"engine": {"extraArgs": ["--no-enable-auto-tool-choice"]}})
    assert args[-1] == "--no-enable-auto-tool-choice"
    with pytest.raises(SpecError, match="toolCallParser"):
        parse_spec("llm", {"engine": {"toolCallParser": "qwen"}})


def test_the_names_are_the_engines_in_the_model_and_the_crd() -> None:
    assert TOOL_CALL_PARSERS == tool_prompt.TOOL_CALL_PARSERS
    for path in ("crds", "charts/kvfleet/crds"):
        crd = yaml.safe_load((ROOT / path / "inferenceservices.kvfleet.dev.yaml").read_text())
        schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
        field = schema["properties"]["spec"]["properties"]["engine"]["properties"]["toolCallParser"]
        assert tuple(field["enum"]) == TOOL_CALL_PARSERS and "default" not in field


def _live_flag(k, name: str) -> str | None:
    deploy = k.live(DEPLOYMENTS, NS, f"{name}-engine")
    if deploy is None:
        return None
    return _flag(deploy["spec"]["template"]["spec"]["containers"][0]["args"])


@pytest.mark.asyncio
async def test_a_changed_parser_rolls_out(cluster):
    k = cluster
    demo = copy.deepcopy(DEMO)
    demo["spec"].setdefault("engine", {})["toolCallParser"] = "mistral"
    async with operator(k):
        await create(k, demo, "demo")
        assert await eventually(lambda: _live_flag(k, "demo")) == "mistral"
        patch = {"spec": {"engine": {"toolCallParser": "llama3_json"}}}
        await api(k, "patch", url(ISVCS, "demo"), patch)
        await eventually(lambda: _live_flag(k, "demo") == "llama3_json")
        await settled(k)
