"""The controllers of a cluster that kmock's API emulator does not run, for the operator soak
(bench/operator_soak.py), cheap enough for tens of services on one CPU:

* the Deployment controller and the kubelet in one: each Deployment the operator applies gets
  ``spec.replicas`` Pods, Ready at once on 127.0.0.1, their ``http`` port a fake engine's (or
  fake router's) of their service; its status then says they are all updated and available;
* fake engines: a service's /metrics answers vLLM's gauges, the requests in flight the soak
  sets for the service (``load``) shared over its ready engine pods; a router's answers its
  held-requests gauge (0);
* the garbage collector: an object whose controlling owner is gone is deleted (a deleted
  InferenceService's children, a deleted Deployment's pods).

Every change goes through the emulator's HTTP API, so the operator's watches see it, and none
is the operator's: a fault mix that picks the operator's requests leaves these alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
from collections.abc import AsyncIterator
from typing import Any

import kmock
from aiohttp import web

from tests.support.kmock import DEPLOYMENTS, EVENTS, NS, PODS, APIServer, url

logger = logging.getLogger("kvfleet.bench.cluster_sim")

COMPONENT = "app.kubernetes.io/component"
SERVICE = "kvfleet.dev/inferenceservice"
TICK_S = 0.5
# kmock's own resources: compared with its keys far faster than strings, which it parses anew.
_DEPLOYMENTS, _EVENTS, _PODS = (kmock.resource(r) for r in (DEPLOYMENTS, EVENTS, PODS))


async def send(k: APIServer, method: str, path: str, body: Any = None) -> Any:
    """A request as a controller or a user makes it (PATCH: a merge patch); None when its object
    is gone or exists already (a race with the operator, settled by the next try)."""
    headers = {"Content-Type": "application/merge-patch+json"} if method == "patch" else {}
    async with k.request(method, path, json=body, headers=headers) as resp:
        if resp.status in (404, 409):
            return None
        if resp.status >= 400:
            raise RuntimeError(f"{method} {path}: HTTP {resp.status}: {await resp.text()}")
        return await resp.json()


def resource_key(resource: Any) -> str:
    """A kmock resource as "group/version/plural"."""
    return "/".join(p for p in (resource.group, resource.version, resource.plural) if p)


def controller_uid(obj: dict[str, Any]) -> str | None:
    for ref in obj.get("metadata", {}).get("ownerReferences") or []:
        if ref.get("controller"):
            return ref.get("uid")
    return None


def deployment_status(deployment: dict[str, Any], pods: int) -> dict[str, Any]:
    """A Deployment's status once its controller has rolled out ``pods`` ready pods."""
    return {
        "observedGeneration": deployment["metadata"].get("generation", 1),
        "replicas": pods,
        "updatedReplicas": pods,
        "readyReplicas": pods,
        "availableReplicas": pods,
        "conditions": [
            {"type": "Available", "status": "True", "reason": "MinimumReplicasAvailable"},
            {"type": "Progressing", "status": "True", "reason": "NewReplicaSetAvailable"},
        ],
    }


class ClusterSim:
    """Run it as a task (``run``) next to the emulator; ``close`` the fake servers after."""

    def __init__(self, k: APIServer) -> None:
        self.k = k
        self.load: dict[str, float] = {}  # requests in flight, by service
        self._engines: dict[str, int] = {}  # ready engine pods, by service
        self.errors: list[str] = []  # the simulation's own failures: the run is not valid
        self._runner: web.AppRunner | None = None
        self._ports: dict[tuple[str, str], int] = {}  # (service, component) -> port
        self._owners: dict[int, tuple[str, str]] = {}  # port -> (service, component)

    async def run(self) -> None:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app, shutdown_timeout=0.1, access_log=None)
        await self._runner.setup()
        while True:
            try:
                await self._tick()
            except Exception as e:  # reported, and the next tick tries again
                logger.exception("cluster simulation")
                self.errors.append(repr(e))
            await asyncio.sleep(TICK_S)

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    # -- the controllers ---------------------------------------------------------------------

    async def _tick(self) -> None:
        objects = [
            (res, obj.raw)
            for (res, ns, _), obj in list(self.k.objects.items())
            if ns == NS and not obj.deleted and res != _EVENTS
        ]
        uids = {o["metadata"].get("uid") for _, o in objects}
        for res, obj in objects:
            owner = controller_uid(obj)
            if owner is not None and owner not in uids:
                await send(self.k, "delete", url(resource_key(res), obj["metadata"]["name"]))
        pods: dict[str | None, list[dict[str, Any]]] = {}
        for res, obj in objects:
            if res == _PODS:
                pods.setdefault(controller_uid(obj), []).append(obj)
        for res, deployment in objects:
            if res == _DEPLOYMENTS and controller_uid(deployment) in uids:
                await self._roll_out(deployment, pods.get(deployment["metadata"]["uid"], []))

    async def _roll_out(self, deployment: dict[str, Any], pods: list[dict[str, Any]]) -> None:
        name = deployment["metadata"]["name"]
        template = deployment["spec"]["template"]
        labels = template.get("metadata", {}).get("labels") or {}
        service, component = labels.get(SERVICE, ""), labels.get(COMPONENT, "")
        want = int(deployment["spec"].get("replicas", 1))
        names = {p["metadata"]["name"] for p in pods}
        for i in range(want):
            if f"{name}-{i}" not in names:
                await self._create_pod(deployment, f"{name}-{i}", service, component)
        for pod in pods:
            index = pod["metadata"]["name"].rsplit("-", 1)[1]
            if not index.isdigit() or int(index) >= want:
                await send(self.k, "delete", url(PODS, pod["metadata"]["name"]))
        if component == "engine":
            self._engines[service] = want
        status = deployment_status(deployment, want)
        if deployment.get("status") != status:
            await send(self.k, "patch", url(DEPLOYMENTS, name, "status"), {"status": status})

    async def _create_pod(
        self, deployment: dict[str, Any], name: str, service: str, component: str
    ) -> None:
        template = deployment["spec"]["template"]
        spec = copy.deepcopy(template["spec"])
        port = await self._port(service, component)
        for container in spec.get("containers") or []:
            for p in container.get("ports") or []:
                if p.get("name") == "http":
                    p["containerPort"] = port
        meta = template.get("metadata") or {}
        meta_of = deployment["metadata"]
        owner = {"apiVersion": "apps/v1", "kind": "Deployment", "controller": True,
                 "name": meta_of["name"], "uid": meta_of["uid"]}  # fmt: skip
        body = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": NS,
                         "labels": dict(meta.get("labels") or {}), "ownerReferences": [owner]},
            "spec": spec,
        }  # fmt: skip
        if await send(self.k, "post", url(PODS), body) is None:
            return
        created = (self.k.live(PODS, NS, name) or {}).get("metadata", {})
        ready = {"type": "Ready", "status": "True",
                 "lastTransitionTime": created.get("creationTimestamp")}  # fmt: skip
        status = {"phase": "Running", "podIP": "127.0.0.1", "conditions": [ready]}
        await send(self.k, "patch", url(PODS, name, "status"), {"status": status})

    # -- the fake engines and routers --------------------------------------------------------

    async def _port(self, service: str, component: str) -> int:
        if (port := self._ports.get((service, component))) is None:
            assert self._runner is not None
            before = set(map(tuple, self._runner.addresses))
            await web.TCPSite(self._runner, "127.0.0.1", 0).start()
            (address,) = set(map(tuple, self._runner.addresses)) - before
            port = int(address[1])
            self._ports[service, component] = port
            self._owners[port] = (service, component)
        return port

    async def _metrics(self, request: web.Request) -> web.Response:
        sockname = request.transport.get_extra_info("sockname") if request.transport else None
        service, component = self._owners.get(sockname[1] if sockname else 0, ("", ""))
        if component == "router":
            body = "# TYPE kvfleet_router_held_requests gauge\nkvfleet_router_held_requests 0\n"
        else:
            running = self.load.get(service, 0.0) / max(1, self._engines.get(service, 1))
            label = '{model_name="smollm2-135m-instruct"}'
            body = "".join(
                f"# TYPE {name} gauge\n{name}{label} {value}\n"
                for name, value in (
                    ("vllm:num_requests_running", running),
                    ("vllm:num_requests_waiting", 0.0),
                    ("vllm:kv_cache_usage_perc", min(1.0, running / 16)),
                )
            )
        return web.Response(text=body, content_type="text/plain")


@contextlib.asynccontextmanager
async def simulated(k: APIServer) -> AsyncIterator[ClusterSim]:
    """The simulation running as a task for the duration of the block."""
    sim = ClusterSim(k)
    task = asyncio.create_task(sim.run(), name="cluster simulation")
    try:
        yield sim
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await sim.close()
