"""The autoscaler's inputs from real engines: two ``kvfleet-engine serve`` processes on the CPU,
loaded with streaming requests beyond their batch size; the scraper reads their live metrics and
the decision function scales for the load, then back down once they are idle and the window has
passed (on a fake clock)."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from kvfleet.operator.metrics_scraper import Scraper, Target
from kvfleet.operator.scaling_policy import (
    Observation,
    PodMetrics,
    ScalingMemory,
    ScalingPolicy,
    decide,
)
from tests.support.net import free_port

MODEL = "tiny"
MAX_NUM_SEQS = 4
STREAMS_PER_ENGINE = 12  # 4 running, 8 waiting
POLICY = ScalingPolicy(min_replicas=1, max_replicas=8, target_queue_depth=4,
                       scale_down_stabilization_s=300)  # fmt: skip


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache with the tiny model built once, before two engines would race to build it."""
    cache = tmp_path_factory.mktemp("kvfleet-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVFLEET_CACHE_DIR", str(cache))
        from tests.support.tiny_model import tiny_model_path

        tiny_model_path()
    return cache


def _serve(port: int) -> list[str]:
    return [
        sys.executable, "-m", "kvfleet.engine.cli", "serve", "--host", "127.0.0.1",
        "--port", str(port), "--served-model-name", MODEL, "--max-num-seqs", str(MAX_NUM_SEQS),
    ]  # fmt: skip


@pytest.fixture
def engines(model_cache: Path, tmp_path: Path) -> Iterator[list[str]]:
    """Base URLs of two engine servers on the default model."""
    ports = [free_port(), free_port()]
    env = {**os.environ, "KVFLEET_CACHE_DIR": str(model_cache), "PYTHONUNBUFFERED": "1"}
    logs = [tmp_path / f"engine-{i}.log" for i in range(len(ports))]
    procs = [
        subprocess.Popen(_serve(port), env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
        for port, log in zip(ports, logs, strict=True)
    ]
    try:
        deadline = time.monotonic() + 120
        pending = set(range(len(procs)))
        while pending:
            for i in list(pending):
                assert procs[i].poll() is None, logs[i].read_text()
                try:
                    with socket.create_connection(("127.0.0.1", ports[i]), timeout=1):
                        pending.discard(i)
                except OSError:
                    pass
            assert time.monotonic() < deadline, "engines did not start"
            time.sleep(0.2)
        yield [f"http://127.0.0.1:{port}" for port in ports]
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(10)


async def _stream(session: aiohttp.ClientSession, url: str, i: int) -> None:
    body = {"model": MODEL, "prompt": f"load {i}", "max_tokens": 1500, "ignore_eos": True,
            "stream": True}  # fmt: skip
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for _ in resp.content:
            pass


async def _scrape_until(
    session: aiohttp.ClientSession, targets: list[Target], done, timeout: float = 60
) -> list[PodMetrics]:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        metrics = await Scraper(timeout=5, session=session).engines(targets)
        if done(metrics):
            return metrics
        assert asyncio.get_running_loop().time() < deadline, metrics
        await asyncio.sleep(0.1)


def test_decisions_follow_the_load_of_real_engines(engines):
    targets = [Target(f"engine-{i}", f"{url}/metrics") for i, url in enumerate(engines)]

    async def main() -> None:
        async with aiohttp.ClientSession() as scraper:
            idle = await _scrape_until(scraper, targets, lambda ms: all(m.answered for m in ms))
            assert [m.in_flight for m in idle] == [0, 0]
            d = decide(POLICY, Observation(2, idle), ScalingMemory(), 0.0)
            assert d.replicas == 2  # idle, but a new service keeps its size for the window

            async with aiohttp.ClientSession() as clients:
                load = [
                    asyncio.create_task(_stream(clients, url, i))
                    for url in engines
                    for i in range(STREAMS_PER_ENGINE)
                ]
                busy = await _scrape_until(
                    scraper,
                    targets,
                    lambda ms: all(
                        m.running == MAX_NUM_SEQS and m.in_flight == STREAMS_PER_ENGINE for m in ms
                    ),
                )
                assert all(m.waiting == STREAMS_PER_ENGINE - MAX_NUM_SEQS for m in busy)
                assert all(0 < (m.kv_cache_usage or 0) <= 1 for m in busy)
                up = decide(POLICY, Observation(2, busy), d.memory, 10.0)
                # 12 in flight per replica against a target of 4: three times the replicas.
                assert up.replicas == 6, up.reason
                assert up.signals["queue_per_replica"] == STREAMS_PER_ENGINE
                for task in load:
                    task.cancel()
                await asyncio.gather(*load, return_exceptions=True)

            # Clients gone: the engines abort their requests and report idle again.
            quiet = await _scrape_until(
                scraper, targets, lambda ms: all(m.in_flight == 0 for m in ms)
            )
            held = decide(POLICY, Observation(6, quiet), up.memory, 20.0)
            assert held.replicas == 6 and "window" in held.reason
            down = decide(POLICY, Observation(6, quiet), held.memory, 311.0)
            assert down.replicas == 1, down.reason

    asyncio.run(main())
