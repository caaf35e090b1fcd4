"""The operator's Kubernetes client (kvfleet.operator.kube) against a small aiohttp API server:
server-side apply, retries of transient failures, 404s, reloading credentials on 401, and the
credential loaders (kubeconfig with an exec plugin, in-cluster), shared with kopf."""

from __future__ import annotations

import asyncio
import datetime
import json
import logging
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from aiohttp import web
from kubernetes_asyncio import client

from kvfleet.operator import main as operator_main
from kvfleet.operator.kube import (
    FIELD_MANAGER,
    APIError,
    Connection,
    Kube,
    NoClusterError,
    WriteDeferred,
    connection_info,
    load_connection,
    resource_url,
)
from tests.support.net import free_port

DEPLOY = resource_url("apps/v1", "deployments", "ns", "web")
BACKOFFS = (0.01, 0.01, 0.01)
Handler = Callable[[web.Request], web.Response]


class FakeAPI:
    """Answers each request with the next of `answers` (the last repeats); records requests."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.answers: list[Handler] = [lambda r: web.json_response({"kind": "Deployment"})]
        self.url = ""

    async def handle(self, request: web.Request) -> web.Response:
        self.requests.append({
            "method": request.method,
            "path": request.path,
            "query": dict(request.query),
            "content_type": request.headers.get("Content-Type"),
            "auth": request.headers.get("Authorization"),
            "agent": request.headers.get("User-Agent", ""),
            "body": await request.text(),
        })  # fmt: skip
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        return answer(request)

    def kube(self, token: str | None = None, **options: Any) -> Kube:
        async def connect() -> Connection:
            cfg = client.Configuration(host=self.url)
            if token:
                cfg.api_key["BearerToken"] = f"Bearer {token}"
            return Connection(cfg, "test")

        return Kube(connect, backoffs=BACKOFFS, **options)


def status(code: int, message: str = "", **headers: str) -> Handler:
    body = {"kind": "Status", "code": code, "message": message}
    return lambda _: web.json_response(body, status=code, headers=headers)


@pytest_asyncio.fixture
async def api() -> AsyncIterator[FakeAPI]:
    fake = FakeAPI()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", fake.handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    fake.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        yield fake
    finally:
        await runner.cleanup()


@pytest.mark.asyncio
async def test_apply_is_server_side_apply_with_field_manager_and_force(api: FakeAPI) -> None:
    kube = api.kube(token="t0k")
    obj = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "web"}}
    assert await kube.apply(DEPLOY, obj) == {"kind": "Deployment"}
    await kube.close()
    (req,) = api.requests
    assert req["method"] == "PATCH" and req["path"] == "/apis/apps/v1/namespaces/ns/deployments/web"
    assert req["content_type"] == "application/apply-patch+yaml"
    assert req["query"] == {
        "fieldManager": FIELD_MANAGER,
        "force": "true",
        "fieldValidation": "Strict",
    }
    assert json.loads(req["body"]) == obj
    assert req["auth"] == "Bearer t0k"
    assert req["agent"].startswith("kvfleet-operator/")


@pytest.mark.asyncio
async def test_merge_patch_list_get_delete(api: FakeAPI) -> None:
    kube = api.kube()
    api.answers = [
        lambda _: web.json_response({"status": {}}),
        lambda _: web.json_response({"items": [{"metadata": {"name": "p"}}]}),
        status(404, "not found"),
        status(404, "not found"),
        status(403, 'deployments.apps "web" is forbidden'),
    ]
    await kube.merge_patch(f"{DEPLOY}/status", {"status": {"x": 1}})
    pods = await kube.list(resource_url("v1", "pods", "ns"), "app=x")
    assert pods == [{"metadata": {"name": "p"}}]
    assert await kube.get(DEPLOY) is None
    await kube.delete(DEPLOY)  # already gone: done
    with pytest.raises(APIError, match="forbidden") as e:
        await kube.get(DEPLOY)
    assert e.value.status == 403
    await kube.close()
    patch, listing, *_ = api.requests
    assert patch["content_type"] == "application/merge-patch+json"
    assert patch["path"].endswith("/deployments/web/status")
    assert listing["query"] == {"labelSelector": "app=x"}
    assert [r["method"] for r in api.requests] == ["PATCH", "GET", "GET", "DELETE", "GET"]


@pytest.mark.asyncio
async def test_transient_errors_are_retried_a_few_times(api: FakeAPI) -> None:
    kube = api.kube()
    api.answers = [status(429, "slow down", **{"Retry-After": "0"}), status(503), status(500),
                   lambda _: web.json_response({"ok": True})]  # fmt: skip
    assert await kube.get(DEPLOY) == {"ok": True}
    assert len(api.requests) == 4
    api.requests.clear()
    api.answers = [status(503, "unavailable")]
    with pytest.raises(APIError, match="unavailable"):
        await kube.get(DEPLOY)
    assert len(api.requests) == 1 + len(BACKOFFS)
    api.requests.clear()
    api.answers = [status(422, "invalid")]  # the request's fault: not retried
    with pytest.raises(APIError, match="invalid"):
        await kube.apply(DEPLOY, {})
    assert len(api.requests) == 1
    await kube.close()


@pytest.mark.asyncio
async def test_a_conflict_on_a_patch_with_a_precondition_is_not_retried(api: FakeAPI) -> None:
    api.answers = [status(409, "the object has been modified")]
    kube = api.kube()
    with pytest.raises(APIError) as e:
        await kube.merge_patch(DEPLOY, {"metadata": {"resourceVersion": "7"}, "spec": {}})
    assert e.value.status == 409 and len(api.requests) == 1
    # Without one, a 409 is a race with another write, and the same patch is sent again.
    api.answers = [status(409), lambda r: web.json_response({"kind": "Deployment"})]
    assert await kube.merge_patch(DEPLOY, {"spec": {}}) == {"kind": "Deployment"}
    assert len(api.requests) == 3
    await kube.close()


@pytest.mark.asyncio
async def test_an_object_whose_writes_keep_failing_is_written_at_its_callers_pace(
    api: FakeAPI,
) -> None:
    """Issue 36: an object's first failed write is retried within the call; after that each
    call sends it once (the reconciler: its work queue's backoff paces the calls), and a
    periodic caller's write (the autoscaler's, every interval) is not sent before the object's
    own backoff has passed."""
    kube = api.kube(write_backoff=(0.2, 0.4))
    api.answers = [status(409, "conflict #1")]
    with pytest.raises(APIError):
        await kube.merge_patch(DEPLOY, {"spec": {}})
    assert len(api.requests) == 1 + len(BACKOFFS)
    api.requests.clear()
    with pytest.raises(APIError):
        await kube.apply(DEPLOY, {})
    assert len(api.requests) == 1
    with pytest.raises(WriteDeferred) as deferred:
        await kube.merge_patch(DEPLOY, {"spec": {}}, periodic=True)
    assert deferred.value.status == 409
    assert "backing off after 2 failed writes, the last: conflict #1" in str(deferred.value)
    assert len(api.requests) == 1
    # Reads, and the writes of other objects, are not held back.
    api.answers = [lambda _: web.json_response({"kind": "Deployment"})]
    assert await kube.get(DEPLOY) == {"kind": "Deployment"}
    assert await kube.merge_patch(f"{DEPLOY}/status", {}, periodic=True) == {"kind": "Deployment"}
    # A periodic caller's requests are sent once: its next interval is its retry.
    api.requests.clear()
    api.answers = [status(500)]
    with pytest.raises(APIError):
        await kube.get(DEPLOY, periodic=True)
    assert len(api.requests) == 1
    api.answers = [lambda _: web.json_response({"kind": "Deployment"})]
    # Past the backoff (0.2 s doubled, at most 0.4 s), it is sent; a success ends the backoff,
    # so the next failure is retried within the call again.
    await asyncio.sleep(0.4)
    assert await kube.merge_patch(DEPLOY, {}, periodic=True) == {"kind": "Deployment"}
    api.requests.clear()
    api.answers = [status(503)]
    with pytest.raises(APIError):
        await kube.merge_patch(DEPLOY, {})
    assert len(api.requests) == 1 + len(BACKOFFS)
    await kube.close()


@pytest.mark.asyncio
async def test_unreachable_api_is_retried_then_an_api_error() -> None:
    async def connect() -> Connection:
        return Connection(client.Configuration(host=f"http://127.0.0.1:{free_port()}"), "test")

    kube = Kube(connect, backoffs=BACKOFFS)
    with pytest.raises(APIError):
        await kube.get(DEPLOY)
    await kube.close()


@pytest.mark.asyncio
async def test_401_reloads_the_credentials_once(api: FakeAPI) -> None:
    tokens = iter(["old", "new"])

    async def connect() -> Connection:
        cfg = client.Configuration(host=api.url)
        cfg.api_key["BearerToken"] = f"Bearer {next(tokens)}"
        return Connection(cfg, "test")

    kube = Kube(connect, backoffs=BACKOFFS)
    api.answers = [status(401, "Unauthorized"), lambda _: web.json_response({})]
    assert await kube.get(DEPLOY) == {}
    assert [r["auth"] for r in api.requests] == ["Bearer old", "Bearer new"]
    await kube.close()


def exec_kubeconfig(tmp_path: Path, server: str, expires: str) -> Path:
    """A kubeconfig whose user is an exec credential plugin (a Python script)."""
    plugin = tmp_path / "plugin.py"
    plugin.write_text(
        "import json\n"
        "print(json.dumps({'apiVersion': 'client.authentication.k8s.io/v1', "
        "'kind': 'ExecCredential', "
        f"'status': {{'token': 'from-exec', 'expirationTimestamp': '{expires}'}}}}))\n"
    )
    path = tmp_path / "kubeconfig"
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "dev",
        "clusters": [{"name": "dev", "cluster": {"server": server}}],
        "users": [{"name": "dev", "user": {"exec": {
            "apiVersion": "client.authentication.k8s.io/v1", "command": sys.executable,
            "args": [str(plugin)], "interactiveMode": "Never",
        }}}],
        "contexts": [{"name": "dev", "context": {"cluster": "dev", "user": "dev"}}],
    }))  # fmt: skip
    return path


@pytest.mark.asyncio
async def test_kubeconfig_with_exec_plugin_serves_the_client_and_kopf(
    api: FakeAPI, tmp_path: Path
) -> None:
    expires = "2099-01-01T00:00:00Z"
    env = {"KUBECONFIG": str(exec_kubeconfig(tmp_path, api.url, expires))}
    connection = await load_connection(env, tmp_path)
    assert connection.source == f"kubeconfig {env['KUBECONFIG']}"
    info = await connection_info(connection)
    assert (info.server, info.scheme, info.token) == (api.url, "Bearer", "from-exec")
    assert info.expiration == datetime.datetime(2099, 1, 1, tzinfo=datetime.UTC)

    async def connect() -> Connection:
        return await load_connection(env, tmp_path)

    kube = Kube(connect, backoffs=BACKOFFS)
    # kopf's login handler: the same server and token as the client's own requests.
    assert (await kube.login()).token == "from-exec"
    await kube.get(DEPLOY)
    assert api.requests[0]["auth"] == "Bearer from-exec"
    await kube.close()


@pytest.mark.asyncio
async def test_in_cluster_service_account(tmp_path: Path) -> None:
    (tmp_path / "token").write_text("sa-token")
    (tmp_path / "ca.crt").write_text("-----BEGIN CERTIFICATE-----\n")
    env = {"KUBERNETES_SERVICE_HOST": "fd00::1", "KUBERNETES_SERVICE_PORT": "443"}
    info = await connection_info(await load_connection(env, tmp_path))
    assert info.server == "https://[fd00::1]:443"
    assert (info.scheme, info.token, info.ca_path) == (
        "Bearer",
        "sa-token",
        str(tmp_path / "ca.crt"),
    )
    (tmp_path / "token").unlink()
    with pytest.raises(NoClusterError, match="in-cluster config"):
        await load_connection(env, tmp_path)


def test_run_without_a_cluster_says_what_it_tried(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    missing = tmp_path / "no-such-kubeconfig"
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(missing))
    with caplog.at_level(logging.ERROR, logger="kvfleet.operator"):
        # Port 0 for both servers: a fixed port is taken whenever another suite runs beside.
        args = ["run", "--health-address", "127.0.0.1:0", "--metrics-address", "127.0.0.1:0"]
        assert operator_main.main(args) == 1
    (record,) = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert "KUBERNETES_SERVICE_HOST unset" in record.getMessage()
    assert str(missing) in record.getMessage()
