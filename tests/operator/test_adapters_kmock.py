"""LoRA adapters under the real kopf runtime against kmock: spec.adapters reach the engine pods
through a ConfigMap and the engines' load/unload endpoints, never through the pod template."""

from __future__ import annotations

import copy
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
from aiohttp import web

from kvfleet.operator.adapters import ENGINE_START_SCRIPT
from tests.support.kmock import (
    CONFIGMAPS,
    DEMO,
    DEPLOYMENTS,
    EVENTS,
    ISVCS,
    NS,
    APIServer,
    add_ready_pod,
    api,
    condition,
    create,
    eventually,
    operator,
    url,
)

BASE = "smollm2-135m-instruct"


class FakeLoraEngine:
    """An engine's adapter endpoints, vLLM's shapes: /v1/models lists the adapters with their
    parent; loading one in ``refuse`` answers 400 with an OpenAI error."""

    def __init__(self) -> None:
        self.loaded: dict[str, str] = {}
        self.calls: list[tuple[str, str]] = []
        self.refuse: set[str] = set()
        self.port = 0
        self._runner: web.AppRunner | None = None

    async def start(self) -> FakeLoraEngine:
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/load_lora_adapter", self._load)
        app.router.add_post("/v1/unload_lora_adapter", self._unload)
        self._runner = web.AppRunner(app, shutdown_timeout=0.1)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.port = self._runner.addresses[0][1]
        return self

    async def stop(self) -> None:
        assert self._runner is not None
        await self._runner.cleanup()

    async def _models(self, _: web.Request) -> web.Response:
        data = [{"id": BASE, "object": "model", "root": "/m", "parent": None}] + [
            {"id": name, "object": "model", "root": path, "parent": BASE}
            for name, path in self.loaded.items()
        ]
        return web.json_response({"object": "list", "data": data})

    async def _load(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.calls.append(("load", body["lora_name"]))
        if body["lora_name"] in self.refuse:
            error = {"message": f"no adapter at {body['lora_path']}", "type": "BadRequestError",
                     "param": None, "code": 400}  # fmt: skip
            return web.json_response({"error": error}, status=400)
        self.loaded[body["lora_name"]] = body["lora_path"]
        return web.Response(text=f"Success: LoRA adapter '{body['lora_name']}' added")

    async def _unload(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.calls.append(("unload", body["lora_name"]))
        self.loaded.pop(body["lora_name"], None)
        return web.Response(text="Success")


@pytest_asyncio.fixture
async def engine() -> AsyncIterator[FakeLoraEngine]:
    server = await FakeLoraEngine().start()
    yield server
    await server.stop()


def with_adapters(*adapters: dict[str, Any]) -> dict[str, Any]:
    body = copy.deepcopy(DEMO)
    body["spec"]["adapters"] = list(adapters)
    return body


SQL = {"name": "sql", "source": "/adapters/sql", "rank": 8}
LEGAL = {"name": "legal", "source": "hf://org/legal-lora@v1"}


def adapter_status(k: APIServer) -> list[dict[str, Any]] | None:
    return ((k.live(ISVCS, NS, "lora") or {}).get("status") or {}).get("adapters")


@pytest.mark.asyncio
async def test_adapter_edits_load_and_unload_in_running_engines_without_a_rollout(cluster, engine):
    k = cluster
    async with operator(k):
        await create(k, with_adapters(SQL, LEGAL), "lora")
        deploy = await eventually(lambda: k.live(DEPLOYMENTS, NS, "lora-engine"))
        config = await eventually(lambda: k.live(CONFIGMAPS, NS, "lora-adapters"))
        legal_dir = "/models/adapters/org--legal-lora/v1"
        assert config["data"]["lora-modules"] == f"sql=/adapters/sql\nlegal={legal_dir}\n"
        assert json.loads(config["data"]["downloads.json"]) == [
            {"repo": "org/legal-lora", "revision": "v1", "dir": legal_dir}
        ]
        pod = deploy["spec"]["template"]["spec"]
        engine_container = pod["containers"][0]
        assert engine_container["command"][:3] == ["/bin/sh", "-c", ENGINE_START_SCRIPT]
        args = engine_container["args"]
        for flag, value in (("--max-loras", "4"), ("--max-cpu-loras", "16"),
                            ("--max-lora-rank", "16")):  # fmt: skip
            assert args[args.index(flag) + 1] == value
        assert "--enable-lora" in args and "--enable-runtime-lora-updating" in args
        assert "--lora-modules" not in args  # the ConfigMap's, at start
        assert [c["name"] for c in pod["containers"]] == ["engine", "adapter-downloader"]
        assert [c["name"] for c in pod["initContainers"]] == ["adapter-download"]
        template = copy.deepcopy(deploy["spec"]["template"])

        await add_ready_pod(k, "lora", "engine", engine.port)
        await eventually(lambda: engine.loaded == {"sql": "/adapters/sql", "legal": legal_dir})
        both = [{"name": "sql", "readyReplicas": 1}, {"name": "legal", "readyReplicas": 1}]
        await eventually(lambda: adapter_status(k) == both)

        # Edits: sql moves to another path (unloaded, loaded again), then legal goes.
        isvc = k.live(ISVCS, NS, "lora")
        moved = {**SQL, "source": "/adapters/sql-v2"}
        await api(k, "patch", url(ISVCS, "lora"), {"spec": {"adapters": [moved, LEGAL]}})
        await eventually(lambda: engine.loaded.get("sql") == "/adapters/sql-v2")
        assert engine.calls[-2:] == [("unload", "sql"), ("load", "sql")]
        calls = len(engine.calls)
        await api(k, "patch", url(ISVCS, "lora"), {"spec": {"adapters": [moved]}})
        await eventually(lambda: "legal" not in engine.loaded)
        assert engine.calls[calls:] == [("unload", "legal")]
        await eventually(lambda: adapter_status(k) == [{"name": "sql", "readyReplicas": 1}])
        assert k.live(DEPLOYMENTS, NS, "lora-engine")["spec"]["template"] == template
        assert k.live(ISVCS, NS, "lora")["metadata"]["generation"] > isvc["metadata"]["generation"]
        config = k.live(CONFIGMAPS, NS, "lora-adapters")
        assert config["data"]["lora-modules"] == "sql=/adapters/sql-v2\n"


@pytest.mark.asyncio
async def test_an_adapter_an_engine_refuses_is_degraded_with_an_event_and_retried(cluster, engine):
    k = cluster
    engine.refuse = {"broken"}
    async with operator(k):
        await create(k, with_adapters(SQL, {"name": "broken", "source": "/nowhere"}), "lora")
        await eventually(lambda: k.live(DEPLOYMENTS, NS, "lora-engine"))
        await add_ready_pod(k, "lora", "engine", engine.port)
        degraded = await eventually(
            lambda: (
                (c := condition(k.live(ISVCS, NS, "lora"), "Degraded"))
                and c["reason"] == "AdapterNotLoaded"
                and c
            )
        )
        assert "adapter broken on engine pod" in degraded["message"]
        assert "no adapter at /nowhere" in degraded["message"]
        status = adapter_status(k)
        assert status is not None and status[0] == {"name": "sql", "readyReplicas": 1}
        assert status[1]["readyReplicas"] == 0 and "/nowhere" in status[1]["message"]
        event = await eventually(
            lambda: next((e for e in k.every(EVENTS) if e["reason"] == "AdapterNotLoaded"), None)
        )
        assert event["type"] == "Warning" and "/nowhere" in event["message"]
        # The reconcile's backoff retries; once the engine can load it, it is loaded.
        tries = engine.calls.count(("load", "broken"))
        await eventually(lambda: engine.calls.count(("load", "broken")) > tries)
        engine.refuse.clear()
        await eventually(lambda: "broken" in engine.loaded)
        await eventually(
            lambda: condition(k.live(ISVCS, NS, "lora"), "Degraded")["status"] == "False"
        )


@pytest.mark.asyncio
async def test_an_invalid_adapter_is_refused_with_a_condition_and_an_event(cluster):
    k = cluster
    async with operator(k):
        # A rank over the engine's bound: the API server would refuse it; the operator too.
        await create(k, with_adapters({**SQL, "rank": 64}), "lora")
        degraded = await eventually(
            lambda: (
                (c := condition(k.live(ISVCS, NS, "lora"), "Degraded"))
                and c["reason"] == "InvalidSpec"
                and c
            )
        )
        assert "maxLoraRank" in degraded["message"]
        await eventually(lambda: any(e["reason"] == "InvalidSpec" for e in k.every(EVENTS)))
        assert k.live(DEPLOYMENTS, NS, "lora-engine") is None


@pytest.mark.asyncio
async def test_a_gated_adapters_token_reaches_its_downloader_and_only_hf_takes_one(cluster):
    k = cluster
    tenant = {"name": "tenant-hub", "key": "token"}
    async with operator(k):
        await create(k, with_adapters({**LEGAL, "hfTokenSecretRef": tenant}), "lora")
        deploy = await eventually(lambda: k.live(DEPLOYMENTS, NS, "lora-engine"))
        config = await eventually(lambda: k.live(CONFIGMAPS, NS, "lora-adapters"))
        [item] = json.loads(config["data"]["downloads.json"])
        env_name = item["token_env"]
        pod = deploy["spec"]["template"]["spec"]
        for c in pod["initContainers"] + pod["containers"][1:]:  # adapter-download(er)
            assert {
                "name": env_name,
                "valueFrom": {"secretKeyRef": {**tenant, "optional": True}},
            } in (c["env"]), c["name"]
        assert not any(e["name"] == env_name for e in pod["containers"][0].get("env", []))

        # A token on a path adapter: the API server's CEL rule refuses it, the operator too.
        await create(k, with_adapters({**SQL, "hfTokenSecretRef": tenant}), "bad")
        degraded = await eventually(
            lambda: (
                (c := condition(k.live(ISVCS, NS, "bad"), "Degraded"))
                and c["reason"] == "InvalidSpec"
                and c
            )
        )
        assert "hfTokenSecretRef is only used with hf:// sources" in degraded["message"]
        await eventually(
            lambda: any(
                e["reason"] == "InvalidSpec" and e["involvedObject"]["name"] == "bad"
                for e in k.every(EVENTS)
            )
        )
        assert k.live(DEPLOYMENTS, NS, "bad-engine") is None
