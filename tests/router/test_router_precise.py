"""Precise prefix scoring in the router against fake engines that serve KV event streams
(tests/support/kv_event_stream.py): requests go to the engine the events say holds their
prompt, replicas fed the same events agree (one started late included), a gap resyncs from a
snapshot, stale views fall back to approximate routing, and a router without a tokenizer
fetches the engines' (with their API key) and scores precisely from then on."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kvfleet.engine.server.tokenizer_bundle import bundle_bytes
from kvfleet.router.prompt_tokenizer import EngineTokenizer
from kvfleet.router.proxy import Router, build_app
from kvfleet.router.routing_key import token_prefix_key
from kvfleet.router.settings import RouterSettings
from tests.support.kv_event_stream import CharTokenizer, FakeKvEngine, stored
from tests.support.servers import serving
from tests.support.tiny_model import build_tokenizer

TOKENIZER = CharTokenizer()
SYSTEM = "You answer questions about the fleet. " * 4
OTHER = "Another tenant's prompt. " * 6


def messages(user: str, system: str = SYSTEM) -> list[dict[str, str]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def tokens(user: str, system: str = SYSTEM) -> list[int]:
    return TOKENIZER.chat(messages(user, system), True, None)


async def until(check: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.02)


@asynccontextmanager
async def engines(*names: str) -> AsyncIterator[dict[str, FakeKvEngine]]:
    """Fake engines by host:port."""
    async with AsyncExitStack() as stack:
        fleet = {}
        for name in names:
            engine = FakeKvEngine(name)
            fleet[await stack.enter_async_context(serving(engine.app()))] = engine
        yield fleet


class Replica:
    """A router serving on a free port, with its index."""

    def __init__(self, router: Router, addr: str) -> None:
        assert router.index is not None
        self.router, self.index, self.url = router, router.index, f"http://{addr}"

    def live(self) -> frozenset[str]:
        return self.index.live(self.router.balancer.clock())

    async def served_by(self, msgs: list[dict[str, str]], **headers: str) -> str:
        """The name of the engine that answered a chat request of these messages."""
        body = {"model": "m", "messages": msgs, "max_tokens": 1}
        async with (
            aiohttp.ClientSession() as s,
            s.post(f"{self.url}/v1/chat/completions", json=body, headers=headers) as resp,
        ):
            assert resp.status == 200
            return (await resp.json())["engine"]

    def sample(self, name: str, **labels: str) -> float | None:
        return self.router.metrics.registry.get_sample_value(name, labels)

    def decisions(self, decision: str) -> float | None:
        return self.sample("kvfleet_router_prefix_scoring_total", decision=decision)

    def away_from(self, endpoint: str) -> str:
        """A session id whose home on the ring is not ``endpoint``: approximate routing would
        send its requests elsewhere."""
        ring = self.router.balancer.ring
        return next(f"s{i}" for i in range(100) if ring.home(f"session:s{i}") != endpoint)


@asynccontextmanager
async def replica(fleet: dict[str, FakeKvEngine], **settings: Any) -> AsyncIterator[Replica]:
    defaults = {"kv_events_stale_after": 1.0, "engine_load_interval": 0}
    router = Router(RouterSettings(**{**defaults, **settings}), TOKENIZER)
    router.set_endpoints(fleet)
    async with serving(build_app(router)) as addr:
        r = Replica(router, addr)
        broken = {ep for ep, e in fleet.items() if e.garbage is not None}
        await until(lambda: r.live() == set(fleet) - broken)
        yield r


@pytest.mark.asyncio
async def test_requests_go_where_the_events_say_the_prefix_is_and_replicas_agree() -> None:
    async with engines("a", "b") as fleet:
        (addr_a, a), (addr_b, b) = fleet.items()
        async with replica(fleet) as first:
            # Engine b caches a conversation's first turn; its second turn goes there, though
            # its session's home on the ring is a.
            b.push(stored(tokens("first turn")))
            await until(lambda: first.index.size(addr_b) > 0)
            sid = first.away_from(addr_b)
            turn = messages("first turn, and the second")
            assert await first.served_by(turn, **{"x-session-id": sid}) == "b"
            assert first.decisions("cached") == 1
            # A replica started now learns b's blocks from its snapshot; a prompt a caches
            # after that, both learn from events; both send each request where the other does.
            async with replica(fleet) as late:
                a.push(stored(tokens("other", OTHER)))
                await until(lambda: first.index.size(addr_a) > 0 and late.index.size(addr_a) > 0)
                for r in (first, late):
                    assert await r.served_by(turn, **{"x-session-id": sid}) == "b"
                    other = messages("other", OTHER)
                    assert await r.served_by(other, **{"x-session-id": r.away_from(addr_a)}) == "a"
                assert late.decisions("cached") == 2


@pytest.mark.asyncio
async def test_a_gap_resyncs_from_a_snapshot_and_stale_views_fall_back() -> None:
    async with engines("a", "b") as fleet:
        (_, a), (addr_b, b) = fleet.items()
        async with replica(fleet) as r:
            # Lost lines: the router opens the stream again and the snapshot has the blocks.
            b.push(stored(tokens("lost")), seq_skip=1)
            await until(lambda: b.connections == 2 and r.index.size(addr_b) > 0)
            assert r.sample("kvfleet_router_kv_resyncs_total", reason="gap") == 1
            found = messages("lost, found")
            assert await r.served_by(found, **{"x-session-id": r.away_from(addr_b)}) == "b"
            # Silent streams go stale: the request is routed as approximate routing routes it.
            a.heartbeats = b.heartbeats = False
            await until(lambda: not r.live(), timeout=5)
            assert r.sample("kvfleet_router_kv_stale_engines") == 2
            before = r.decisions("fallback") or 0
            assert await r.served_by(found, **{"x-session-id": r.away_from(addr_b)}) == a.name
            assert r.decisions("fallback") == before + 1


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("garbage", "reason"),
    [
        (b"not json\n", "invalid"),
        (b'{"type": "heartbeat", "seq": 0}\n', "invalid"),  # no snapshot first
        (b"[" * 6000, "invalid"),  # a line past the bound (5216 bytes at 16 blocks)
    ],
)
async def test_a_hostile_stream_is_dropped_and_its_engine_routed_approximately(
    garbage: bytes, reason: str
) -> None:
    async with engines("a", "b") as fleet:
        (addr_a, a), (addr_b, b) = fleet.items()
        a.garbage = garbage
        b.push(stored(tokens("q")))
        async with replica(fleet, kv_index_max_blocks=16) as r:
            await until(
                lambda: (r.sample("kvfleet_router_kv_resyncs_total", reason=reason) or 0) > 0
            )
            assert addr_a not in r.index.engines()
            assert r.sample("kvfleet_router_kv_stale_engines") == 1
            # b's events still count, and requests are served.
            sid = r.away_from(addr_b)
            assert await r.served_by(messages("q"), **{"x-session-id": sid}) == "b"


def test_the_prefix_key_and_the_hashes_come_from_one_tokenization() -> None:
    calls: list[Any] = []

    class Counting(CharTokenizer):
        def chat(
            self, messages: list[Any], add_generation_prompt: bool, template_kwargs: Any,
            tools: Any = None,
        ) -> list[int]:  # fmt: skip
            calls.append(messages)
            return super().chat(messages, add_generation_prompt, template_kwargs, tools)

    counting = Counting()
    router = Router(RouterSettings(engine_load_interval=0), counting)
    rk, hashes = router._tokenized({}, {"messages": messages("q")}, None, counting)
    assert len(calls) == 1
    assert rk.key == token_prefix_key(tokens("q"), 256)
    assert len(hashes) == len(tokens("q")) // 16 > 0


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> tuple[bytes, EngineTokenizer]:
    """The tiny test model's tokenizer as the engine serves it (its GET /tokenizer body), and
    as a router given --tokenizer loads it."""
    folder = tmp_path_factory.mktemp("tiny-tokenizer")
    return bundle_bytes(build_tokenizer(folder)), EngineTokenizer(str(folder))


def fetch_failures(r: Router, reason: str) -> float:
    sample = r.metrics.registry.get_sample_value(
        "kvfleet_router_tokenizer_fetch_failures_total", {"reason": reason}
    )
    return sample or 0


@pytest.mark.asyncio
async def test_without_a_tokenizer_the_router_fetches_the_engines_then_routes_precisely(
    tiny_tokenizer: tuple[bytes, EngineTokenizer],
) -> None:
    bundle, local = tiny_tokenizer
    async with engines("a", "b") as fleet:
        (_, a), (addr_b, b) = fleet.items()
        for engine in (a, b):
            engine.api_key = "engine-key"
        settings = RouterSettings(kv_events_stale_after=1.0, engine_load_interval=0)
        # No key: every fetch is refused, and routing stays approximate.
        keyless = Router(settings, fetch_tokenizer=True)
        keyless.set_endpoints(fleet)
        async with serving(build_app(keyless)):
            await until(lambda: fetch_failures(keyless, "status") >= 2)
            assert keyless.tokenizer is None and a.connections == b.connections == 0
        router = Router(settings, fetch_tokenizer=True, engine_api_key="engine-key")
        router.set_endpoints(fleet)
        async with serving(build_app(router)) as addr:
            r = Replica(router, addr)
            # No engine serves a tokenizer yet: requests are routed on characters meanwhile.
            await until(lambda: fetch_failures(router, "status") >= 2)
            assert await r.served_by(messages("early")) in ("a", "b")
            assert r.sample("kvfleet_router_prefix_key_mode", mode="characters") == 1
            assert r.decisions("fallback") == 1
            b.tokenizer = bundle
            await until(lambda: router.tokenizer is not None, timeout=10)
            assert r.sample("kvfleet_router_prefix_key_mode", mode="tokens") == 1
            await until(lambda: r.live() == set(fleet))
            # Engine b caches a prompt (tokenized as the engines do); a request sharing its
            # head goes there, though its session's home on the ring is a.
            first = messages("Tell me about the fleet's routing.")
            b.push(stored(local.chat(first, True, None)))
            await until(lambda: r.index.size(addr_b) > 0)
            turn = messages("Tell me about the fleet's routing, and its cache.")
            assert await r.served_by(turn, **{"x-session-id": r.away_from(addr_b)}) == "b"
            assert r.decisions("cached") == 1
        # The router's key went to the engines' own endpoints only, never with clients'.
        assert a.authorizations + b.authorizations
        assert set(a.authorizations + b.authorizations) == {None}


@pytest.mark.asyncio
async def test_a_new_engine_with_another_tokenizer_gives_the_router_its_own(
    tiny_tokenizer: tuple[bytes, EngineTokenizer], tmp_path: Path
) -> None:
    """A rollout to another model: the engines that start have another tokenizer, and the
    router takes theirs; engines that start with the same one are asked by ETag (304)."""
    bundle, first = tiny_tokenizer
    other = build_tokenizer(tmp_path, vocab_size=300)
    async with engines("a", "b") as fleet:
        (_, a), (_, b) = fleet.items()
        a.tokenizer = b.tokenizer = bundle
        settings = RouterSettings(kv_events_stale_after=1.0, engine_load_interval=0)
        router = Router(settings, fetch_tokenizer=True)
        router.set_endpoints(fleet)
        async with serving(build_app(router)) as addr:
            r = Replica(router, addr)
            await until(lambda: r.live() == set(fleet))
            await until(lambda: 304 in a.tokenizer_statuses + b.tokenizer_statuses)
            assert router.tokenizer is not None
            text = "Where is the cache?"
            assert router.tokenizer.text(text) == first.text(text)
            # Engine b is replaced by one of another model.
            b.engine_id, b.tokenizer = "e2", bundle_bytes(other)
            b.disconnect()
            await until(lambda: router.tokenizer is not None and
                        router.tokenizer.text(text) == other(text).input_ids)  # fmt: skip
            assert b.tokenizer_statuses[-1] == 200
