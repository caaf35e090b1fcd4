"""Where the engines are: a static list, or the ready addresses of the engine Service's
EndpointSlices, watched through the Kubernetes API with the pod's service-account credentials.

The watch is the plain list-then-watch protocol: list the slices (label
``kubernetes.io/service-name=<service>``), then watch from the list's resourceVersion, resuming
from the last event seen when the stream ends, and listing afresh when the API says the version
is gone (410). While the API cannot be reached the last known endpoints stay in use: a control
plane outage must not take the data path down with it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import ssl
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

logger = logging.getLogger(__name__)

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
SERVICE_NAME_LABEL = "kubernetes.io/service-name"

OnChange = Callable[[frozenset[str]], None]


def host_port(address: str, port: int) -> str:
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


def parse_static(spec: str) -> frozenset[str]:
    """``host:port,host:port`` (spaces and empty items ignored)."""
    items = [s.strip() for s in spec.split(",")]
    bad = [s for s in items if s and not s.rpartition(":")[2].isdigit()]
    if bad:
        raise ValueError(f"endpoints must be host:port, got {bad}")
    return frozenset(s for s in items if s)


def slice_endpoints(obj: Mapping[str, Any], port: int) -> frozenset[str]:
    """The ready addresses of one EndpointSlice as ``host:port``. An absent ``ready`` condition
    means unknown, which the API says to treat as ready; terminating pods are not ready."""
    out = set()
    for ep in obj.get("endpoints") or ():
        if (ep.get("conditions") or {}).get("ready") is False:
            continue
        out.update(host_port(addr, port) for addr in ep.get("addresses") or ())
    return frozenset(out)


class SliceSet:
    """The slices of one Service, by name, folded from a list and watch events."""

    def __init__(self, port: int) -> None:
        self.port = port
        self._slices: dict[str, frozenset[str]] = {}

    def replace(self, items: Iterable[Mapping[str, Any]]) -> None:
        self._slices = {
            item["metadata"]["name"]: slice_endpoints(item, self.port) for item in items
        }

    def apply(self, event_type: str, obj: Mapping[str, Any]) -> None:
        name = obj["metadata"]["name"]
        if event_type == "DELETED":
            self._slices.pop(name, None)
        elif event_type in ("ADDED", "MODIFIED"):
            self._slices[name] = slice_endpoints(obj, self.port)

    def endpoints(self) -> frozenset[str]:
        return frozenset().union(*self._slices.values())


@dataclass(frozen=True)
class KubeAPI:
    """How to reach the API server. The token is read per connection: bound service-account
    tokens expire and the kubelet rewrites the file."""

    base_url: str
    token_path: Path | None = None
    ca_path: Path | None = None

    @classmethod
    def in_cluster(
        cls, env: Mapping[str, str] = os.environ, sa_dir: Path = SERVICE_ACCOUNT_DIR
    ) -> KubeAPI:
        host = env.get("KUBERNETES_SERVICE_HOST")
        if not host:
            raise RuntimeError("not in a cluster: KUBERNETES_SERVICE_HOST is unset")
        port = env.get("KUBERNETES_SERVICE_PORT", "443")
        return cls(f"https://{host_port(host, int(port))}", sa_dir / "token", sa_dir / "ca.crt")

    def headers(self) -> dict[str, str]:
        if self.token_path is None:
            return {}
        return {"Authorization": f"Bearer {self.token_path.read_text().strip()}"}

    def ssl_context(self) -> ssl.SSLContext | None:
        if self.ca_path is None:
            return None
        return ssl.create_default_context(cafile=str(self.ca_path))


def in_cluster_namespace(sa_dir: Path = SERVICE_ACCOUNT_DIR) -> str | None:
    path = sa_dir / "namespace"
    return path.read_text().strip() if path.exists() else None


class _Expired(Exception):
    """The watch's resourceVersion is too old: list again."""


class EndpointSliceWatcher:
    def __init__(
        self,
        api: KubeAPI,
        namespace: str,
        service: str,
        port: int,
        on_change: OnChange,
        *,
        watch_timeout_s: int = 290,
        max_backoff_s: float = 30.0,
    ) -> None:
        self.api = api
        self.service = service
        self.on_change = on_change
        self.watch_timeout_s = watch_timeout_s
        self.max_backoff_s = max_backoff_s
        self.url = f"{api.base_url}/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices"
        self.slices = SliceSet(port)
        self._published: frozenset[str] | None = None

    def _publish(self) -> None:
        current = self.slices.endpoints()
        if current != self._published:
            logger.info("ready engine endpoints: %s", sorted(current) or "none")
            self._published = current
            self.on_change(current)

    async def run(self) -> None:
        """List and watch until cancelled, reconnecting with exponential back-off."""
        backoff = 0.5
        ssl_ctx = self.api.ssl_context()
        # No total timeout: a watch is a long poll the server ends (timeoutSeconds).
        timeout = aiohttp.ClientTimeout(total=None, connect=10, sock_read=self.watch_timeout_s + 30)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while True:
                try:
                    version = await self._list(session, ssl_ctx)
                    backoff = 0.5
                    while True:
                        version = await self._watch(session, ssl_ctx, version)
                except _Expired:
                    logger.info("endpointslice watch expired, listing again")
                except (aiohttp.ClientError, TimeoutError, OSError, ValueError, KeyError) as e:
                    logger.warning(
                        "endpointslice watch of %s failed (%s), retrying in %.1fs",
                        self.service, e, backoff,
                    )  # fmt: skip
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, self.max_backoff_s)

    def _params(self, **extra: str) -> dict[str, str]:
        return {"labelSelector": f"{SERVICE_NAME_LABEL}={self.service}", **extra}

    async def _list(self, session: aiohttp.ClientSession, ssl_ctx: ssl.SSLContext | None) -> str:
        async with session.get(
            self.url, params=self._params(), headers=self.api.headers(), ssl=ssl_ctx or True
        ) as resp:
            resp.raise_for_status()
            body = await resp.json()
        self.slices.replace(body.get("items") or ())
        self._publish()
        return body["metadata"]["resourceVersion"]

    async def _watch(
        self, session: aiohttp.ClientSession, ssl_ctx: ssl.SSLContext | None, version: str
    ) -> str:
        """One watch stream; returns the version to resume from when the server ends it."""
        params = self._params(
            watch="true",
            resourceVersion=version,
            allowWatchBookmarks="true",
            timeoutSeconds=str(self.watch_timeout_s),
        )
        async with session.get(
            self.url, params=params, headers=self.api.headers(), ssl=ssl_ctx or True
        ) as resp:
            if resp.status == 410:
                raise _Expired
            resp.raise_for_status()
            # Lines can outgrow aiohttp's readline limit (a slice holds up to 1000 endpoints).
            buffer = b""
            async for chunk in resp.content.iter_any():
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    if line.strip():
                        version = self._event(json.loads(line), version)
        return version

    def _event(self, event: Mapping[str, Any], version: str) -> str:
        kind, obj = event["type"], event["object"]
        if kind == "ERROR":
            if obj.get("code") == 410:
                raise _Expired
            raise ValueError(f"watch error: {obj.get('message', obj)}")
        if kind != "BOOKMARK":
            self.slices.apply(kind, obj)
            self._publish()
        return obj["metadata"]["resourceVersion"]
