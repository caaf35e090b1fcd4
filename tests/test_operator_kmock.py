"""The operator under the real kopf runtime against kmock, a Kubernetes API emulator.

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
import itertools
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, TypeVar

import kmock
import kopf
import pytest
import pytest_asyncio
import yaml

from kvfleet.operator.main import build_registry, build_settings
from kvfleet.operator.rbac import NAMESPACED_OPERATOR_RULES, OPERATOR_RULES, PolicyRule, allows
from kvfleet.operator.resources import OperatorConfig

pytestmark = pytest.mark.asyncio

ROOT = Path(__file__).resolve().parent.parent
NS = "team-a"
CONFIG = OperatorConfig(engine_image="registry/engine:1", router_image="registry/operator:1")
ISVCS = "kvfleet.dev/v1alpha1/inferenceservices"
DEPLOYMENTS = "apps/v1/deployments"
SERVICES = "v1/services"
CONFIGMAPS = "v1/configmaps"
PODS = "v1/pods"
EVENTS = "v1/events"
RESOURCES = {
    ISVCS: ("InferenceService", True, {"status", "scale"}),
    DEPLOYMENTS: ("Deployment", True, {"status", "scale"}),
    SERVICES: ("Service", True, {"status"}),
    CONFIGMAPS: ("ConfigMap", True, set()),
    "v1/serviceaccounts": ("ServiceAccount", True, set()),
    "rbac.authorization.k8s.io/v1/roles": ("Role", True, set()),
    "rbac.authorization.k8s.io/v1/rolebindings": ("RoleBinding", True, set()),
    PODS: ("Pod", True, {"status"}),
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


class APIServer(kmock.KubernetesEmulator):
    _versions = itertools.count(1)

    async def _handle(self, request: kmock.Request) -> Any:
        if request.resource is not None and isinstance(request.data, dict):
            self._stamp(request)
        return await super()._handle(request)

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

    def live(self, resource: Any, namespace: str | None, name: str | None) -> dict[str, Any] | None:
        for (res, ns, n), obj in self.objects.items():
            if res == resource and ns == namespace and n == name and not obj.deleted:
                return obj.raw
        return None

    def every(self, resource: str) -> list[dict[str, Any]]:
        return [
            obj.raw
            for (res, _, _), obj in self.objects.items()
            if res == resource and not obj.deleted
        ]


@pytest_asyncio.fixture
async def cluster() -> AsyncIterator[APIServer]:
    async with APIServer() as k, kmock.Server(k):
        for resource, (kind, namespaced, subresources) in RESOURCES.items():
            k.resources[resource] = kmock.ResourceInfo(
                kind=kind,
                namespaced=namespaced,
                subresources=subresources,
                verbs={"get", "list", "watch", "create", "patch", "update", "delete"},
            )
        # Set directly: kmock cannot parse the cluster-scoped URL of namespaces.
        k.objects["v1/namespaces", None, NS] = {"metadata": {"name": NS}}
        yield k


@contextlib.asynccontextmanager
async def run_operator(
    registry: kopf.OperatorRegistry,
    settings: kopf.OperatorSettings,
    url: str,
    namespaces: list[str] | None = None,
) -> AsyncIterator[None]:
    """The operator in a thread of its own, with its own event loop, as in its own process: on
    exit kopf waits for and cancels every task of its loop, which must not include kmock's."""

    @kopf.on.login(registry=registry)
    def login(**_: Any) -> kopf.ConnectionInfo:
        return kopf.ConnectionInfo(server=url)

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
                )
            )
        except BaseException as e:
            failure.append(e)

    thread = threading.Thread(target=run, name="operator")
    thread.start()
    try:
        assert await asyncio.to_thread(ready.wait, 10)
        yield
    finally:
        stop.set()
        await asyncio.to_thread(thread.join, 10)
    assert not thread.is_alive() and not failure, failure


@contextlib.asynccontextmanager
async def operator(
    k: APIServer, config: OperatorConfig = CONFIG, namespaces: list[str] | None = None
) -> AsyncIterator[None]:
    settings = build_settings()
    registry = build_registry(settings, config, debounce=0.02, backoff=0.2)
    async with run_operator(registry, settings, str(k.url), namespaces):
        yield


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


def by_operator(k: APIServer, since: int = 0) -> list[kmock.Request]:
    return [r for r in list(k)[since:] if r.headers.get("User-Agent", "").startswith("kopf/")]


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


LLAMA_CHILDREN = {
    "ConfigMap/llama-model-download",
    "ServiceAccount/llama-router",
    "Role/llama-router",
    "RoleBinding/llama-router",
    "Service/llama-engine",
    "Deployment/llama-engine",
    "Deployment/llama-router",
    "Service/llama",
}


async def mark_ready(k: APIServer, name: str, replicas: int) -> None:
    """Play the Deployment controller: all replicas of the current generation ready."""
    deploy = k.live(DEPLOYMENTS, NS, name)
    assert deploy is not None
    status = {
        "observedGeneration": deploy["metadata"]["generation"],
        "replicas": replicas,
        "updatedReplicas": replicas,
        "readyReplicas": replicas,
        "availableReplicas": replicas,
        "conditions": [
            {"type": "Available", "status": "True", "reason": "MinimumReplicasAvailable"},
            {"type": "Progressing", "status": "True", "reason": "NewReplicaSetAvailable"},
        ],
    }
    await api(k, "patch", url(DEPLOYMENTS, name, "status"), {"status": status})


async def test_creating_an_inference_service_creates_its_owned_children(cluster):
    k = cluster
    async with operator(k):
        llama = await create(k, LLAMA, "llama")
        demo = await create(k, DEMO, "demo")
        await eventually(lambda: set(children_of(k, "llama")) == LLAMA_CHILDREN)
        await eventually(lambda: len(children_of(k, "demo")) == 7)
        await eventually(lambda: condition(k.live(ISVCS, NS, "llama"), "Progressing"))
        await settled(k)

    llama_children = children_of(k, "llama")
    assert "ConfigMap/demo-model-download" not in children_of(k, "demo")
    for owner, objs in ((llama, llama_children), (demo, children_of(k, "demo"))):
        for obj in objs.values():
            assert obj["metadata"]["ownerReferences"] == [
                {
                    "apiVersion": "kvfleet.dev/v1alpha1",
                    "kind": "InferenceService",
                    "name": owner["metadata"]["name"],
                    "uid": owner["metadata"]["uid"],
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ]
            assert obj["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "kvfleet-operator"

    engine = llama_children["Deployment/llama-engine"]
    pod = engine["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["image"] == "registry/engine:1"
    assert container["startupProbe"]["httpGet"]["path"] == "/health"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["resources"]["requests"]["nvidia.com/gpu"] == "1"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["initContainers"][0]["name"] == "model-download"
    assert engine["spec"]["replicas"] == 1
    router = llama_children["Deployment/llama-router"]
    assert router["spec"]["template"]["spec"]["containers"][0]["image"] == "registry/operator:1"
    assert llama_children["Service/llama-engine"]["spec"]["clusterIP"] == "None"

    status = k.live(ISVCS, NS, "llama")["status"]
    assert status["url"] == "http://llama.team-a.svc/v1"
    assert status["modelName"] == "meta-llama/Llama-3.1-8B-Instruct"
    assert status["desiredReplicas"] == 1
    assert status["observedGeneration"] == 1
    assert condition(k.live(ISVCS, NS, "llama"), "Ready")["status"] == "False"
    assert condition(k.live(ISVCS, NS, "llama"), "Progressing")["status"] == "True"
    assert condition(k.live(ISVCS, NS, "llama"), "Degraded")["status"] == "False"
    assert_rbac_covers(k)


async def test_reconciling_an_unchanged_spec_writes_nothing(cluster):
    k = cluster
    async with operator(k):
        await create(k, LLAMA, "llama")
        await eventually(lambda: condition(k.live(ISVCS, NS, "llama"), "Ready"))
        await settled(k)
        assert writes(k)  # it did create things

        mark = len(k)
        # An edit that is no change to the spec: a new event, a full reconcile, no write.
        await api(k, "patch", url(ISVCS, "llama"), {"metadata": {"labels": {"team": "a"}}})
        await reconciled_after(k, mark, "llama")
        assert by_operator(k, mark)
        assert writes(k, mark) == []
    assert_rbac_covers(k)


async def test_spec_changes_roll_out_and_hand_edits_are_undone(cluster):
    k = cluster
    async with operator(k):
        await create(k, LLAMA, "llama")
        await eventually(lambda: set(children_of(k, "llama")) == LLAMA_CHILDREN)
        await settled(k)

        mark = len(k)
        patch = {"spec": {"engine": {"maxNumSeqs": 32, "dtype": "float16"}}}
        await api(k, "patch", url(ISVCS, "llama"), patch)

        def engine_args() -> list[str]:
            deploy = k.live(DEPLOYMENTS, NS, "llama-engine")
            return deploy["spec"]["template"]["spec"]["containers"][0]["args"]

        await eventually(lambda: "32" in engine_args() and "float16" in engine_args())
        await reconciled_after(k, mark, "llama")
        # Only the engine's pod template changed: one write to it, one to the status.
        assert sorted(writes(k, mark)) == [
            f"PATCH {url(DEPLOYMENTS, 'llama-engine')}",
            f"PATCH {url(ISVCS, 'llama', 'status')}",
        ]
        assert k.live(ISVCS, NS, "llama")["status"]["observedGeneration"] == 2

        await api(k, "delete", url(SERVICES, "llama"))
        await eventually(lambda: k.live(SERVICES, NS, "llama"))

        edited = copy.deepcopy(k.live(DEPLOYMENTS, NS, "llama-router")["spec"]["template"])
        edited["spec"]["containers"][0]["image"] = "someone/else:latest"
        await api(k, "patch", url(DEPLOYMENTS, "llama-router"), {"spec": {"template": edited}})

        def router_image() -> str:
            deploy = k.live(DEPLOYMENTS, NS, "llama-router")
            return deploy["spec"]["template"]["spec"]["containers"][0]["image"]

        await eventually(lambda: router_image() == "registry/operator:1")

        # hf:// to a path: the download ConfigMap is no longer needed and goes.
        await api(k, "patch", url(ISVCS, "llama"), {
            "spec": {"model": {"source": "/models/llama", "hfTokenSecretRef": None},
                     "modelCache": None}
        })  # fmt: skip
        await eventually(lambda: k.live(CONFIGMAPS, NS, "llama-model-download") is None)
        await settled(k)
    assert_rbac_covers(k)


async def test_status_follows_the_children(cluster):
    k = cluster
    async with operator(k):
        await create(k, DEMO, "demo")
        await eventually(lambda: len(children_of(k, "demo")) == 7)
        await settled(k)

        await mark_ready(k, "demo-engine", 1)
        await mark_ready(k, "demo-router", 1)
        isvc = await eventually(
            lambda: (
                (o := k.live(ISVCS, NS, "demo"))
                and condition(o, "Ready").get("status") == "True"
                and o
            )
        )
        assert (isvc["status"]["replicas"], isvc["status"]["readyReplicas"]) == (1, 1)
        assert condition(isvc, "Progressing")["status"] == "False"
        assert condition(isvc, "Degraded")["status"] == "False"

        crashing = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": "demo-engine-7d9f-x1",
                "namespace": NS,
                "labels": children_of(k, "demo")["Deployment/demo-engine"]["spec"]["template"][
                    "metadata"
                ]["labels"],
            },
            "status": {
                "containerStatuses": [
                    {
                        "name": "engine",
                        "image": "registry/engine:1",
                        "restartCount": 4,
                        "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                        "lastState": {"terminated": {"exitCode": 2, "reason": "Error"}},
                    }
                ]
            },
        }
        await api(k, "post", url(PODS), crashing)
        degraded = await eventually(
            lambda: (
                condition(k.live(ISVCS, NS, "demo"), "Degraded").get("status") == "True"
                and condition(k.live(ISVCS, NS, "demo"), "Degraded")
            )
        )
        assert degraded["reason"] == "CrashLoopBackOff"
        assert "demo-engine-7d9f-x1" in degraded["message"] and "exit code 2" in degraded["message"]

        def warning_events() -> list[dict[str, Any]]:
            return [
                e
                for e in k.every(EVENTS)
                if e["involvedObject"]["name"] == "demo" and e["type"] == "Warning"
            ]

        events = await eventually(warning_events)
        assert events[0]["reason"] == "CrashLoopBackOff"
        assert events[0]["involvedObject"]["kind"] == "InferenceService"

        await api(k, "delete", url(PODS, "demo-engine-7d9f-x1"))
        await eventually(
            lambda: condition(k.live(ISVCS, NS, "demo"), "Degraded").get("status") == "False"
        )
        await settled(k)
    assert_rbac_covers(k)


async def test_a_tensor_parallel_service_is_reconciled_like_any_other(cluster):
    k = cluster
    async with operator(k):
        await create(k, QWEN_TP2, "qwen")
        await eventually(lambda: len(children_of(k, "qwen")) == 8)
        await eventually(lambda: condition(k.live(ISVCS, NS, "qwen"), "Progressing"))
        await settled(k)

        isvc = k.live(ISVCS, NS, "qwen")
        assert condition(isvc, "Degraded")["status"] == "False"
        assert isvc["status"]["desiredReplicas"] == 1
        pod = children_of(k, "qwen")["Deployment/qwen-engine"]["spec"]["template"]["spec"]
        engine = pod["containers"][0]
        assert engine["args"][engine["args"].index("--tensor-parallel-size") + 1] == "2"
        assert engine["resources"]["limits"]["nvidia.com/gpu"] == "2"
        assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "2Gi"}} in pod[
            "volumes"
        ]
        assert {"name": "dshm", "mountPath": "/dev/shm"} in engine["volumeMounts"]

        # Reconciled again, unchanged: the /dev/shm volume is no reason to write.
        mark = len(k)
        await api(k, "patch", url(ISVCS, "qwen"), {"metadata": {"labels": {"team": "a"}}})
        await reconciled_after(k, mark, "qwen")
        assert writes(k, mark) == []

        # Removed by hand, it comes back: the operator writes the engine Deployment again.
        template = copy.deepcopy(pod)
        template["volumes"] = [v for v in pod["volumes"] if v["name"] != "dshm"]
        mark = len(k)
        await api(
            k, "patch", url(DEPLOYMENTS, "qwen-engine"), {"spec": {"template": {"spec": template}}}
        )

        def volumes() -> list[str]:
            deploy = k.live(DEPLOYMENTS, NS, "qwen-engine")
            return [v["name"] for v in deploy["spec"]["template"]["spec"]["volumes"]]

        await eventually(lambda: "dshm" in volumes())
        assert f"PATCH {url(DEPLOYMENTS, 'qwen-engine')}" in writes(k, mark)
        await settled(k)
    assert_rbac_covers(k)


INVALID = {
    # name: (spec, words of the Degraded message)
    "bad-bounds": ({"autoscaling": {"minReplicas": 3, "maxReplicas": 1}}, "minReplicas"),
    "bad-source": ({"model": {"source": "s3://bucket/m"}}, "spec.model.source"),
    "bad-field": ({"engine": {"maxTokens": 5}}, "spec.engine.maxTokens"),
    "bad-tp": (
        {"engine": {"tensorParallelSize": 2}, "resources": {"gpus": 1}},
        "tensorParallelSize",
    ),
    "bad-util": ({"engine": {"gpuMemoryUtilization": 3}}, "gpuMemoryUtilization"),
}


async def test_invalid_specs_are_reported_and_the_operator_keeps_going(cluster):
    k = cluster
    async with operator(k):
        for name, (spec, _) in INVALID.items():
            await create(
                k, {"apiVersion": DEMO["apiVersion"], "kind": DEMO["kind"], "spec": spec}, name
            )

        for name, (_, words) in INVALID.items():
            cond = await eventually(
                lambda name=name: (
                    condition(k.live(ISVCS, NS, name), "Degraded").get("status") == "True"
                    and condition(k.live(ISVCS, NS, name), "Degraded")
                )
            )
            assert cond["reason"] == "InvalidSpec"
            assert words in cond["message"]
            assert children_of(k, name) == {}

        def invalid_spec_events() -> set[str]:
            return {
                e["involvedObject"]["name"]
                for e in k.every(EVENTS)
                if e["reason"] == "InvalidSpec" and e["type"] == "Warning"
            }

        await eventually(lambda: invalid_spec_events() == set(INVALID))

        # Still running: a good one is served, and a good one gone bad keeps its children.
        await create(k, DEMO, "good")
        await eventually(lambda: len(children_of(k, "good")) == 7)
        await settled(k)
        mark = len(k)
        await api(k, "patch", url(ISVCS, "good"), {"spec": {"engine": {"dtype": "int4"}}})
        cond = await eventually(
            lambda: (
                condition(k.live(ISVCS, NS, "good"), "Degraded").get("reason") == "InvalidSpec"
                and condition(k.live(ISVCS, NS, "good"), "Degraded")
            )
        )
        assert "spec.engine.dtype" in cond["message"]
        await settled(k)
        # The status says why and an Event tells; the children are not touched.
        made = writes(k, mark)
        assert made.count(f"PATCH {url(ISVCS, 'good', 'status')}") == 1
        assert set(made) == {f"PATCH {url(ISVCS, 'good', 'status')}", f"POST {url(EVENTS)}"}
        assert len(children_of(k, "good")) == 7
    assert_rbac_covers(k)


async def test_a_restarted_operator_adopts_what_exists_without_writing(cluster):
    k = cluster
    async with operator(k):
        await create(k, LLAMA, "llama")
        await create(k, DEMO, "demo")
        await eventually(lambda: set(children_of(k, "llama")) == LLAMA_CHILDREN)
        await eventually(lambda: len(children_of(k, "demo")) == 7)
        await settled(k)
        await mark_ready(k, "demo-engine", 1)
        await mark_ready(k, "demo-router", 1)
        await eventually(
            lambda: condition(k.live(ISVCS, NS, "demo"), "Ready").get("status") == "True"
        )
        await settled(k)
    before = {name: copy.deepcopy(children_of(k, name)) for name in ("llama", "demo")}
    objects = len(k.objects)

    mark = len(k)
    async with operator(k):
        await reconciled_after(k, mark, "llama")
        await reconciled_after(k, mark, "demo")
    assert writes(k, mark) == []
    assert len(k.objects) == objects
    assert {name: children_of(k, name) for name in ("llama", "demo")} == before
    assert_rbac_covers(k)


async def test_allow_lists_keep_a_violating_service_from_rolling_out(cluster):
    """Issue 15: with allow-lists configured, a spec naming another image or Secret gets
    Degraded with the reason and a Warning Event, and nothing of it is applied."""
    k = cluster
    config = OperatorConfig(
        engine_image="registry/engine:1",
        router_image="registry/operator:1",
        allowed_images=("registry/",),
        allowed_secrets=("api-keys",),
    )
    bad_image = copy.deepcopy(DEMO)
    bad_image["spec"].setdefault("engine", {})["image"] = "docker.io/attacker/engine:1"
    bad_secret = copy.deepcopy(DEMO)
    bad_secret["spec"].setdefault("engine", {})["env"] = [
        {"name": "DB", "valueFrom": {"secretKeyRef": {"name": "db-password", "key": "p"}}}
    ]

    def degraded(name: str) -> dict[str, Any]:
        cond = condition(k.live(ISVCS, NS, name), "Degraded")
        return cond if cond.get("status") == "True" else {}

    def warnings(reason: str) -> set[str]:
        return {
            e["involvedObject"]["name"]
            for e in k.every(EVENTS)
            if e["reason"] == reason and e["type"] == "Warning"
        }

    async with operator(k, config):
        await create(k, bad_image, "bad-image")
        await create(k, bad_secret, "bad-secret")
        image = await eventually(lambda: degraded("bad-image"))
        secret = await eventually(lambda: degraded("bad-secret"))
        assert image["reason"] == "ImageNotAllowed" and "docker.io/attacker" in image["message"]
        assert secret["reason"] == "SecretNotAllowed" and "'db-password'" in secret["message"]
        await eventually(lambda: warnings("ImageNotAllowed") == {"bad-image"})
        await eventually(lambda: warnings("SecretNotAllowed") == {"bad-secret"})
        assert children_of(k, "bad-image") == {} and children_of(k, "bad-secret") == {}
        assert k.live(DEPLOYMENTS, NS, "bad-image-engine") is None

        # An allowed spec is served; changed to a forbidden image, it keeps what it has.
        good = copy.deepcopy(DEMO)
        good["spec"].setdefault("engine", {})["image"] = "registry/engine:2"
        await create(k, good, "good")
        await eventually(lambda: len(children_of(k, "good")) == 7)
        await settled(k)
        mark = len(k)
        patch = {"spec": {"routing": {"image": "docker.io/attacker/router:1"}}}
        await api(k, "patch", url(ISVCS, "good"), patch)
        cond = await eventually(lambda: degraded("good"))
        assert cond["reason"] == "ImageNotAllowed" and "spec.routing.image" in cond["message"]
        await settled(k)
        assert set(writes(k, mark)) == {
            f"PATCH {url(ISVCS, 'good', 'status')}",
            f"POST {url(EVENTS)}",
        }
        router = k.live(DEPLOYMENTS, NS, "good-router")
        assert router["spec"]["template"]["spec"]["containers"][0]["image"] == "registry/operator:1"
    assert_rbac_covers(k)


async def test_a_namespaced_operator_needs_only_its_namespaced_roles(cluster):
    """The chart's namespaced mode: the operator run with --namespace makes no cluster-scoped
    call and nothing beyond the Role of rbac.NAMESPACED_OPERATOR_RULES."""
    k = cluster
    async with operator(k, namespaces=[NS]):
        await create(k, DEMO, "demo")
        await eventually(lambda: len(children_of(k, "demo")) == 7)
        await eventually(lambda: condition(k.live(ISVCS, NS, "demo"), "Progressing"))
        await settled(k)
    assert_rbac_covers(k, NAMESPACED_OPERATOR_RULES)
    for r in by_operator(k):
        if r.resource is not None and r.resource.plural is not None:
            assert r.namespace == NS, (r.method, r.url.path)
