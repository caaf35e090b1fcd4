"""spec.engine.runner: the engine's --runner (generate, or pooling for an embedding model), set
by the operator when given (extraArgs may not set it), its values the engine's in the model and
the CRD alike."""

from __future__ import annotations

import typing
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvfleet.engine.engine_args import EngineArgs
from kvfleet.operator.command_lines import engine_args
from kvfleet.operator.spec import MANAGED_FLAGS, SpecError, parse_spec
from kvfleet.telemetry.ports import ENGINE_PORT

ROOT = Path(__file__).resolve().parents[2]


def _runner(raw: dict[str, Any]) -> str | None:
    args = engine_args(parse_spec("llm", raw), None, port=ENGINE_PORT)
    return args[args.index("--runner") + 1] if "--runner" in args else None


def test_the_field_becomes_the_flag_and_extra_args_cannot_set_it() -> None:
    assert _runner({"engine": {"runner": "pooling"}}) == "pooling"
    assert _runner({"engine": {"runner": "generate"}}) == "generate"
    assert _runner({}) is None  # the engine chooses from the checkpoint
    assert "--runner" in MANAGED_FLAGS
    for extra in (["--runner", "pooling"], ["--runner=pooling"], ["--run"]):
        with pytest.raises(SpecError, match="a flag the operator manages"):
            parse_spec("llm", {"engine": {"extraArgs": extra}})
    for bad in ("auto", "embed", 1):
        with pytest.raises(SpecError, match="runner"):
            parse_spec("llm", {"engine": {"runner": bad}})
    # The pooler's own setting stays an extra argument.
    args = engine_args(
        parse_spec("llm", {"engine": {"runner": "pooling", "extraArgs": ["--pooling-type=MEAN"]}}),
        None,
        port=ENGINE_PORT,
    )
    assert args[-1] == "--pooling-type=MEAN"


def test_the_values_are_the_engines_in_the_crd() -> None:
    engine_values = set(typing.get_args(EngineArgs.model_fields["runner"].annotation)) - {"auto"}
    for path in ("crds", "charts/kvfleet/crds"):
        crd = yaml.safe_load((ROOT / path / "inferenceservices.kvfleet.dev.yaml").read_text())
        schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
        field = schema["properties"]["spec"]["properties"]["engine"]["properties"]["runner"]
        assert set(field["enum"]) == engine_values and "default" not in field
