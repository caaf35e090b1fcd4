"""The Kubernetes API the fleet runs against: kmock's emulator on a local port, extended as a real
API server behaves in what the operator relies on (tests/support/kmock.py, the emulator of the
operator tests), with a kubeconfig that points the real operator and router processes at it.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from tests.support import kmock as emulator
from tests.support.kmock import DEPLOYMENTS, ISVCS, PODS, SLICES
from tests.support.kmock import APIServer as Emulator

__all__ = ["DEPLOYMENTS", "ISVCS", "PODS", "SLICES", "Emulator", "call", "emulated_cluster"]


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


@contextlib.asynccontextmanager
async def emulated_cluster(namespace: str, kubeconfig: Path) -> AsyncIterator[Emulator]:
    """The emulator serving on 127.0.0.1, its namespace created and ``kubeconfig`` written."""
    async with emulator.emulated_cluster(namespace) as k:
        emulator.write_kubeconfig(kubeconfig, str(k.url).rstrip("/"))
        yield k
