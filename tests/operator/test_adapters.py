"""The pure parts of LoRA adapters in the operator: where each adapter is in an engine pod, the
engine container's start command that reads them, and the plan that syncs a running engine."""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path
from typing import Any

import pytest

from kvfleet.operator import adapters
from kvfleet.operator.adapter_sync import (
    EngineAnswerError,
    PodAdapters,
    adapter_status,
    plan,
    served_adapters,
)
from kvfleet.operator.config import OperatorConfig
from kvfleet.operator.resources import Owner, engine_deployment
from kvfleet.operator.spec import parse_spec

OWNER = Owner(name="llm", namespace="ns", uid="u")
CONFIG = OperatorConfig(engine_image="engine:1", router_image="router:1")


def spec_with(*items: dict[str, Any], **more: object):
    return parse_spec("llm", {"adapters": list(items), **more})


def test_each_source_kind_has_its_path_and_a_claim_adds_its_volume_once() -> None:
    spec = spec_with(
        {"name": "a", "source": "hf://org/a"},
        {"name": "b", "source": "pvc://loras/b/v1"},
        {"name": "c", "source": "pvc://loras"},
        {"name": "d", "source": "/opt/d"},
        model={"source": "pvc://weights/llama"},
    )
    assert adapters.adapter_paths(spec) == {
        "a": "/models/adapters/org--a/main",
        "b": "/mnt/adapters/loras/b/v1",
        "c": "/mnt/adapters/loras",
        "d": "/opt/d",
    }
    # On the model's own claim: its mount, no second volume.
    same = spec_with({"name": "e", "source": "pvc://weights/e"}, model={"source": "pvc://weights"})
    assert adapters.adapter_paths(same) == {"e": "/mnt/model/e"}
    assert adapters.adapter_claims(same) == []
    volumes = engine_deployment(OWNER, spec, CONFIG)["spec"]["template"]["spec"]["volumes"]
    claims = [
        v["persistentVolumeClaim"]["claimName"] for v in volumes if "persistentVolumeClaim" in v
    ]
    assert claims == ["weights", "loras"]


def test_the_template_does_not_depend_on_the_adapters_names_or_hf_sources() -> None:
    def template(*items: dict[str, str]) -> object:
        return engine_deployment(OWNER, spec_with(*items), CONFIG)["spec"]["template"]

    one = template({"name": "a", "source": "/a"})
    assert one == template({"name": "b", "source": "hf://org/b@v2"}, {"name": "c", "source": "/c"})
    assert one != engine_deployment(OWNER, parse_spec("llm", {}), CONFIG)["spec"]["template"]


def test_hf_adapters_download_with_their_own_token_or_the_models() -> None:
    """Each downloader container has the model's token as HF_TOKEN and every Secret key the
    adapters name once, optional; a download item names the variable of its adapter's own."""
    tenant = {"name": "tenant-b", "key": "hub"}
    model = {"source": "hf://org/m", "hfTokenSecretRef": {"name": "hf"}}
    items = (
        {"name": "a", "source": "hf://org/a"},
        {"name": "b", "source": "hf://org/b", "hfTokenSecretRef": tenant},
        {"name": "c", "source": "hf://org/c@v2", "hfTokenSecretRef": tenant},
    )
    spec = spec_with(*items, model=model)
    ref = spec.adapters[1].hf_token_secret_ref
    assert ref is not None
    tenant_env = adapters.token_env(ref)
    assert tenant_env.startswith("HF_TOKEN_") and tenant_env.replace("_", "").isalnum()
    assert [d.get("token_env") for d in adapters.downloads(spec)] == [None, tenant_env, tenant_env]
    pod = engine_deployment(OWNER, spec, CONFIG)["spec"]["template"]["spec"]
    downloaders = [
        c
        for c in pod["initContainers"] + pod["containers"]
        if c["name"] in ("adapter-download", "adapter-downloader")
    ]
    assert len(downloaders) == 2
    for c in downloaders:
        secrets = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in c["env"] if "valueFrom" in e}
        assert secrets == {
            "HF_TOKEN": {"name": "hf", "key": "token"},
            tenant_env: {"name": "tenant-b", "key": "hub", "optional": True},
        }
    engine = next(c for c in pod["containers"] if c["name"] == "engine")
    assert not any("HF_TOKEN" in e["name"] for e in engine.get("env", []))

    def template(*items: dict[str, Any]) -> object:
        return engine_deployment(OWNER, spec_with(*items, model=model), CONFIG)["spec"]["template"]

    # Another adapter on a Secret already named: no rollout; a Secret new to the spec: one.
    assert template(*items) == template(*items[1:])
    assert template(*items) != template(items[0])


@pytest.fixture
def start(tmp_path: Path):
    """The engine container's start script with the ConfigMap at tmp_path, and a
    kvfleet-engine on PATH that prints its arguments one a line."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    engine = bin_dir / "kvfleet-engine"
    engine.write_text('#!/bin/sh\nfor a in "$@"; do echo "$a"; done\n')
    engine.chmod(0o755)
    script = adapters.ENGINE_START_SCRIPT.replace(adapters.ADAPTERS_DIR, str(tmp_path))

    def run(modules: str, *args: str) -> list[str]:
        (tmp_path / adapters.MODULES_FILE).write_text(modules)
        out = subprocess.run(
            ["/bin/sh", "-c", script, "kvfleet-engine", *args],
            capture_output=True, text=True, check=True, env={"PATH": f"{bin_dir}:/usr/bin:/bin"},
        )  # fmt: skip
        return out.stdout.splitlines()

    return run


def test_the_start_script_adds_the_adapters_whose_folder_is_there(start, tmp_path: Path) -> None:
    for name in ("sql", "g*b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "adapter_config.json").write_text("{}")
    (tmp_path / "empty").mkdir()
    modules = "".join(
        f"{name}={tmp_path}/{folder}\n"
        for name, folder in (
            ("sql", "sql"),
            ("missing", "nope"),
            ("empty", "empty"),
            ("glob", "g*b"),
        )
    )
    assert start(modules, "serve", "--port", "8000") == [
        "serve", "--port", "8000", "--lora-modules", f"sql={tmp_path}/sql", f"glob={tmp_path}/g*b",
    ]  # fmt: skip
    # None there (or none listed): no --lora-modules at all, which would want a value.
    assert start(f"missing={tmp_path}/nope\n", "serve") == ["serve"]
    assert start("", "serve") == ["serve"]


def test_the_sync_plan_reloads_a_moved_adapter_and_drops_the_unwanted() -> None:
    unload, load = plan({"a": "/a", "b": "/b2", "c": "/c"}, {"a": "/a", "b": "/b", "d": "/d"})
    assert (unload, load) == (["b", "d"], ["b", "c"])
    models = {"data": [{"id": "m", "root": "/m", "parent": None},
                       {"id": "a", "root": "/a", "parent": "m"}]}  # fmt: skip
    assert served_adapters(models) == {"a": "/a"}
    for bad in ({}, {"data": "x"}, {"data": [{"id": 1, "root": "/a", "parent": "m"}]}):
        with pytest.raises(EngineAnswerError):
            served_adapters(bad)


def test_adapter_status_counts_replicas_and_quotes_the_first_failure() -> None:
    pods = [
        PodAdapters("p1", {"a": "/a"}, {"b": "refused"}),
        PodAdapters("p2", {"a": "/a", "b": "/b"}),
        PodAdapters("p3", {}, {"a": "unreachable", "b": "unreachable"}),
    ]
    assert adapter_status(["a", "b"], pods) == [
        {"name": "a", "readyReplicas": 2, "message": "engine pod p3: unreachable"},
        {"name": "b", "readyReplicas": 1, "message": "engine pod p1: refused (and 1 more)"},
    ]


def test_with_an_api_key_an_adapter_edit_rolls_the_engines() -> None:
    """The operator cannot call the engines' adapter endpoints without the key."""

    def template(*items: dict[str, str]) -> object:
        spec = spec_with(*items, apiKeySecretRef={"name": "key"})
        return engine_deployment(OWNER, spec, CONFIG)["spec"]["template"]

    assert template({"name": "a", "source": "/a"}) != template({"name": "a", "source": "/a2"})


@pytest.mark.asyncio
async def test_an_engines_answer_is_read_within_a_byte_limit_and_a_deadline() -> None:
    """An engine's /v1/models is untrusted: too large, not JSON, or too slow is a failure of
    that pod's adapters, with the reason, never the operator's."""
    from aiohttp import web

    from kvfleet.operator.adapter_sync import MAX_BODY_BYTES, AdapterSync

    answers = {
        "large": lambda: web.Response(body=b"[" + b" " * MAX_BODY_BYTES + b"]"),
        "garbage": lambda: web.Response(text="<html>"),
    }
    mode = ["large"]

    async def models(_: web.Request) -> web.StreamResponse:
        if mode[0] == "slow":
            await asyncio.sleep(5)
        return answers[mode[0]]()

    app = web.Application()
    app.router.add_get("/v1/models", models)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    port = runner.addresses[0][1]
    pod = {
        "metadata": {"name": "p"},
        "spec": {"containers": [{"ports": [{"name": "http", "containerPort": port}]}]},
        "status": {"podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]},
    }
    sync = AdapterSync(timeout=0.5)
    try:
        for what, reason in (("large", "over"), ("garbage", "not JSON"), ("slow", "no answer")):
            mode[0] = what
            (result,) = await sync.sync([pod], {"a": "/a"})
            assert result.loaded == {} and reason in result.failures["a"], what
    finally:
        await sync.close()
        await runner.cleanup()
