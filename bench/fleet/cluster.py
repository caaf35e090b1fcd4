"""The Kubernetes API the fleet runs against: kmock's emulator on a local port, with a kubeconfig
that points the real operator and router processes at it.

kmock keeps objects and serves list and watch streams; what the operator relies on beyond that
is added here: uid, resourceVersion, metadata.generation bumped by spec changes, generateName,
the status subresource (a write to /status changes the status alone, any other write leaves it),
and server-side apply creating what does not exist. Patches of any kind are merged, which is
what server-side apply amounts to for objects whose fields all belong to one writer.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import itertools
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import kmock
import yaml

ISVCS = "kvfleet.dev/v1alpha1/inferenceservices"
DEPLOYMENTS = "apps/v1/deployments"
PODS = "v1/pods"
SLICES = "discovery.k8s.io/v1/endpointslices"
# resource -> (kind, namespaced, subresources): what the operator and the router read and write.
RESOURCES = {
    ISVCS: ("InferenceService", True, {"status", "scale"}),
    DEPLOYMENTS: ("Deployment", True, {"status", "scale"}),
    "v1/services": ("Service", True, {"status"}),
    "v1/configmaps": ("ConfigMap", True, set()),
    "v1/serviceaccounts": ("ServiceAccount", True, set()),
    "rbac.authorization.k8s.io/v1/roles": ("Role", True, set()),
    "rbac.authorization.k8s.io/v1/rolebindings": ("RoleBinding", True, set()),
    PODS: ("Pod", True, {"status"}),
    SLICES: ("EndpointSlice", True, set()),
    "v1/events": ("Event", True, set()),
    "v1/namespaces": ("Namespace", False, set()),
}


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat()


def _merged(base: Any, patch: Any) -> Any:
    if not isinstance(base, dict) or not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(base)
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = _merged(base.get(key), value)
    return out


class Emulator(kmock.KubernetesEmulator):
    _versions = itertools.count(1)

    async def _handle(self, request: kmock.Request) -> Any:
        if request.resource is not None and isinstance(request.data, dict):
            self._stamp(request)
        return await super()._handle(request)

    def _stamp(self, request: kmock.Request) -> None:
        data = request.data
        meta = data.setdefault("metadata", {})
        version = str(next(self._versions))
        created = {"uid": str(uuid.uuid4()), "resourceVersion": version, "generation": 1,
                   "creationTimestamp": _now()}  # fmt: skip
        current = self.live(request.resource, request.namespace, request.name)
        if request.action == kmock.action.CREATE:
            if "name" not in meta and "generateName" in meta:
                meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
            meta |= created
        elif request.action == kmock.action.UPDATE and current is None:
            if "apply-patch" in request.headers.get("Content-Type", ""):
                # Server-side apply creates what does not exist yet.
                self.objects[request.resource, request.namespace, request.name] = {}
                meta |= created
        elif request.action == kmock.action.UPDATE:
            if request.subresource == "status":
                status = data.get("status")
                data.clear()
                data["status"] = status
                meta = data.setdefault("metadata", {})
            else:
                data.pop("status", None)
            meta["resourceVersion"] = version
            spec = current.get("spec")
            if "spec" in data and _merged(spec, data["spec"]) != spec:
                meta["generation"] = current["metadata"].get("generation", 1) + 1

    def live(self, resource: Any, namespace: str | None, name: str | None) -> dict[str, Any] | None:
        for (res, ns, n), obj in self.objects.items():
            if res == resource and ns == namespace and n == name and not obj.deleted:
                return obj.raw
        return None


def resource_url(resource: str, namespace: str, name: str | None = None) -> str:
    group_version, plural = resource.rsplit("/", 1)
    root = "/api/v1" if group_version == "v1" else f"/apis/{group_version}"
    return "/".join(p for p in (f"{root}/namespaces/{namespace}/{plural}", name) if p)


async def call(k: Emulator, method: str, url: str, body: Any = None, merge: bool = False) -> Any:
    """A request to the emulator over HTTP, so that watchers see it; merge: a merge patch."""
    headers = {"Content-Type": "application/merge-patch+json"} if merge else {}
    async with k.request(method, url, json=body, headers=headers) as resp:
        if resp.status >= 400:
            raise RuntimeError(f"{method} {url}: HTTP {resp.status}: {await resp.text()}")
        return await resp.json()


def write_kubeconfig(path: Path, server: str) -> Path:
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "fleet", "cluster": {"server": server}}],
                # The emulator checks no credentials; the clients want some.
                "users": [{"name": "bench", "user": {"token": "unused"}}],
                "contexts": [{"name": "fleet", "context": {"cluster": "fleet", "user": "bench"}}],
                "current-context": "fleet",
            }
        )
    )
    return path


@contextlib.asynccontextmanager
async def emulated_cluster(namespace: str, kubeconfig: Path) -> AsyncIterator[Emulator]:
    """The emulator serving on 127.0.0.1, its namespace created and ``kubeconfig`` written."""
    async with Emulator() as k, kmock.Server(k) as server:
        for resource, (kind, namespaced, subresources) in RESOURCES.items():
            k.resources[resource] = kmock.ResourceInfo(
                kind=kind,
                namespaced=namespaced,
                subresources=subresources,
                verbs={"get", "list", "watch", "create", "patch", "update", "delete"},
            )
        # Set directly: kmock cannot parse the cluster-scoped URL of namespaces.
        k.objects["v1/namespaces", None, namespace] = {"metadata": {"name": namespace}}
        write_kubeconfig(kubeconfig, str(server.url).rstrip("/"))
        yield k
