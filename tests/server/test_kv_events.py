"""GET /kv_events on a live engine: a subscriber's snapshot plus the events after it are the
engine's prefix cache, exactly, through shared prefixes, evictions under pressure, an adapter's
requests and its unloading, reset_prefix_cache; heartbeats on a quiet stream; the subscriber
bound; a clean end at shutdown; nothing served with --no-kv-events."""

from __future__ import annotations

import asyncio
import json
import random
import socket

import pytest

from kvfleet.engine.config import EngineArgs
from kvfleet.engine.server.settings import ServerSettings
from kvfleet.protocol.block_hash import lora_extra_key, prompt_block_hashes
from kvfleet.protocol.kv_events import CONTENT_TYPE
from tests.support.kv_events import KVEventsReader
from tests.support.lora_adapters import write_peft_adapter
from tests.support.net import http_call
from tests.support.servers import engine_server, metric

BASE = "tiny"
# 23 usable blocks of 16 tokens: the prompts below (5 and 6 blocks each) evict one another.
NUM_BLOCKS = 24


@pytest.fixture(scope="module")
def adapter_dirs(model_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("kv-events-adapters")
    return [write_peft_adapter(model_dirs["llama"], root / f"a{i}", rank=4, seed=i) for i in (0, 1)]


def _settings(**kw) -> ServerSettings:
    return ServerSettings(host="127.0.0.1", port=0, served_model_name=[BASE], **kw)


@pytest.fixture(scope="module")
def server(model_dirs, adapter_dirs):
    args = EngineArgs(model=str(model_dirs["llama"]), dtype="float32", max_num_seqs=4,
                      num_gpu_blocks_override=NUM_BLOCKS, enable_lora=True,
                      lora_modules=[f"first={adapter_dirs[0]}"])  # fmt: skip
    with engine_server(args, _settings(enable_runtime_lora_updating=True)) as srv:
        yield srv


def _cached(server) -> set[str]:
    """The engine's prefix cache as hex (read between steps: the engine is idle)."""
    pool = server.srv.engine.core.kv_cache_manager.pool
    while True:
        try:
            return {h.hex() for h in list(pool.cached)}
        except RuntimeError:  # changed while read: a step was still running
            continue


def _complete(server, prompt: list[int], model: str = BASE) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": 3, "temperature": 0}
    status, _, raw = http_call(server.url + "/v1/completions", body)
    assert status == 200, raw


def _post(server, path: str, body: dict) -> None:
    status, _, raw = http_call(server.url + path, body)
    assert status == 200, raw


def _in_sync(server):
    cached = _cached(server)
    return lambda reader: reader.picture["gpu"] == cached and not reader.picture["cpu"]


def test_a_subscriber_sees_the_engines_cache_exactly(server, adapter_dirs):
    reader = KVEventsReader(server.url)
    # A subscriber that never reads: the engine generates on regardless.
    stalled = socket.create_connection(("127.0.0.1", int(server.url.rsplit(":", 1)[1])))
    stalled.sendall(b"GET /kv_events HTTP/1.1\r\nHost: x\r\n\r\n")
    try:
        assert reader.status == 200 and reader.content_type == CONTENT_TYPE
        reader.wait_for(lambda r: r.snapshot is not None)
        rng = random.Random(7)
        shared = [rng.randrange(3, 500) for _ in range(48)]
        prompts = [shared + [rng.randrange(3, 500) for _ in range(40)] for _ in range(3)]
        prompts += [[rng.randrange(3, 500) for _ in range(80)] for _ in range(6)]
        for prompt in prompts:
            _complete(server, prompt)
        reader.wait_for(_in_sync(server))
        assert reader.kinds["removed"] > 0, "no eviction: the cache was not under pressure"
        # A shared prefix is stored once, the prompts after it as chains from its last block.
        children = [e for e in reader.stored if e.parent_block_hash is not None]
        assert any(e.parent_block_hash == prompt_block_hashes(shared)[-1].hex() for e in children)

        # An adapter's blocks carry its name, and its hashes are the ones a router computes.
        _complete(server, prompts[-1], "first")
        reader.wait_for(_in_sync(server))
        lora_hashes = {h.hex() for h in prompt_block_hashes(prompts[-1], lora_extra_key("first"))}
        by_first = {h for e in reader.stored if e.lora_name == "first" for h in e.block_hashes}
        assert by_first == lora_hashes
        # An adapter unloaded takes its blocks with it.
        _post(server, "/v1/load_lora_adapter", {"lora_name": "second",
                                                "lora_path": str(adapter_dirs[1])})  # fmt: skip
        _complete(server, prompts[0], "second")
        second = {h.hex() for h in prompt_block_hashes(prompts[0], lora_extra_key("second"))}
        reader.wait_for(lambda r: second <= r.picture["gpu"])
        _post(server, "/v1/unload_lora_adapter", {"lora_name": "second"})
        reader.wait_for(lambda r: not second & r.picture["gpu"])
        reader.wait_for(_in_sync(server))

        # One who subscribes now starts from the same picture, at the same seq.
        late = KVEventsReader(server.url)
        late.wait_for(lambda r: r.snapshot is not None)
        assert late.engine_id == reader.engine_id and late.seq == reader.seq
        assert late.picture == reader.picture
        # Nothing happens: heartbeats at the last seq (the reader checks it).
        late.wait_for(lambda r: r.kinds["heartbeat"] >= 1, timeout=5)
        late.close()
        assert (
            metric(server, "kvfleet_engine_kv_events_published_total")
            >= reader.kinds["stored"] + reader.kinds["removed"]
        )
    finally:
        stalled.close()
        reader.close()


def test_reset_prefix_cache_is_published_as_cleared(server):
    reader = KVEventsReader(server.url)
    try:
        _complete(server, list(range(3, 60)))
        reader.wait_for(lambda r: r.snapshot is not None and bool(r.picture["gpu"]))
        reset = server.srv.engine.reset_prefix_cache()
        assert asyncio.run_coroutine_threadsafe(reset, server.loop).result(10)
        reader.wait_for(lambda r: r.kinds["cleared"] == 1 and not r.picture["gpu"])
        assert _cached(server) == set()
    finally:
        reader.close()


def test_a_subscriber_that_falls_behind_is_disconnected(server):
    """Here every subscriber falls behind (a 1-byte bound): it is cut off at the first batch, and
    the request goes on."""
    streams = server.srv.engine.kv_events
    bound = streams.max_queued_bytes
    reader = KVEventsReader(server.url)
    try:
        reader.wait_for(lambda r: r.snapshot is not None)
        streams.max_queued_bytes = 1
        _complete(server, list(range(100, 150)))
        reader.wait_for(lambda r: r.error is not None or r.ended.is_set())
        assert reader.kinds["batch"] == 0
        assert metric(server, "kvfleet_engine_kv_event_subscribers_dropped_total") == 1
    finally:
        streams.max_queued_bytes = bound
        reader.close()


def test_subscribers_are_bounded(server):
    streams = server.srv.engine.kv_events
    reader = KVEventsReader(server.url)
    limit = streams.max_subscribers
    try:
        reader.wait_for(lambda r: r.snapshot is not None)
        streams.max_subscribers = len(streams.subscribers)
        status, _, raw = http_call(server.url + "/kv_events")
        error = json.loads(raw)["error"]
        assert status == 429 and error["code"] == "too_many_subscribers", raw
        assert error["type"] == "rate_limit_error"
    finally:
        streams.max_subscribers = limit
        reader.close()


def test_the_stream_ends_cleanly_at_shutdown(model_dirs):
    args = EngineArgs(model=str(model_dirs["llama"]), dtype="float32", max_num_seqs=2)
    with engine_server(args, _settings()) as srv:
        reader = KVEventsReader(srv.url)
        reader.wait_for(lambda r: r.snapshot is not None)
    reader.ended.wait(10)
    assert reader.ended.is_set() and reader.error is None


def test_no_events_are_served_with_no_kv_events(model_dirs):
    args = EngineArgs(model=str(model_dirs["llama"]), dtype="float32", max_num_seqs=2,
                      kv_events=False)  # fmt: skip
    with engine_server(args, _settings()) as srv:
        status, _, raw = http_call(srv.url + "/kv_events")
        assert status == 404 and json.loads(raw)["error"]["type"] == "not_found_error"
        assert metric(srv, "kvfleet_engine_kv_event_subscribers") == 0
