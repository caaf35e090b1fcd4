"""The Kubernetes API emulator the operator tests run against, and helpers to drive it.

kmock stores objects, serves list/watch streams and records every request, so the tests count
the operator's writes exactly. It is extended here with what the operator relies on from a real
API server: uid, resourceVersion, metadata.generation bumped by spec changes, generateName, the
status subresource (status written only through /status), and server-side apply creating what
does not exist. Patches of any kind are merged, which is what server-side apply amounts to for
an object whose fields all belong to the operator.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import datetime
import inspect
import itertools
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

import aiohttp.web
import kmock
import kopf
import yaml
from kubernetes_asyncio import client

from kvfleet.operator.config import OperatorConfig
from kvfleet.operator.kube import (
    BACKOFFS_S,
    WRITE_BACKOFF_CAP_S,
    WRITE_BACKOFF_FIRST_S,
    Connection,
    Kube,
)
from kvfleet.operator.main import build_registry, build_settings
from kvfleet.operator.rbac import OPERATOR_RULES, PolicyRule, allows
from kvfleet.operator.resources import common_labels

ROOT = Path(__file__).resolve().parents[2]
NS = "team-a"
CONFIG = OperatorConfig(engine_image="registry/engine:1", router_image="registry/operator:1")
ISVCS = "kvfleet.dev/v1alpha1/inferenceservices"
DEPLOYMENTS = "apps/v1/deployments"
SERVICES = "v1/services"
CONFIGMAPS = "v1/configmaps"
PODS = "v1/pods"
EVENTS = "v1/events"
SLICES = "discovery.k8s.io/v1/endpointslices"
PDBS = "policy/v1/poddisruptionbudgets"
# resource -> (kind, namespaced, subresources): what the operator and the router read and write.
RESOURCES = {
    ISVCS: ("InferenceService", True, {"status", "scale"}),
    DEPLOYMENTS: ("Deployment", True, {"status", "scale"}),
    SERVICES: ("Service", True, {"status"}),
    CONFIGMAPS: ("ConfigMap", True, set()),
    "v1/serviceaccounts": ("ServiceAccount", True, set()),
    "rbac.authorization.k8s.io/v1/roles": ("Role", True, set()),
    "rbac.authorization.k8s.io/v1/rolebindings": ("RoleBinding", True, set()),
    PDBS: ("PodDisruptionBudget", True, {"status"}),
    PODS: ("Pod", True, {"status"}),
    SLICES: ("EndpointSlice", True, set()),
    EVENTS: ("Event", True, set()),
    "v1/namespaces": ("Namespace", False, set()),
}
WRITES = {"POST", "PATCH", "PUT", "DELETE"}
T = TypeVar("T")


def _merge(base: Any, patch: Any) -> Any:
    if not isinstance(base, dict) or not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(base)
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = _merge(base.get(key), value)
    return out


class Injected(Protocol):
    """What APIServer.inject takes: asked about each request before it is served, an answer to
    send instead, or None to serve it; a coroutine may first hold the request (a slow API
    server)."""

    def answer(
        self, request: kmock.Request
    ) -> aiohttp.web.StreamResponse | Awaitable[aiohttp.web.StreamResponse | None] | None: ...


InjectedT = TypeVar("InjectedT", bound=Injected)


def is_watch(request: kmock.Request) -> bool:
    return request.params.get("watch") == "true"


@dataclass
class Fault:
    """Requests `method path` are answered with `status` `times` times (None: every time), before
    the emulator stores anything; the n-th answer's message is message(n). `watch`: only watch
    requests (True), only the others (False), or both (None)."""

    method: str
    path: str
    status: int
    times: int | None = 1
    message: Callable[[int], str] = lambda n: f"injected fault #{n}"
    headers: dict[str, str] = field(default_factory=dict)
    watch: bool | None = None
    hits: int = 0

    def answer(self, request: kmock.Request) -> aiohttp.web.Response | None:
        if (request.method.value, request.url.path) != (self.method, self.path):
            return None
        if self.watch is not None and is_watch(request) != self.watch:
            return None
        if self.times is not None and self.hits >= self.times:
            return None
        self.hits += 1
        status = {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                  "message": self.message(self.hits), "code": self.status}  # fmt: skip
        return aiohttp.web.json_response(status, status=self.status, headers=self.headers)


class _DroppedStream(aiohttp.web.StreamResponse):
    """A watch answered 200 whose connection drops after part of an event."""

    async def prepare(self, request: aiohttp.web.BaseRequest) -> Any:
        writer = await super().prepare(request)
        await self.write(b'{"type": "ADDED", "object": {"metadata": ')
        if request.transport is not None:
            request.transport.abort()
        return writer


@dataclass
class EndedWatch:
    """Watch requests of `path` are answered 200 and the stream ends at once with no event, as
    an API server under load or a proxy in front of it may do; with `dropped`, the connection
    drops after part of an event instead; with `error`, the stream holds that one ERROR event
    (a Status) before it ends. While `active`; `hits` counts them."""

    path: str
    dropped: bool = False
    error: dict[str, Any] | None = None
    active: bool = True
    hits: int = 0

    def answer(self, request: kmock.Request) -> aiohttp.web.StreamResponse | None:
        if not self.active or request.url.path != self.path or not is_watch(request):
            return None
        self.hits += 1
        if self.dropped:
            return _DroppedStream(headers={"Content-Type": "application/json"})
        event = [json.dumps({"type": "ERROR", "object": self.error})] if self.error else []
        return aiohttp.web.Response(text="".join(event), content_type="application/json")


class APIServer(kmock.KubernetesEmulator):
    _versions = itertools.count(1)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.faults: list[Injected] = []
        # When each request came (time.monotonic()), by its id.
        self.arrived: dict[int, float] = {}
        self._in_flight: set[int] = set()  # id() of the requests not answered yet
        self._streaming: set[int] = set()  # id() of the watches whose stream has started
        # When a list: each request moves those answered before it out of kmock's log into it
        # (forget_served), for runs too long for kmock's log.
        self.served: list[kmock.Request] | None = None
        # Seconds without an event after which a watch that allows bookmarks gets one, as a
        # real API server sends them (about every minute); None: never, kmock's own behaviour.
        self.bookmark_every: float | None = None
        self._pumps: set[asyncio.Task[None]] = set()  # the open watch streams' (end_watches)

    def inject(self, fault: InjectedT) -> InjectedT:
        self.faults.append(fault)
        return fault

    def forget_served(self) -> list[kmock.Request]:
        """Take the requests answered so far out of kmock's log, and return them.

        kmock finds the reaction to each request by walking its whole log, so a run of many
        thousand requests (a soak) slows down as the square of their number; one that takes
        them out as it goes keeps each request's cost flat. A request not yet given to its
        reaction (one held by a fault) stays, for kmock to find it there; a watch whose stream
        has started is taken out as served."""
        log: list[kmock.Request] = self._requests
        waiting = self._in_flight - self._streaming
        served = [r for r in log if id(r) not in waiting]
        log[:] = [r for r in log if id(r) in waiting]
        return served

    async def _serve_watch(self, request: kmock.Request) -> AsyncIterator[Any]:
        self._streaming.add(id(request))
        asked = bool(request.params.get("allowWatchBookmarks"))
        try:
            async for event in self._with_bookmarks(
                request, self.bookmark_every if asked else None
            ):
                yield event
        finally:
            self._streaming.discard(id(request))

    def end_watches(self) -> None:
        """End every open watch stream, as an API server or a proxy in front of it does; the
        clients' next watches are answered with every object again, as a relist is."""
        for pumping in self._pumps:
            pumping.cancel()

    async def _with_bookmarks(
        self, request: kmock.Request, every: float | None
    ) -> AsyncIterator[Any]:
        """kmock's watch stream, with a BOOKMARK whenever ``every`` seconds pass without an
        event (None: never), until end_watches."""
        events: asyncio.Queue[Any] = asyncio.Queue()
        end = object()

        async def pump() -> None:
            try:
                async for event in super(APIServer, self)._serve_watch(request):
                    events.put_nowait(event)
            except asyncio.CancelledError:
                pass  # end_watches, or the stream's consumer is gone
            except Exception as e:
                events.put_nowait(e)
            events.put_nowait(end)

        pumping = asyncio.create_task(pump())
        self._pumps.add(pumping)
        try:
            while True:
                try:
                    event = await asyncio.wait_for(events.get(), every)
                except TimeoutError:
                    version = {"resourceVersion": str(next(self._versions))}
                    event = {"type": "BOOKMARK", "object": {"metadata": version}}
                if event is end:
                    return
                if isinstance(event, Exception):
                    raise event
                yield event
        finally:
            self._pumps.discard(pumping)
            pumping.cancel()

    async def _handle(self, request: kmock.Request) -> Any:
        self.arrived[request.id] = time.monotonic()
        # Before any await: kmock logged it just before calling this.
        self._in_flight.add(id(request))
        if self.served is not None:
            self.served += self.forget_served()
        try:
            for fault in self.faults:
                response = fault.answer(request)
                if inspect.isawaitable(response):
                    response = await response
                if response is not None:
                    return response
            if request.resource is not None and isinstance(request.data, dict):
                self._stamp(request)
            return await super()._handle(request)
        finally:
            self._in_flight.discard(id(request))

    def _stamp(self, request: kmock.Request) -> None:
        data = request.data
        meta = data.setdefault("metadata", {})
        version = str(next(self._versions))
        created = {
            "uid": str(uuid.uuid4()),
            "resourceVersion": version,
            "generation": 1,
            "creationTimestamp": datetime.datetime.now(datetime.UTC).isoformat(),
        }
        current = self.live(request.resource, request.namespace, request.name)
        applied = "apply-patch" in request.headers.get("Content-Type", "")
        if request.action == kmock.action.CREATE:
            if "name" not in meta and "generateName" in meta:
                meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
            meta |= created
        elif request.action == kmock.action.UPDATE and applied and current is None:
            # Server-side apply creates what does not exist yet.
            self.objects[request.resource, request.namespace, request.name] = {}
            meta |= created
        elif request.action == kmock.action.UPDATE and current is not None:
            if request.subresource == "status":
                status = data.get("status")
                data.clear()
                data["status"] = status
                meta = data.setdefault("metadata", {})
            else:
                data.pop("status", None)
            meta["resourceVersion"] = version
            spec = current.get("spec")
            if "spec" in data and _merge(spec, data["spec"]) != spec:
                meta["generation"] = current["metadata"].get("generation", 1) + 1

    def change_unwatched(
        self, resource: str, namespace: str, name: str, patch: dict[str, Any]
    ) -> None:
        """Merge `patch` into a stored object with a new resourceVersion (and generation, for a
        spec) but no watch event: a change made while no watch was open."""
        obj = self.objects[resource, namespace, name]
        meta = {"resourceVersion": str(next(self._versions))}
        if "spec" in patch:
            meta["generation"] = obj.raw["metadata"].get("generation", 1) + 1
        obj.patch(_merge(patch, {"metadata": meta}))

    def live(self, resource: Any, namespace: str | None, name: str | None) -> dict[str, Any] | None:
        wanted = _resource(resource)
        for (res, ns, n), obj in self.objects.items():
            if ns == namespace and n == name and res == wanted and not obj.deleted:
                return obj.raw
        return None

    def every(self, resource: str) -> list[dict[str, Any]]:
        wanted = _resource(resource)
        return [
            obj.raw
            for (res, _, _), obj in self.objects.items()
            if res == wanted and not obj.deleted
        ]


def _resource(resource: Any) -> Any:
    """kmock's resource for "group/version/plural", parsed once: kmock parses a string again
    at each comparison with its own, which made the lookups of a long run its slowest part."""
    return kmock.resource(resource) if isinstance(resource, str) else resource


@contextlib.asynccontextmanager
async def emulated_cluster(namespace: str = NS) -> AsyncIterator[APIServer]:
    """The emulator serving RESOURCES on 127.0.0.1 (its ``url``), ``namespace`` created."""
    async with APIServer() as k, kmock.Server(k):
        for resource, (kind, namespaced, subresources) in RESOURCES.items():
            k.resources[resource] = kmock.ResourceInfo(
                kind=kind,
                namespaced=namespaced,
                subresources=subresources,
                verbs={"get", "list", "watch", "create", "patch", "update", "delete"},
            )
        # Set directly: kmock cannot parse the cluster-scoped URL of namespaces.
        k.objects["v1/namespaces", None, namespace] = {"metadata": {"name": namespace}}
        yield k


def write_kubeconfig(path: Path, server: str) -> Path:
    """A kubeconfig for the emulator at ``server``, readable by a container's other uid."""
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "kmock", "cluster": {"server": server}}],
                # The emulator checks no credentials; the clients want some.
                "users": [{"name": "test", "user": {"token": "unused"}}],
                "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "test"}}],
                "current-context": "kmock",
            }
        )
    )
    path.chmod(0o644)
    return path


# run_operator's failure when kopf has not stopped 30 s after its stop flag was set.
OPERATOR_WEDGED = "the operator did not stop within 30 s"


@contextlib.asynccontextmanager
async def run_operator(
    registry: kopf.OperatorRegistry,
    settings: kopf.OperatorSettings,
    namespaces: list[str] | None = None,
    liveness_endpoint: str | None = None,
) -> AsyncIterator[None]:
    """The operator in a thread of its own, with its own event loop, as in its own process: on
    exit kopf waits for and cancels every task of its loop, which must not include kmock's.
    With liveness_endpoint, kopf serves /healthz there."""
    stop, ready = threading.Event(), threading.Event()
    failure: list[BaseException] = []

    def run() -> None:
        try:
            asyncio.run(
                kopf.operator(
                    registry=registry,
                    settings=settings,
                    clusterwide=not namespaces,
                    namespaces=namespaces or [],
                    stop_flag=stop,
                    ready_flag=ready,
                    liveness_endpoint=liveness_endpoint,
                )
            )
        except BaseException as e:
            failure.append(e)

    # A daemon: a kopf that never stops (see OPERATOR_WEDGED) must not keep pytest from exiting.
    thread = threading.Thread(target=run, name="operator", daemon=True)
    thread.start()
    try:
        assert await asyncio.to_thread(ready.wait, 30)
        yield
    finally:
        stop.set()
        # Generous: on a loaded 2-core machine kopf takes seconds to cancel its tasks.
        await asyncio.to_thread(thread.join, 30)
    assert not thread.is_alive(), OPERATOR_WEDGED
    assert not failure, failure


@contextlib.asynccontextmanager
async def operator(
    k: APIServer, config: OperatorConfig = CONFIG, namespaces: list[str] | None = None
) -> AsyncIterator[None]:
    settings = build_settings()
    registry = build_registry(settings, config, debounce=0.02, backoff=0.2, kube=kube_for(k))
    async with run_operator(registry, settings, namespaces):
        yield


def kube_for(k: APIServer, scale: float = 1.0) -> Kube:
    """The operator's client, and so kopf, pointed at the emulator; its retry delays and its
    writes' backoff times ``scale`` (a test's autoscaling interval over the production one
    keeps their proportions)."""

    async def connect() -> Connection:
        return Connection(client.Configuration(host=str(k.url).rstrip("/")), "kmock")

    backoffs = tuple(delay * scale for delay in BACKOFFS_S)
    write_backoff = (WRITE_BACKOFF_FIRST_S * scale, WRITE_BACKOFF_CAP_S * scale)
    return Kube(connect, backoffs=backoffs, write_backoff=write_backoff)


async def api(k: APIServer, method: str, url: str, body: Any = None) -> Any:
    """A request as a person with kubectl would make it (not counted as the operator's)."""
    async with k.request(method, url, json=body) as resp:
        assert resp.status < 400, await resp.text()
        return await resp.json()


def url(resource: str, name: str | None = None, sub: str | None = None) -> str:
    group_version, plural = resource.rsplit("/", 1)
    root = "/api/v1" if group_version == "v1" else f"/apis/{group_version}"
    return "/".join(p for p in (f"{root}/namespaces/{NS}/{plural}", name, sub) if p)


def example(name: str) -> dict[str, Any]:
    docs = yaml.safe_load_all((ROOT / "examples" / name).read_text())
    return next(d for d in docs if d["kind"] == "InferenceService")


LLAMA = example("inferenceservice-llama-3.1-8b.yaml")
DEMO = example("inferenceservice-cpu-demo.yaml")
QWEN_TP2 = example("inferenceservice-qwen2.5-32b-tp2.yaml")


async def eventually(check: Callable[[], T], timeout: float = 10.0) -> T:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not (result := check()):
        if loop.time() > deadline:
            raise AssertionError(f"not reached in {timeout}s: {check.__doc__ or check}")
        await asyncio.sleep(0.02)
    return result


def from_operator(request: kmock.Request) -> bool:
    """kopf's own requests (watches, events, peering) and those of the operator's client."""
    return request.headers.get("User-Agent", "").startswith(("kopf/", "kvfleet-operator/"))


def by_operator(k: APIServer, since: int = 0) -> list[kmock.Request]:
    return [r for r in list(k)[since:] if from_operator(r)]


def writes(k: APIServer, since: int = 0) -> list[str]:
    return [f"{r.method.value} {r.url.path}" for r in by_operator(k, since) if r.method in WRITES]


async def settled(k: APIServer, quiet: float = 0.3) -> None:
    """Wait until the operator has stopped talking to the API server."""
    count = -1
    while count != len(k):
        count = len(k)
        await asyncio.sleep(quiet)


async def reconciled_after(k: APIServer, mark: int, name: str) -> None:
    """Wait for a full reconcile of `name` that started after request number `mark`: it ends
    by listing the pods, then may patch the status."""

    def listed_pods() -> bool:
        return any(
            r.method == "GET"
            and r.url.path == url(PODS)
            and r.params.get("labelSelector") == f"kvfleet.dev/inferenceservice={name}"
            for r in by_operator(k, mark)
        )

    await eventually(listed_pods)
    await settled(k)


def condition(obj: dict[str, Any] | None, ctype: str) -> dict[str, Any]:
    for cond in (obj or {}).get("status", {}).get("conditions", []):
        if cond["type"] == ctype:
            return cond
    return {}


def assert_rbac_covers(k: APIServer, rules: tuple[PolicyRule, ...] = OPERATOR_RULES) -> None:
    """Every API call the operator made is permitted by the ClusterRole of rbac.py."""
    verbs = {"POST": "create", "PATCH": "patch", "PUT": "update", "DELETE": "delete"}
    for r in by_operator(k):
        if r.resource is None or r.resource.plural is None:
            continue  # discovery: non-resource URLs every authenticated user may read
        resource = r.resource.plural + (f"/{r.subresource}" if r.subresource else "")
        if r.method == "GET":
            verb = "watch" if r.params.get("watch") == "true" else "get" if r.name else "list"
        else:
            verb = verbs[r.method.value]
        assert allows(rules, r.resource.group, resource, verb), (r.method, r.url.path)


async def add_ready_pod(k: APIServer, isvc: str, component: str, port: int) -> str:
    """A Ready pod of the engine or the router of `isvc`, reached at 127.0.0.1:`port` (its
    container port named http)."""
    name = f"{isvc}-{component}-{port}"
    await api(k, "post", url(PODS), {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NS, "labels": common_labels(isvc, component)},
        "spec": {"containers": [{"name": component, "image": "x",
                                 "ports": [{"name": "http", "containerPort": port}]}]},
        "status": {"podIP": "127.0.0.1", "phase": "Running",
                   "conditions": [{"type": "Ready", "status": "True"}]},
    })  # fmt: skip
    return name


async def create(k: APIServer, isvc: dict[str, Any], name: str | None = None) -> dict[str, Any]:
    body = copy.deepcopy(isvc)
    body["metadata"] = {"name": name or isvc["metadata"]["name"], "namespace": NS}
    return await api(k, "post", url(ISVCS), body)


def children_of(k: APIServer, name: str) -> dict[str, dict[str, Any]]:
    found = {}
    for (res, ns, n), obj in k.objects.items():
        if ns == NS and not obj.deleted and res != ISVCS and res != EVENTS:
            labels = obj.raw.get("metadata", {}).get("labels", {})
            if labels.get("kvfleet.dev/inferenceservice") == name:
                found[f"{obj.raw['kind']}/{n}"] = obj.raw
    return found


def child_names(name: str, *, download: bool = False) -> set[str]:
    """The children of InferenceService `name` ("Kind/name"); download: an hf:// source's
    ConfigMap too."""
    names = {
        f"ServiceAccount/{name}-router",
        f"Role/{name}-router",
        f"RoleBinding/{name}-router",
        f"Service/{name}-engine",
        f"PodDisruptionBudget/{name}-engine",
        f"Deployment/{name}-engine",
        f"PodDisruptionBudget/{name}-router",
        f"Deployment/{name}-router",
        f"Service/{name}",
    }
    return names | ({f"ConfigMap/{name}-model-download"} if download else set())


LLAMA_CHILDREN = child_names("llama", download=True)
