"""The pods of an InferenceService, listed one way for the reconciler (pod problems in the
status) and the autoscaler (the engines and routers it scrapes), so both see the same pods."""

from __future__ import annotations

from typing import Any

from kvfleet.operator import kube
from kvfleet.operator.api import LABEL_ISVC


async def list_pods(
    api: kube.Kube, namespace: str, name: str, *, periodic: bool = False
) -> list[dict[str, Any]]:
    """Every pod of the InferenceService ``namespace/name``, engines and routers."""
    url, selector = kube.resource_url("v1", "pods", namespace), f"{LABEL_ISVC}={name}"
    return [
        pod
        for pod in await api.list(url, selector, periodic=periodic)
        # Filtered here too: the selector is a hint some API emulators ignore.
        if (pod["metadata"].get("labels") or {}).get(LABEL_ISVC) == name
    ]
