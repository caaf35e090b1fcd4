"""Where the engines are: a static list, or the ready addresses of the engine Service's
EndpointSlices, watched through the Kubernetes API with kubernetes_asyncio (the pod's
ServiceAccount in a cluster, the kubeconfig outside one). While the API cannot be reached the
last known endpoints stay in use: a control plane outage must not take the data path down with
it. Requests go through the generated DiscoveryV1Api (URL, credentials, TLS), but responses are
read raw, as plain dicts: the shape the tests and ``kubectl`` show.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
from collections.abc import Awaitable, Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import aiohttp
from kubernetes_asyncio import client, config

logger = logging.getLogger(__name__)

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
SERVICE_NAME_LABEL = "kubernetes.io/service-name"

OnChange = Callable[[frozenset[str]], None]
Connect = Callable[[], Awaitable[client.Configuration]]
WATCH_ERRORS = (
    aiohttp.ClientError,
    config.ConfigException,
    TimeoutError,
    OSError,
    ValueError,
    KeyError,
)


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


async def load_configuration(
    env: Mapping[str, str] = os.environ, sa_dir: Path = SERVICE_ACCOUNT_DIR
) -> client.Configuration:
    """In a pod its ServiceAccount (the token is reread as the kubelet rotates it), elsewhere
    the kubeconfig (``KUBECONFIG`` or ``~/.kube/config``) for development."""
    configuration = client.Configuration()
    if env.get("KUBERNETES_SERVICE_HOST"):
        config.load_incluster_config(
            client_configuration=configuration,
            token_filename=str(sa_dir / "token"),
            cert_filename=str(sa_dir / "ca.crt"),
            environ=env,
        )
    else:
        path = env.get("KUBECONFIG") or str(Path.home() / ".kube" / "config")
        # KUBECONFIG is a list of files, merged; the loader's own error for none is obscure.
        if not any(Path(p).expanduser().is_file() for p in path.split(os.pathsep) if p):
            raise config.ConfigException(
                f"not in a cluster (KUBERNETES_SERVICE_HOST unset) and no kubeconfig at {path}"
            )
        await config.load_kube_config(
            config_file=path, client_configuration=configuration, persist_config=False
        )
    return configuration


def in_cluster_namespace(sa_dir: Path = SERVICE_ACCOUNT_DIR) -> str | None:
    path = sa_dir / "namespace"
    return path.read_text().strip() if path.exists() else None


class _Expired(Exception):
    """The watch's resourceVersion is too old: list again."""


class _Unauthorized(Exception):
    """The credentials stopped working (an expired token): load them again."""


class Backoff:
    """Exponential, with jitter so that many routers do not come back in step."""

    def __init__(self, initial_s: float, max_s: float) -> None:
        self.initial_s, self.max_s = initial_s, max_s
        self.next_s = initial_s

    def reset(self) -> None:
        self.next_s = self.initial_s

    async def sleep(self) -> None:
        await asyncio.sleep(self.next_s * random.uniform(0.5, 1.0))
        self.next_s = min(self.next_s * 2, self.max_s)


class EndpointSliceWatcher:
    """The plain list-then-watch protocol over the slices labelled
    ``kubernetes.io/service-name=<service>``: watch from the list's resourceVersion with
    bookmarks, resume from the last event or bookmark seen when the stream ends, list afresh
    when the API says the version is gone (410). Failures, streams that end at once without an
    event, and a 410 again before any stream stayed open (an API that keeps expiring what it just
    listed) are retried after a backoff with jitter. A watch line is split from chunks however
    long it is."""

    def __init__(
        self,
        connect: Connect,
        namespace: str,
        service: str,
        port: int,
        on_change: OnChange,
        *,
        watch_timeout_s: int = 290,
        initial_backoff_s: float = 0.5,
        max_backoff_s: float = 30.0,
        min_stream_s: float = 1.0,
    ) -> None:
        self.connect = connect
        self.namespace = namespace
        self.service = service
        self.on_change = on_change
        self.watch_timeout_s = watch_timeout_s
        # A stream that ends sooner without an event did no work: come back after a backoff.
        self.min_stream_s = min_stream_s
        self.backoff = Backoff(initial_backoff_s, max_backoff_s)
        # Its own: bookmarks reset the other one, and a bookmark-then-410 cycle must not relist
        # at full speed.
        self.relist_backoff = Backoff(initial_backoff_s, max_backoff_s)
        self._expiries = 0  # 410s since a stream last stayed open min_stream_s
        self.slices = SliceSet(port)
        self._published: frozenset[str] | None = None
        self._watched = False  # a stream did work since the last list

    def _publish(self) -> None:
        current = self.slices.endpoints()
        if current != self._published:
            logger.info("ready engine endpoints: %s", sorted(current) or "none")
            self._published = current
            self.on_change(current)

    async def run(self) -> None:
        """List and watch until cancelled; reconnect with backoff on errors."""
        api_client: client.ApiClient | None = None
        try:
            while True:
                try:
                    if api_client is None:
                        api_client = client.ApiClient(await self.connect())
                    await self._list_and_watch(client.DiscoveryV1Api(api_client))
                except _Expired:
                    self._expiries += 1
                    if self._watched and self._expiries == 1:
                        logger.info("endpointslice watch expired, listing again")
                        continue
                    logger.info(
                        "endpointslice watch expired again, listing again in about %.1fs",
                        self.relist_backoff.next_s,
                    )
                    await self.relist_backoff.sleep()
                    continue
                except _Unauthorized:
                    logger.warning("endpointslice watch: unauthorized, reloading credentials")
                    if api_client is not None:
                        await api_client.close()
                    api_client = None
                except WATCH_ERRORS as e:
                    logger.warning(
                        "endpointslice watch of %s failed (%s), retrying in about %.1fs",
                        self.service, e or type(e).__name__, self.backoff.next_s,
                    )  # fmt: skip
                await self.backoff.sleep()
        finally:
            if api_client is not None:
                await api_client.close()

    async def _list_and_watch(self, api: client.DiscoveryV1Api) -> None:
        # With _preload_content=False the generated client returns the raw response, not the
        # model its annotation names (here and in _watch).
        body = await self._read_json(
            await api.list_namespaced_endpoint_slice(  # pyright: ignore[reportArgumentType]
                self.namespace,
                label_selector=self._selector,
                _preload_content=False,
                _request_timeout=aiohttp.ClientTimeout(total=30),
            )
        )
        self.slices.replace(body.get("items") or ())
        self._publish()
        self._watched = False
        version = body["metadata"]["resourceVersion"]
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            version, events = await self._watch(api, version)
            if loop.time() - started >= self.min_stream_s:
                self._expiries = 0
                self.relist_backoff.reset()
            if events or loop.time() - started >= self.min_stream_s:
                self._watched = True
                self.backoff.reset()
            else:
                logger.debug("endpointslice watch ended at once, resuming after a backoff")
                await self.backoff.sleep()

    @property
    def _selector(self) -> str:
        return f"{SERVICE_NAME_LABEL}={self.service}"

    @staticmethod
    def _check(resp: aiohttp.ClientResponse) -> None:
        if resp.status == 410:
            raise _Expired
        if resp.status == 401:
            raise _Unauthorized
        resp.raise_for_status()

    async def _read_json(self, resp: aiohttp.ClientResponse) -> dict[str, Any]:
        async with resp:
            self._check(resp)
            return await resp.json()

    async def _watch(self, api: client.DiscoveryV1Api, version: str) -> tuple[str, int]:
        """One watch stream; returns the version to resume from when the server ends it and
        how many events (bookmarks included) it delivered."""
        resp: aiohttp.ClientResponse = await api.list_namespaced_endpoint_slice(  # pyright: ignore[reportAssignmentType]
            self.namespace,
            label_selector=self._selector,
            # Strings, though annotated bool: the client would send Python's "True", which the
            # API server accepts but proxies and emulators need not.
            watch="true",  # pyright: ignore[reportArgumentType]
            resource_version=version,
            allow_watch_bookmarks="true",  # pyright: ignore[reportArgumentType]
            timeout_seconds=self.watch_timeout_s,
            _preload_content=False,
            # No total timeout: a watch is a long poll the server ends (timeoutSeconds).
            _request_timeout=aiohttp.ClientTimeout(
                total=None, connect=10, sock_read=self.watch_timeout_s + 30
            ),
        )
        events = 0
        async with resp:
            self._check(resp)
            # Read in chunks rather than lines: a line (a slice holds up to 1000 endpoints) can
            # outgrow a stream reader's line limit.
            buffer = b""
            async for chunk in resp.content.iter_any():
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    if line.strip():
                        version = self._event(json.loads(line))
                        events += 1
        return version, events

    def _event(self, event: Mapping[str, Any]) -> str:
        kind, obj = event["type"], event["object"]
        if kind == "ERROR":
            if obj.get("code") == 410:
                raise _Expired
            raise ValueError(f"watch error: {obj.get('message', obj)}")
        if kind != "BOOKMARK":
            self.slices.apply(kind, obj)
            self._publish()
        return obj["metadata"]["resourceVersion"]
