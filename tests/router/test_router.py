"""The router against fake engines and a fake Kubernetes API: routing keys, endpoint choice,
streaming relay, retries, holding while there is no engine, endpoint discovery, metrics."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from kubernetes_asyncio.client import Configuration
from kubernetes_asyncio.config import ConfigException
from multidict import CIMultiDict

from kvfleet.operator.command_lines import router_args
from kvfleet.operator.spec import RoutingSpec
from kvfleet.router.endpoints import (
    EndpointSliceWatcher,
    SliceSet,
    load_configuration,
    parse_static,
    slice_endpoints,
)
from kvfleet.router.main import parse_args, settings_from
from kvfleet.router.proxy import (
    Balancer,
    Router,
    build_app,
    engine_failed,
    forwarded_headers,
    may_retry,
    refused,
)
from kvfleet.router.routing_key import (
    KeyPolicy,
    PromptTokenizer,
    RoutingKey,
    char_prefix_key,
    routing_key,
    token_prefix_key,
)
from kvfleet.router.settings import RouterSettings
from kvfleet.telemetry.ports import ENGINE_PORT, ROUTER_PORT
from tests.support.servers import serving

POLICY = KeyPolicy(prefix_length=32)
SYSTEM = "You are a helpful assistant. " * 20


def key_of(
    headers: Any, body: bytes, policy: KeyPolicy, tokenizer: PromptTokenizer | None = None
) -> RoutingKey:
    """The key of a request body as the router parses it."""
    return routing_key(headers, json.loads(body) if body else None, policy, tokenizer)


def chat(*messages: tuple[str, str], **extra: Any) -> bytes:
    return json.dumps(
        {"model": "m", "messages": [{"role": r, "content": c} for r, c in messages], **extra}
    ).encode()


# ------------------------------------------------------------------------------------------
# Routing keys (pure)
# ------------------------------------------------------------------------------------------


def test_session_header_wins_case_insensitively() -> None:
    headers = CIMultiDict({"X-Session-ID": "abc"})
    body = chat(("user", "hi"), user="u1")
    assert key_of(headers, body, POLICY) == RoutingKey("session", "session:abc")
    assert key_of(CIMultiDict({"x-session-id": ""}), body, POLICY).reason == "user"


def test_user_field_only_when_enabled() -> None:
    body = chat(("system", SYSTEM), ("user", "hi"), user="u1")
    assert key_of({}, body, POLICY) == RoutingKey("user", "user:u1")
    off = KeyPolicy(use_user_field=False, prefix_length=32)
    assert key_of({}, body, off).reason == "prefix"
    none = KeyPolicy(use_user_field=False, prefix_affinity=False)
    assert key_of({}, body, none).reason == "least_loaded"


def test_character_prefix_follows_the_conversation_start() -> None:
    turn1 = key_of({}, chat(("system", SYSTEM), ("user", "first")), POLICY)
    turn2 = key_of(
        {}, chat(("system", SYSTEM), ("user", "first"), ("assistant", "x"), ("user", "y")), POLICY
    )
    other = key_of({}, chat(("system", "Another prompt. " * 20), ("user", "first")), POLICY)
    assert turn1.reason == "prefix" and turn1 == turn2 and turn1 != other
    # Shorter than one 64-character block: nothing an engine could reuse.
    assert key_of({}, chat(("user", "hi")), POLICY).reason == "least_loaded"


def test_prefix_keys_round_down_to_whole_blocks() -> None:
    ids = list(range(40))
    assert token_prefix_key(ids, 100) == token_prefix_key(ids[:32], 100)
    assert token_prefix_key(ids, 100) != token_prefix_key(ids[:16], 100)
    assert token_prefix_key(ids[:15], 100) is None
    assert token_prefix_key(ids, 20) == token_prefix_key(ids[:16], 20)
    assert char_prefix_key("a" * 127, 100) == char_prefix_key("a" * 64, 100)
    assert char_prefix_key("a" * 63, 100) is None


class FakeTokenizer:
    def __init__(self) -> None:
        self.calls: list[Any] = []

    def chat(
        self, messages: list[Any], add_generation_prompt: bool, kwargs: Any, tools: Any = None
    ) -> list[int]:
        self.calls.append((messages, add_generation_prompt, kwargs))
        if messages[0].get("role") == "bogus":
            raise ValueError("the template rejects it")
        return [ord(c) for c in "".join(m["content"] for m in messages)]

    def text(self, prompt: str) -> list[int]:
        return [ord(c) for c in prompt]


def test_token_prefix_through_the_tokenizer() -> None:
    tok = FakeTokenizer()
    key = key_of({}, chat(("system", "s" * 40), ("user", "q")), POLICY, tok)
    assert key == RoutingKey("prefix", token_prefix_key([ord("s")] * 32, 32))
    assert tok.calls[0][1] is True
    # What the template rejects, the engine rejects: any engine will do.
    assert key_of({}, chat(("bogus", "x" * 40)), POLICY, tok).reason == "least_loaded"
    completion = json.dumps({"prompt": "p" * 40}).encode()
    assert key_of({}, completion, POLICY, tok).key == token_prefix_key([ord("p")] * 40, 32)


def test_token_id_prompts_need_no_tokenizer() -> None:
    ids = list(range(100, 150))
    for prompt in (ids, [ids, [1, 2, 3]]):
        body = json.dumps({"prompt": prompt}).encode()
        assert key_of({}, body, POLICY).key == token_prefix_key(ids, 32)
    batch = json.dumps({"prompt": ["q" * 70, "z"]}).encode()
    assert key_of({}, batch, POLICY).key == char_prefix_key("q" * 70, 32)


@pytest.mark.parametrize("body", [None, "prompt", [1, 2], {"messages": "x"}])
def test_unusable_bodies_go_least_loaded(body: Any) -> None:
    assert routing_key({}, body, POLICY).reason == "least_loaded"


# ------------------------------------------------------------------------------------------
# Choice, retry rule, headers, CLI contract (pure)
# ------------------------------------------------------------------------------------------


def test_hop_by_hop_headers_are_dropped() -> None:
    headers = [
        ("Connection", "keep-alive, X-Secret"),
        ("X-Secret", "1"),
        ("Transfer-Encoding", "chunked"),
        ("Keep-Alive", "5"),
        ("Content-Type", "application/json"),
        ("X-Session-Id", "s"),
        ("Host", "router"),
    ]
    kept = forwarded_headers(headers, frozenset({"host"}))
    assert sorted(kept) == ["Content-Type", "X-Session-Id"]


def test_retry_rule() -> None:
    assert may_retry(0, 1) and not may_retry(0, 0) and not may_retry(1, 3)
    ra = {"Retry-After": "1"}
    # Refusals before any work are retryable; an engine that answered or died is not.
    assert refused(429, ra) and refused(503, ra)
    assert not refused(503, {}) and not refused(500, ra) and not refused(429, {})
    # What counts against the breaker: an engine that died on the request, not one that
    # refused it or failed it alone.
    assert engine_failed(503, {}) and engine_failed(502, {}) and engine_failed(504, {})
    assert not engine_failed(503, ra) and not engine_failed(500, {}) and not engine_failed(400, {})


def test_balancer_affinity_bounded_load_and_exclusion() -> None:
    b = Balancer(load_factor=1.25)
    eps = [f"10.0.0.{i}:8000" for i in range(3)]
    b.set_endpoints(eps)
    home = b.choose("session:a")
    assert all(b.choose("session:a") == home for _ in range(5))
    for _ in range(3):
        b.acquire(home)
    # 3 in flight, 3 endpoints: capacity ceil(1.25 * 4 / 3) = 2, so the key walks on.
    assert b.choose("session:a") != home
    assert b.choose(None) != home
    for _ in range(3):
        b.release(home)
    others = frozenset(eps) - {home}
    assert b.choose("session:a", frozenset({home})) in others
    assert b.choose("session:a", frozenset(eps)) is None


def test_membership_change_moves_only_the_departed_keys() -> None:
    b = Balancer()
    b.set_endpoints(["a:1", "b:1", "c:1", "d:1"])
    before = {k: b.choose(f"session:{k}") for k in range(400)}
    b.acquire("d:1")
    b.set_endpoints(["a:1", "b:1", "c:1"])
    after = {k: b.choose(f"session:{k}") for k in range(400)}
    moved = {k for k in before if before[k] != after[k]}
    # Only d's keys moved (plus the few its one in-flight request nudges past the bound).
    assert {k for k in before if before[k] == "d:1"} <= moved
    assert len(moved - {k for k in before if before[k] == "d:1"}) <= 10
    # The departed endpoint's running request still counts until it ends.
    assert b.in_flight["d:1"] == 1
    b.release("d:1")
    assert "d:1" not in b.in_flight


def test_cli_accepts_the_operator_contract(capsys) -> None:
    spec = RoutingSpec.model_validate(
        {"sessionHeader": "x-conv", "useUserField": False, "prefixLength": 128}
    )
    ns = parse_args(
        router_args(
            port=ROUTER_PORT,
            engine_service="chat-engine",
            engine_port=ENGINE_PORT,
            namespace="ml",
            routing=spec,
        )
    )
    assert (ns.engine_service, ns.namespace, ns.engine_port, ns.port) == (
        "chat-engine", "ml", 8000, 8080,
    )  # fmt: skip
    s = settings_from(ns)
    assert s.policy == KeyPolicy("x-conv", False, True, 128)
    assert (s.load_factor, s.hold_timeout) == (1.25, 120.0)
    static = parse_args(["--endpoints", "127.0.0.1:1, 127.0.0.1:2", "--tokenizer", "/t"])
    assert static.endpoints == {"127.0.0.1:1", "127.0.0.1:2"} and static.tokenizer == "/t"
    for neither_or_both in ([], ["--endpoints", "a:1", "--engine-service", "x"]):
        with pytest.raises(SystemExit):
            parse_args(neither_or_both)
        assert "give one of --engine-service and --endpoints" in capsys.readouterr().err
    with pytest.raises(ValueError):
        parse_static("nohost")
    # The upstream timeouts: the defaults, given values, and no zero or endless one.
    assert (s.upstream_first_byte_timeout, s.upstream_idle_timeout) == (600.0, 120.0)
    timeouts = ["--upstream-first-byte-timeout", "30", "--upstream-idle-timeout", "5"]
    s = settings_from(parse_args(["--endpoints", "a:1", *timeouts]))
    assert (s.upstream_first_byte_timeout, s.upstream_idle_timeout) == (30.0, 5.0)
    for bad in (["--upstream-idle-timeout", "0"], ["--upstream-first-byte-timeout", "inf"]):
        with pytest.raises(SystemExit):
            parse_args(["--endpoints", "a:1", *bad])


def test_the_body_limit_takes_a_size_with_a_unit(capsys) -> None:
    assert parse_args(["--endpoints", "a:1"]).max_body_bytes == 16 << 20
    for given, size in (("8Mi", 8 << 20), ("2MB", 2_000_000), ("65536", 65536)):
        assert parse_args(["--endpoints", "a:1", "--max-body-bytes", given]).max_body_bytes == size
    for bad in ("8 megs", "1K"):  # not a size; under the least body allowed
        with pytest.raises(SystemExit):
            parse_args(["--endpoints", "a:1", "--max-body-bytes", bad])
    assert "argument --max-body-bytes: '8 megs' is not a size" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------
# EndpointSlices
# ------------------------------------------------------------------------------------------


def _slice(name: str, version: str, *endpoints: tuple[str, bool | None]) -> dict[str, Any]:
    eps = []
    for addr, ready in endpoints:
        ep: dict[str, Any] = {"addresses": [addr]}
        if ready is not None:
            ep["conditions"] = {"ready": ready}
        eps.append(ep)
    return {"metadata": {"name": name, "resourceVersion": version}, "endpoints": eps}


def test_slice_endpoints_ready_only() -> None:
    s = _slice(
        "a", "1", ("10.0.0.1", True), ("10.0.0.2", False), ("10.0.0.3", None), ("fd00::1", True)
    )
    assert slice_endpoints(s, 8000) == {"10.0.0.1:8000", "10.0.0.3:8000", "[fd00::1]:8000"}
    assert slice_endpoints({"metadata": {"name": "x"}, "endpoints": None}, 1) == frozenset()
    ss = SliceSet(8000)
    ss.replace([s, _slice("b", "1", ("10.0.1.1", True))])
    ss.apply("DELETED", s)
    assert ss.endpoints() == {"10.0.1.1:8000"}


@pytest.mark.asyncio
async def test_in_cluster_config(tmp_path: Path) -> None:
    (tmp_path / "token").write_text("tok")
    (tmp_path / "ca.crt").write_text("-----BEGIN CERTIFICATE-----\n")
    env = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}
    cfg = await load_configuration(env, tmp_path)
    assert cfg.host == "https://10.96.0.1:443"
    assert cfg.ssl_ca_cert == str(tmp_path / "ca.crt")
    assert await cfg.get_api_key_with_prefix("BearerToken") == "Bearer tok"
    with pytest.raises(ConfigException):  # outside a cluster: the kubeconfig, here none
        await load_configuration({"KUBECONFIG": str(tmp_path / "none")}, tmp_path)


def kubeconfig(path: Path, server: str, user: dict[str, Any]) -> Path:
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "dev",
        "clusters": [{"name": "dev", "cluster": {"server": server}}],
        "users": [{"name": "dev", "user": user}],
        "contexts": [{"name": "dev", "context": {"cluster": "dev", "user": "dev"}}],
    }))  # fmt: skip
    return path


@pytest.mark.asyncio
async def test_watcher_lists_watches_and_relists(tmp_path: Path) -> None:
    seen: list[dict[str, str]] = []
    lists = [
        [_slice("s1", "10", ("10.0.0.1", True), ("10.0.0.2", False))],
        [_slice("s1", "30", ("10.0.0.9", True))],
    ]
    events = [
        {"type": "MODIFIED", "object": _slice("s1", "11", ("10.0.0.1", True), ("10.0.0.2", True))},
        {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "12"}}},
        {"type": "ADDED", "object": _slice("s2", "13", ("10.0.0.3", True))},
        {"type": "DELETED", "object": _slice("s1", "14")},
    ]

    async def handler(request: web.Request) -> web.StreamResponse:
        seen.append({**request.query, "auth": request.headers.get("Authorization", "")})
        if "watch" not in request.query:
            items = lists.pop(0)
            version = items[0]["metadata"]["resourceVersion"]
            return web.json_response({"metadata": {"resourceVersion": version}, "items": items})
        resp = web.StreamResponse()
        await resp.prepare(request)
        if request.query["resourceVersion"] == "10":
            for ev in events:
                await resp.write(json.dumps(ev).encode() + b"\n")
                await asyncio.sleep(0.01)
        elif request.query["resourceVersion"] == "14":
            gone = {"kind": "Status", "code": 410, "message": "too old"}
            await resp.write(json.dumps({"type": "ERROR", "object": gone}).encode() + b"\n")
        else:
            await asyncio.sleep(30)
        return resp

    app = web.Application()
    app.router.add_get("/apis/discovery.k8s.io/v1/namespaces/ml/endpointslices", handler)
    changes: list[frozenset[str]] = []
    async with serving(app) as addr:
        env = {
            "KUBECONFIG": str(kubeconfig(tmp_path / "kc", f"http://{addr}", {"token": "sekret"}))
        }

        async def connect() -> Configuration:
            return await load_configuration(env, tmp_path)

        watcher = EndpointSliceWatcher(connect, "ml", "chat-engine", 8000, changes.append)
        task = asyncio.create_task(watcher.run())
        deadline = time.monotonic() + 10
        while len(seen) < 5 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        task.cancel()
    assert changes == [
        {"10.0.0.1:8000"},
        {"10.0.0.1:8000", "10.0.0.2:8000"},
        {"10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"},
        {"10.0.0.3:8000"},
        {"10.0.0.9:8000"},  # after the 410, from the second list
    ]
    assert all(q["labelSelector"] == "kubernetes.io/service-name=chat-engine" for q in seen)
    assert all(q["auth"] == "Bearer sekret" for q in seen)
    assert [q.get("resourceVersion") for q in seen] == [None, "10", "14", None, "30"]


# ------------------------------------------------------------------------------------------
# The proxy, against fake engines
# ------------------------------------------------------------------------------------------


class FakeEngine:
    """Streams ``chunks`` SSE events ``gap`` seconds apart; ``mode`` makes it fail."""

    def __init__(self, name: str, mode: str = "ok", chunks: int = 5, gap: float = 0.0) -> None:
        self.name, self.mode, self.chunks, self.gap = name, mode, chunks, gap
        self.hits = 0
        self.headers: list[CIMultiDict[str]] = []
        self.cancelled = asyncio.Event()
        self.done_at = 0.0
        self.metrics = ""  # its /metrics exposition; empty: it has none (404)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.handle)
        app.router.add_get("/metrics", self.expose)
        return app

    async def expose(self, _request: web.Request) -> web.Response:
        if not self.metrics:
            raise web.HTTPNotFound()
        return web.Response(text=self.metrics, content_type="text/plain")

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.hits += 1
        self.headers.append(CIMultiDict(request.headers))
        await request.read()
        if self.mode == "500":
            return web.json_response({"error": {"message": "boom"}}, status=500)
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "X-Engine": self.name}
        )
        await resp.prepare(request)
        try:
            for i in range(self.chunks):
                await resp.write(f"data: {self.name}-{i}\n\n".encode())
                if self.mode == "break" and i == 1:
                    assert request.transport is not None
                    request.transport.close()
                    return resp
                await asyncio.sleep(self.gap)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        await resp.write(b"data: [DONE]\n\n")
        self.done_at = time.monotonic()
        await resp.write_eof()
        return resp


def expected_body(name: str, chunks: int = 5) -> bytes:
    return b"".join(f"data: {name}-{i}\n\n".encode() for i in range(chunks)) + b"data: [DONE]\n\n"


@asynccontextmanager
async def fleet(
    *engines: FakeEngine, hold_timeout: float = 5.0
) -> AsyncIterator[tuple[Router, str, list[str]]]:
    """The router (its URL) in front of the fake engines (their host:ports)."""
    async with contextlib.AsyncExitStack() as stack:
        addrs = [await stack.enter_async_context(serving(e.app())) for e in engines]
        settings = RouterSettings(prefix_length=POLICY.prefix_length, hold_timeout=hold_timeout)
        router = Router(settings)
        router.set_endpoints(addrs)
        url = await stack.enter_async_context(serving(build_app(router)))
        yield router, f"http://{url}", addrs


def key_for(router: Router, endpoint: str) -> str:
    """A session id the router sends to ``endpoint``."""
    return next(f"s{i}" for i in range(1000) if router.balancer.choose(f"session:s{i}") == endpoint)


@pytest.mark.asyncio
async def test_streams_pass_through_unbuffered() -> None:
    engine = FakeEngine("a", gap=0.2)
    async with fleet(engine) as (router, url, addrs), aiohttp.ClientSession() as s:
        async with s.post(f"{url}/v1/chat/completions?x=1", data=chat(("user", "hi")),
                          headers={"X-Session-Id": "k"}) as r:  # fmt: skip
            first = await r.content.readuntil(b"\n\n")
            first_at = time.monotonic()
            rest = await r.read()
        assert r.status == 200 and r.headers["X-Engine"] == "a"
        assert first + rest == expected_body("a")
        # The first event arrived while the engine was still generating the rest.
        assert engine.done_at - first_at > 0.5
        assert engine.headers[0]["X-Session-Id"] == "k"
        assert router.balancer.in_flight == {addrs[0]: 0}


@pytest.mark.asyncio
async def test_connection_refused_is_retried_elsewhere() -> None:
    live = FakeEngine("live")
    async with fleet(live) as (router, url, addrs), aiohttp.ClientSession() as s:
        dead = "127.0.0.1:1"
        router.set_endpoints([*addrs, dead])
        sid = key_for(router, dead)
        async with s.post(f"{url}/v1/chat/completions", data=b"{}",
                          headers={"x-session-id": sid}) as r:  # fmt: skip
            assert r.status == 200 and await r.read() == expected_body("live")
        metrics = await (await s.get(f"{url}/metrics")).text()
    assert (
        f'kvfleet_router_upstream_errors_total{{endpoint="{dead}",kind="connect"}} 1.0' in metrics
    )
    assert "kvfleet_router_retries_total 1.0" in metrics


@pytest.mark.asyncio
async def test_a_500_is_passed_on_not_retried() -> None:
    bad, good = FakeEngine("bad", mode="500"), FakeEngine("good")
    async with fleet(bad, good) as (router, url, addrs), aiohttp.ClientSession() as s:
        sid = key_for(router, addrs[0])
        async with s.post(f"{url}/v1/chat/completions", data=b"{}",
                          headers={"x-session-id": sid}) as r:  # fmt: skip
            assert r.status == 500 and (await r.json())["error"]["message"] == "boom"
        assert (bad.hits, good.hits) == (1, 0)


@pytest.mark.asyncio
async def test_a_stream_broken_midway_fails_visibly_without_retry() -> None:
    """Its events so far, then the error event and [DONE] the engine ends a failed stream with."""
    broken, spare = FakeEngine("x", mode="break"), FakeEngine("y")
    async with fleet(broken, spare) as (router, url, addrs), aiohttp.ClientSession() as s:
        sid = key_for(router, addrs[0])
        async with s.post(f"{url}/v1/chat/completions", data=b"{}",
                          headers={"x-session-id": sid}) as r:  # fmt: skip
            assert r.status == 200
            body = await r.read()
        events = body.split(b"\n\n")
        assert events[:2] == [b"data: x-0", b"data: x-1"] and events[3:] == [b"data: [DONE]", b""]
        assert json.loads(events[2].removeprefix(b"data: "))["error"]["code"] == (
            "upstream_stream_broken"
        )
        assert (broken.hits, spare.hits) == (1, 0)
        metrics = await (await s.get(f"{url}/metrics")).text()
    assert f'endpoint="{addrs[0]}",kind="stream"}} 1.0' in metrics


@pytest.mark.asyncio
async def test_client_disconnect_cancels_the_upstream_request() -> None:
    engine = FakeEngine("a", chunks=100, gap=0.05)
    async with fleet(engine) as (router, url, _), aiohttp.ClientSession() as s:
        async with s.post(f"{url}/v1/chat/completions", data=b"{}") as r:
            await r.content.readuntil(b"\n\n")
        # Leaving the block unread closes the connection.
        await asyncio.wait_for(engine.cancelled.wait(), 5)
        await asyncio.sleep(0.05)
        assert sum(router.balancer.in_flight.values()) == 0


@pytest.mark.asyncio
async def test_requests_are_held_until_an_engine_is_ready() -> None:
    engine = FakeEngine("late")
    async with fleet(engine) as (router, url, addrs), aiohttp.ClientSession() as s:
        router.set_endpoints([])
        req = asyncio.create_task(s.post(f"{url}/v1/chat/completions", data=b"{}"))
        await asyncio.sleep(0.3)
        metrics = await (await s.get(f"{url}/metrics")).text()
        assert "kvfleet_router_held_requests 1.0" in metrics
        assert "kvfleet_router_ready_endpoints 0.0" in metrics
        router.set_endpoints(addrs)
        r = await asyncio.wait_for(req, 5)
        assert r.status == 200 and await r.read() == expected_body("late")
        metrics = await (await s.get(f"{url}/metrics")).text()
        assert "kvfleet_router_held_requests 0.0" in metrics


@pytest.mark.asyncio
async def test_held_past_the_timeout_gets_503_with_retry_after() -> None:
    async with fleet(FakeEngine("a"), hold_timeout=0.3) as (router, url, _):
        router.set_endpoints([])
        async with aiohttp.ClientSession() as s:
            start = time.monotonic()
            async with s.post(f"{url}/v1/chat/completions", data=b"{}") as r:
                assert r.status == 503 and r.headers["Retry-After"] == "5"
                assert (await r.json())["error"]["type"] == "service_unavailable"
            assert 0.3 <= time.monotonic() - start < 2
            metrics = await (await s.get(f"{url}/metrics")).text()
    assert "kvfleet_router_hold_timeouts_total 1.0" in metrics


@pytest.mark.asyncio
async def test_health_and_metrics() -> None:
    async with fleet(FakeEngine("a")) as (_, url, addrs), aiohttp.ClientSession() as s:
        assert await (await s.get(f"{url}/health")).json() == {"status": "ok", "endpoints": 1}
        await (
            await s.post(f"{url}/v1/chat/completions", data=chat(("user", "x"), user="u"))
        ).read()
        text = await (await s.get(f"{url}/metrics")).text()
    for line in (
        'kvfleet_router_requests_total{reason="user"} 1.0',
        'kvfleet_router_requests_total{reason="session"} 0.0',
        'kvfleet_router_requests_total{reason="prefix"} 0.0',
        'kvfleet_router_requests_total{reason="least_loaded"} 0.0',
        f'kvfleet_router_in_flight{{endpoint="{addrs[0]}"}} 0.0',
        'kvfleet_router_prefix_key_mode{mode="characters"} 1.0',
        'kvfleet_router_prefix_key_mode{mode="tokens"} 0.0',
        "kvfleet_router_added_latency_seconds_count 1.0",
        "kvfleet_router_held_requests 0.0",
    ):
        assert line in text, line


@pytest.mark.asyncio
async def test_embeddings_pass_through_least_loaded() -> None:
    """/v1/embeddings reaches an engine as it is, and is routed by load alone: its session
    header and user field, which would pin a chat request, are not keys."""
    engine = FakeEngine("a", chunks=1)
    app = engine.app()
    app.router.add_post("/v1/embeddings", engine.handle)
    body = json.dumps({"model": "m", "input": ["x" * 300], "user": "u"}).encode()
    async with contextlib.AsyncExitStack() as stack, aiohttp.ClientSession() as s:
        addr = await stack.enter_async_context(serving(app))
        router = Router(RouterSettings(prefix_length=POLICY.prefix_length))
        router.set_endpoints([addr])
        url = "http://" + await stack.enter_async_context(serving(build_app(router)))
        async with s.post(f"{url}/v1/embeddings", data=body,
                          headers={"X-Session-Id": "k"}) as r:  # fmt: skip
            assert r.status == 200 and await r.read() == expected_body("a", 1)
        text = await (await s.get(f"{url}/metrics")).text()
    assert engine.hits == 1 and engine.headers[0]["X-Session-Id"] == "k"
    assert 'kvfleet_router_requests_total{reason="least_loaded"} 1.0' in text
    assert 'kvfleet_router_requests_total{reason="session"} 0.0' in text


@pytest.mark.asyncio
@pytest.mark.parametrize("path", ["/v1/load_lora_adapter", "/v1/unload_lora_adapter"])
async def test_the_engines_adapter_endpoints_are_not_routed(path: str) -> None:
    """Loading or unloading an engine's adapters (which reads its file system and changes what
    it serves every tenant) is the operator's, on each engine: a client gets a 404 and no
    engine sees the request."""
    engine = FakeEngine("a", chunks=1)
    app = engine.app()
    app.router.add_post(path, engine.handle)
    body = json.dumps({"lora_name": "x", "lora_path": "/etc"}).encode()
    async with contextlib.AsyncExitStack() as stack, aiohttp.ClientSession() as s:
        addr = await stack.enter_async_context(serving(app))
        router = Router(RouterSettings(prefix_length=POLICY.prefix_length))
        router.set_endpoints([addr])
        url = "http://" + await stack.enter_async_context(serving(build_app(router)))
        async with s.post(f"{url}{path}", data=body) as r:
            assert r.status == 404
            assert (await r.json())["error"]["code"] == "not_found"
    assert engine.hits == 0


@pytest.mark.asyncio
async def test_the_engines_kv_events_are_not_routed() -> None:
    """An engine's KV events (its cache's block hashes) are for the routers that subscribe to
    each engine, never for a client through the router's proxy."""
    engine = FakeEngine("a", chunks=1)
    app = engine.app()
    app.router.add_get("/kv_events", engine.handle)
    async with contextlib.AsyncExitStack() as stack, aiohttp.ClientSession() as s:
        addr = await stack.enter_async_context(serving(app))
        router = Router(RouterSettings(prefix_length=POLICY.prefix_length))
        router.set_endpoints([addr])
        url = "http://" + await stack.enter_async_context(serving(build_app(router)))
        async with s.get(f"{url}/kv_events") as r:
            assert r.status == 404
            assert (await r.json())["error"]["type"] == "not_found_error"
    assert engine.hits == 0


@pytest.mark.asyncio
async def test_requests_past_their_home_engine_are_counted_as_spilled() -> None:
    a, b = FakeEngine("a", gap=0.1), FakeEngine("b", gap=0.1)
    async with fleet(a, b) as (router, url, addrs), aiohttp.ClientSession() as s:
        key = key_for(router, addrs[0])

        async def one() -> str:
            async with s.post(f"{url}/v1/chat/completions", data=chat(("user", "hi")),
                              headers={"X-Session-Id": key}) as r:  # fmt: skip
                await r.read()
                return r.headers["X-Engine"]

        # Alone, the session stays home.
        assert await one() == "a"
        # Three at once on two engines: the bound (ceil(1.25 * 3 / 2) = 2) sends the third away.
        assert sorted(await asyncio.gather(one(), one(), one())) == ["a", "a", "b"]
        metrics = await (await s.get(f"{url}/metrics")).text()
    assert "kvfleet_router_spilled_total 1.0" in metrics


def test_a_responses_input_keys_as_the_chat_messages_it_stands_for() -> None:
    messages = [("system", SYSTEM), ("user", "first")]
    as_chat = key_of({}, chat(*messages), POLICY)
    body = {"model": "m", "instructions": SYSTEM, "input": "first"}
    as_responses = key_of({}, json.dumps(body).encode(), POLICY)
    assert as_chat.reason == "prefix" and as_responses == as_chat
    items = [{"role": "system", "content": [{"type": "input_text", "text": SYSTEM}]},
             {"role": "user", "content": "first"}]  # fmt: skip
    assert key_of({}, json.dumps({"input": items}).encode(), POLICY) == as_chat
    tok = FakeTokenizer()
    assert key_of({}, json.dumps(body).encode(), POLICY, tok) == key_of(
        {}, chat(*messages), POLICY, tok
    )
    # An input the engine will refuse (an image) goes to any engine, which says why.
    image = [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]
    assert key_of({}, json.dumps({"input": image}).encode(), POLICY).reason == "least_loaded"


def engine_metrics(*resident: tuple[str, str]) -> str:
    lines = [
        'vllm:num_requests_running{model_name="m"} 0',
        'vllm:num_requests_waiting{model_name="m"} 0',
    ]
    lines += [f'kvfleet_engine_lora_resident{{lora_name="{n}",tier="{t}"}} 1' for n, t in resident]
    lines.append(
        'vllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""} 1'
    )
    return "\n".join(lines) + "\n"


@pytest.mark.asyncio
async def test_a_request_for_an_adapter_goes_where_it_is_resident() -> None:
    holder, other = FakeEngine("holder"), FakeEngine("other")
    holder.metrics = engine_metrics(("sql", "gpu"))
    other.metrics = engine_metrics()
    async with fleet(holder, other) as (router, url, addrs), aiohttp.ClientSession() as s:
        for _ in range(100):  # the first scrape of the engines' metrics
            if router.balancer.serves_adapter("sql"):
                break
            await asyncio.sleep(0.05)
        sid = key_for(router, addrs[1])  # the session's home is the other engine

        async def engine_for(model: str) -> str:
            async with s.post(f"{url}/v1/chat/completions", data=chat(("user", "hi"), model=model),
                              headers={"X-Session-Id": sid}) as r:  # fmt: skip
                await r.read()
                return r.headers["X-Engine"]

        assert await engine_for("sql") == "holder"
        assert await engine_for("base-model") == "other"  # not an adapter: its key decides
        metrics = await (await s.get(f"{url}/metrics")).text()
    assert 'kvfleet_router_adapter_placements_total{reason="resident_gpu"} 1.0' in metrics
