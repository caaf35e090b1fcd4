"""The operator's Kubernetes API client, over kubernetes_asyncio, and the credentials it shares
with kopf.

Credentials come from kubernetes_asyncio's loaders (the pod's ServiceAccount, else the
kubeconfig), and kopf gets the very same through the login handler :meth:`Kube.login`: one
source of truth for where the cluster is and who the operator is there, reloaded on a 401.
Requests go by URL with plain JSON bodies: the operator's objects are dicts built and compared
as such, and typed models would only convert them back and forth.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import logging
import os
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

import aiohttp
import kopf
from kubernetes_asyncio import client, config

from kvfleet.operator.backoff import PerKeyBackoff

FIELD_MANAGER = "kvfleet-operator"
USER_AGENT = f"kvfleet-operator/{version('kvfleet')}"
SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
# 5xx and 429 are the API server (or a proxy in front of it) asking to come back later.
RETRIED_STATUSES = frozenset({429, 500, 502, 503, 504})
# A 409 on a patch is a write that raced another one (a forced apply or a merge patch without a
# resourceVersion holds no precondition): the same patch again succeeds. A 409 on a create
# (AlreadyExists), or on a patch that names the resourceVersion it was computed from, is an
# answer: sending it again cannot succeed.
RETRIED_PATCH_STATUSES = RETRIED_STATUSES | {409}
BACKOFFS_S = (0.5, 1.0, 2.0)  # a request's own retries after one of those, or no answer
WRITES = frozenset({"POST", "PUT", "PATCH", "DELETE"})
# An object whose last write failed so, its retries spent, backs off: a periodic caller's next
# write to it (the autoscaler's, every interval) is sent no sooner than WRITE_BACKOFF_FIRST_S
# later, doubling to WRITE_BACKOFF_CAP_S (each times a jitter in [0.5, 1]). 4 s continues a
# request's own retries; a minute is as long as a recovered object waits for the autoscaler's
# write.
WRITE_BACKOFF_FIRST_S = 4.0
WRITE_BACKOFF_CAP_S = 60.0
# How long an object's failed writes are remembered after the last: longer than any caller
# waits to write again (the work queue's 5 min), so only an object nobody writes any more (a
# deleted one) is forgotten, and what is held is bounded by the objects written in that time.
WRITE_FAILURES_KEPT_S = 600.0
MAX_RETRY_AFTER_S = 10.0
RETIRE_AFTER_S = 60.0
Key = tuple[str, str]  # (namespace, name) of an object
logger = logging.getLogger("kvfleet.operator.kube")


class APIError(Exception):
    """The API server refused a request; the message is its Status message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class APINotFoundError(APIError):
    pass


class WriteDeferred(APIError):
    """A periodic caller's write not sent: the object's last writes failed and it backs off;
    status is the last failure's."""


class NoClusterError(RuntimeError):
    """No credentials: neither an in-cluster ServiceAccount nor a usable kubeconfig."""


@dataclass(frozen=True)
class Connection:
    """Where the API server is and how to authenticate, as kubernetes_asyncio loaded it."""

    configuration: client.Configuration
    source: str  # for logs and errors: "in-cluster ServiceAccount" or "kubeconfig PATH"
    expiration: datetime.datetime | None = None  # of an exec plugin's token


async def load_connection(
    env: Mapping[str, str] = os.environ, sa_dir: Path = SERVICE_ACCOUNT_DIR
) -> Connection:
    """In a pod its ServiceAccount, elsewhere the kubeconfig; NoClusterError says what was
    tried."""
    configuration = client.Configuration()
    if env.get("KUBERNETES_SERVICE_HOST"):
        try:
            config.load_incluster_config(
                client_configuration=configuration,
                token_filename=str(sa_dir / "token"),
                cert_filename=str(sa_dir / "ca.crt"),
                environ=env,
            )
        except config.ConfigException as e:
            raise NoClusterError(f"no Kubernetes API: in-cluster config ({sa_dir}): {e}") from None
        return Connection(configuration, "in-cluster ServiceAccount")
    path = env.get("KUBECONFIG") or str(Path.home() / ".kube" / "config")
    unset = "not in a cluster (KUBERNETES_SERVICE_HOST unset)"
    # KUBECONFIG is a list of files, merged.
    if not any(Path(p).expanduser().is_file() for p in path.split(os.pathsep) if p):
        raise NoClusterError(f"no Kubernetes API: {unset} and no kubeconfig at {path}")
    try:
        # persist_config off: the operator never writes the user's kubeconfig.
        loader = await config.load_kube_config(
            config_file=path, client_configuration=configuration, persist_config=False
        )
    except (config.ConfigException, OSError, KeyError, TypeError, ValueError) as e:
        raise NoClusterError(
            f"no Kubernetes API: {unset} and kubeconfig {path} failed: {e or type(e).__name__}"
        ) from None
    expiration = getattr(loader, "exec_plugin_expiry", None)
    return Connection(configuration, f"kubeconfig {path}", expiration)


async def connection_info(connection: Connection) -> kopf.ConnectionInfo:
    """The same credentials in kopf's terms."""
    cfg = connection.configuration
    assert cfg.host is not None, "a loaded configuration names its API server"
    scheme = token = None
    if authorization := await cfg.get_api_key_with_prefix("BearerToken"):
        scheme, _, token = authorization.strip().partition(" ")
    return kopf.ConnectionInfo(
        server=cfg.host,
        ca_path=cfg.ssl_ca_cert,
        insecure=not cfg.verify_ssl,
        scheme=scheme,
        token=token,
        certificate_path=cfg.cert_file,
        private_key_path=cfg.key_file,
        proxy_url=cfg.proxy,
        expiration=connection.expiration,
    )


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


def post_event(obj: Mapping[str, Any], *, type: str, reason: str, message: str) -> None:
    """An Event about ``obj``, an object as the API answered it, posted by kopf's poster."""
    # kopf reads any mapping (dicts.walk); its annotation names only its own Body view of one.
    kopf.event(obj, type=type, reason=reason, message=message)  # pyright: ignore[reportArgumentType]


class Kube:
    def __init__(
        self,
        connect: Callable[[], Awaitable[Connection]] = load_connection,
        backoffs: tuple[float, ...] = BACKOFFS_S,
        write_backoff: tuple[float, float] = (WRITE_BACKOFF_FIRST_S, WRITE_BACKOFF_CAP_S),
    ) -> None:
        self._connect = connect
        # Short: a reconcile that keeps failing is retried by the work queue with its own
        # backoff, with fresh state each time, rather than stuck in one request.
        self._backoffs = backoffs
        # By URL (an object, or its status subresource): the writes that failed, until one
        # succeeds.
        self._writes: PerKeyBackoff[str] = PerKeyBackoff(
            *write_backoff, forget_after=WRITE_FAILURES_KEPT_S
        )
        self._connection: Connection | None = None
        self._fresh = False  # loaded since kopf last logged in
        self._client: client.ApiClient | None = None
        self._retiring: set[asyncio.Task[None]] = set()

    async def connect(self) -> Connection:
        """(Re)load the credentials; the next request opens a client with them."""
        connection = await self._connect()
        self._connection, self._fresh = connection, True
        if self._client is not None:
            # Requests in flight on the old client finish before it closes.
            task = asyncio.create_task(_close_later(self._client, RETIRE_AFTER_S))
            self._retiring.add(task)
            task.add_done_callback(self._retiring.discard)
            self._client = None
        logger.info("Kubernetes API %s from %s", connection.configuration.host, connection.source)
        return connection

    async def login(self, **_: Any) -> kopf.ConnectionInfo:
        """Kopf's login handler. Kopf calls it at start and again when its credentials stop
        working, which is when they are reloaded, unless they just were."""
        if self._connection is None or not self._fresh:
            await self.connect()
        assert self._connection is not None
        self._fresh = False
        return await connection_info(self._connection)

    async def close(self) -> None:
        for task in list(self._retiring):
            task.cancel()
        await asyncio.gather(*self._retiring, return_exceptions=True)
        if self._client is not None:
            await self._client.close()
            self._client = None

    async def _api_client(self) -> client.ApiClient:
        if self._client is None:
            connection = self._connection or await self.connect()
            self._client = client.ApiClient(connection.configuration)
            self._client.user_agent = USER_AGENT
        return self._client

    async def _send(
        self, method: str, url: str, query: list[tuple[str, str]], body: object, ctype: str
    ) -> tuple[int, Mapping[str, str], bytes]:
        api = await self._api_client()
        response: aiohttp.ClientResponse = await api.call_api(
            url,
            method,
            query_params=query,
            header_params={"Accept": "application/json", "Content-Type": ctype},
            body=body,
            auth_settings=["BearerToken"],
            _preload_content=False,
            _return_http_data_only=True,
        )
        async with response:
            return response.status, response.headers, await response.read()

    async def _request(
        self,
        method: str,
        url: str,
        body: object | None = None,
        content_type: str = "application/json",
        query: list[tuple[str, str]] | None = None,
        *,
        periodic: bool = False,
    ) -> Any:
        """One request, retried within the call after a transient failure: a 5xx, a 429, a 409
        on a patch without a precondition, no answer.

        Except for a write to an object whose last write failed so: that is sent once, and its
        pace is its caller's, whose own backoff (the work queue's) grows. ``periodic``: the
        caller tries again every interval whatever happens (the autoscaler), so its requests are
        sent once, and its write to such an object only after the object's backoff: before,
        WriteDeferred, with no request."""
        racy = method == "PATCH" and not _preconditioned(body)
        transient = RETRIED_PATCH_STATUSES if racy else RETRIED_STATUSES
        write = method in WRITES
        failing = self._writes.failing(url) if write else None
        if failing is not None and periodic and (wait := self._writes.wait(url)) > 0:
            raise WriteDeferred(
                failing.status,
                f"not sent: backing off after {failing.failures} failed "
                f"write{'s' * (failing.failures > 1)}, the last: {failing.last}; "
                f"next attempt in {wait:.1f}s",
            )
        retry = not periodic and failing is None
        try:
            result = await self._attempts(
                method, url, body, content_type, query or [], transient, retry
            )
        except APIError as e:
            if write and (e.status == 0 or e.status in transient):
                self._writes.failed(url, str(e), e.status)
            raise
        if write:
            self._writes.succeeded(url)
        return result

    async def _attempts(
        self,
        method: str,
        url: str,
        body: object | None,
        content_type: str,
        query: list[tuple[str, str]],
        transient: frozenset[int],
        retry: bool,
    ) -> Any:
        reauthenticated = False
        delays = iter(self._backoffs if retry else ())
        while True:
            try:
                status, headers, raw = await self._send(method, url, query, body, content_type)
            except (aiohttp.ClientConnectionError, TimeoutError) as e:
                if (delay := next(delays, None)) is None:
                    raise APIError(0, f"{method} {url}: {e or type(e).__name__}") from e
                logger.debug("%s %s: %s, retrying in %.1fs", method, url, e, delay)
                await asyncio.sleep(delay)
                continue
            if status < 400:
                return json.loads(raw) if raw else None
            if status == 401 and not reauthenticated:
                reauthenticated = True
                try:
                    await self.connect()
                except NoClusterError as e:
                    raise APIError(status, f"unauthorized; reloading credentials: {e}") from e
                continue
            if status in transient and (delay := next(delays, None)) is not None:
                delay = max(delay, min(_retry_after(headers), MAX_RETRY_AFTER_S))
                logger.debug("%s %s: %d, retrying in %.1fs", method, url, status, delay)
                await asyncio.sleep(delay)
                continue
            raise _error(status, raw)

    async def get(self, url: str, *, periodic: bool = False) -> dict[str, Any] | None:
        try:
            return await self._request("GET", url, periodic=periodic)
        except APINotFoundError:
            return None

    async def list(
        self, url: str, label_selector: str, *, periodic: bool = False
    ) -> list[dict[str, Any]]:
        query = [("labelSelector", label_selector)]
        body = await self._request("GET", url, query=query, periodic=periodic)
        return list(body.get("items") or [])

    async def apply(self, url: str, body: Mapping[str, Any]) -> dict[str, Any]:
        """Server-side apply with this operator's field manager and force, which also creates:
        the operator owns exactly the fields it sets, a field it stops setting is removed, and
        fields others own stay, except in the values drift.excess says the operator owns whole
        (a merge patch removes those)."""
        # Strict: a field the API server does not know (a typo in a passed-through affinity,
        # say) is an error to report, not something to prune silently and re-apply forever.
        query = [("fieldManager", FIELD_MANAGER), ("force", "true"), ("fieldValidation", "Strict")]
        # JSON is YAML: the apply content type takes it as is.
        return await self._request("PATCH", url, body, "application/apply-patch+yaml", query)

    async def merge_patch(
        self, url: str, body: Mapping[str, Any], *, periodic: bool = False
    ) -> dict[str, Any]:
        ctype = "application/merge-patch+json"
        return await self._request("PATCH", url, body, ctype, periodic=periodic)

    async def delete(self, url: str) -> None:
        with contextlib.suppress(APINotFoundError):
            await self._request("DELETE", url)


async def _close_later(api_client: client.ApiClient, delay: float) -> None:
    try:
        await asyncio.sleep(delay)
    finally:
        await api_client.close()


def _preconditioned(body: object) -> bool:
    return isinstance(body, Mapping) and bool((body.get("metadata") or {}).get("resourceVersion"))


def _retry_after(headers: Mapping[str, str]) -> float:
    try:
        return float(headers.get("Retry-After", 0))
    except ValueError:
        return 0.0  # an HTTP date: the backoff alone


def _error(status: int, raw: bytes) -> APIError:
    try:
        message = json.loads(raw).get("message") or ""
    except (ValueError, AttributeError):
        message = raw.decode(errors="replace")[:200]
    message = message or f"HTTP {status}"
    return (APINotFoundError if status == 404 else APIError)(status, message)
