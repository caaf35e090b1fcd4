"""A small Kubernetes API client over kopf's own HTTP machinery.

Kopf already holds the credentials (from its login handlers), refreshes them on 401 and retries
transient failures; reusing its request function keeps the operator to a single client library
and a single session. That function lives in kopf's private ``_cogs`` package, which is why
pyproject.toml pins kopf to one minor version; nothing else in the operator touches it.

Children are written by server-side apply (``application/apply-patch+yaml`` with this operator's
field manager and force), which also creates them: the operator owns exactly the fields it sets,
a field it stops setting is removed, and fields others own (injected sidecars, say) stay.
"""

from __future__ import annotations

import contextlib
import logging
import urllib.parse
from collections.abc import Mapping
from typing import Any

import kopf
from kopf._cogs.clients import api, errors

APIError = errors.APIError
APINotFoundError = errors.APINotFoundError

FIELD_MANAGER = "kvfleet-operator"
Key = tuple[str, str]  # (namespace, name) of an object
logger = logging.getLogger("kvfleet.operator.kube")


def resource_url(
    api_version: str,
    plural: str,
    namespace: str,
    name: str | None = None,
    subresource: str | None = None,
) -> str:
    root = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    url = f"{root}/namespaces/{namespace}/{plural}"
    if name is not None:
        url += f"/{name}"
    if subresource is not None:
        url += f"/{subresource}"
    return url


class Kube:
    def __init__(
        self,
        settings: kopf.OperatorSettings,
        backoffs: tuple[float, ...] = (0.5, 1.0, 2.0),
    ) -> None:
        self._settings = settings
        # Short: a reconcile that keeps failing is retried by the work queue with its own
        # backoff, with fresh state each time, rather than stuck in one request.
        self._backoffs = backoffs

    async def _request(
        self,
        method: str,
        url: str,
        payload: object | None = None,
        content_type: str | None = None,
    ) -> Any:
        response = await api.request(
            method=method,
            url=url,
            payload=payload,
            headers={"Content-Type": content_type} if content_type else None,
            settings=self._settings,
            logger=logger,
            backoffs=self._backoffs,
        )
        async with response:
            return await response.json()

    async def get(self, url: str) -> dict[str, Any] | None:
        try:
            return await self._request("get", url)
        except APINotFoundError:
            return None

    async def list(self, url: str, label_selector: str) -> list[dict[str, Any]]:
        query = urllib.parse.urlencode({"labelSelector": label_selector})
        return list((await self._request("get", f"{url}?{query}")).get("items") or [])

    async def apply(self, url: str, body: Mapping[str, Any]) -> dict[str, Any]:
        # Strict: a field the API server does not know (a typo in a passed-through affinity,
        # say) is an error to report, not something to prune silently and re-apply forever.
        query = urllib.parse.urlencode(
            {"fieldManager": FIELD_MANAGER, "force": "true", "fieldValidation": "Strict"}
        )
        # JSON is YAML: the apply content type takes it as is.
        return await self._request("patch", f"{url}?{query}", body, "application/apply-patch+yaml")

    async def merge_patch(self, url: str, body: Mapping[str, Any]) -> dict[str, Any]:
        return await self._request("patch", url, body, "application/merge-patch+json")

    async def delete(self, url: str) -> None:
        with contextlib.suppress(APINotFoundError):
            await self._request("delete", url)
