"""Soak: two engine processes behind a router process, good and hostile traffic mixed for a
fixed time, then the counts that matter: engine exits, moments an engine was unhealthy, 5xx
answers, good requests that failed, and KV blocks still held once the traffic stopped.

    python bench/soak.py --duration 600 --out soak.json     # make soak

Good traffic: chat and completion requests, streamed and not, from a few concurrent clients,
through the router. Hostile traffic: cases drawn from bench/hostile.py (the API fuzzer's
strategies), sent to the router and straight to each engine. Everything stays on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parent))

import hostile
from common import Proc, free_port, python_cmd, start_engine, start_process, stop, wait_ready

logger = logging.getLogger("soak")

PROMPTS = [
    "Tell me about the sea.",
    "Write a haiku about Kubernetes.",
    "What is paged attention?",
    "List three prime numbers.",
]


class Tally:
    """Counts shared by the traffic threads and the health poller."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counts: Counter[str] = Counter()
        self.samples: list[str] = []

    def add(self, key: str, sample: str | None = None) -> None:
        with self.lock:
            self.counts[key] += 1
            if sample is not None and len(self.samples) < 20:
                self.samples.append(sample)


def _metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


async def _good_client(router: str, deadline: float, tally: Tally, seed: int) -> None:
    rng = random.Random(seed)
    headers = {"Authorization": f"Bearer {hostile.API_KEY}"}
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(headers=headers, timeout=timeout) as session:
        while time.monotonic() < deadline:
            chat = rng.random() < 0.5
            stream = rng.random() < 0.5
            body: dict[str, Any] = {
                "model": hostile.MODEL,
                "max_tokens": rng.randint(4, 48),
                "temperature": rng.choice([0.0, 0.7]),
                "stream": stream,
                "user": f"user-{rng.randrange(8)}",
            }
            if chat:
                body["messages"] = [{"role": "user", "content": rng.choice(PROMPTS)}]
                path = "/v1/chat/completions"
            else:
                body["prompt"] = rng.choice(PROMPTS)
                path = "/v1/completions"
            try:
                async with session.post(router + path, json=body) as resp:
                    raw = await resp.read()
                    tally.add(f"good_{resp.status}")
                    if resp.status >= 500:
                        tally.add("good_5xx", raw[:200].decode("utf-8", "replace"))
                    if resp.status == 200 and stream and not raw.rstrip().endswith(b"[DONE]"):
                        tally.add("good_broken_stream")
                    if resp.status == 200 and b'"error"' in raw:
                        tally.add("good_error_event", raw[-300:].decode("utf-8", "replace"))
            except (aiohttp.ClientError, TimeoutError) as e:
                tally.add("good_no_reply", repr(e))


def _good_traffic(router: str, deadline: float, tally: Tally, clients: int) -> None:
    async def run() -> None:
        await asyncio.gather(*(_good_client(router, deadline, tally, i) for i in range(clients)))

    asyncio.run(run())


def _hostile_traffic(targets: list[str], deadline: float, tally: Tally) -> None:
    hosts = [t.removeprefix("http://").rsplit(":", 1) for t in targets]

    @settings(max_examples=100, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(hostile.hostile_case(), st.sampled_from(hosts))
    def one(case: hostile.Case, host: list[str]) -> None:
        if time.monotonic() > deadline:
            return
        problems = hostile.problems_of(host[0], int(host[1]), case)
        tally.add("hostile_cases")
        for p in problems:
            key = "hostile_5xx" if p.startswith("server error") else "hostile_problem"
            tally.add(key, f"{p}: {case.describe()[:300]}")

    while time.monotonic() < deadline:
        one()


def _health_poller(engines: list[tuple[Proc, str]], deadline: float, tally: Tally) -> None:
    while time.monotonic() < deadline:
        for i, (proc, url) in enumerate(engines):
            if proc.poll() is not None:
                tally.add(f"engine{i}_exited")
                continue
            t0 = time.monotonic()
            try:
                with urllib.request.urlopen(url + "/health", timeout=5) as resp:
                    ok = resp.status == 200
            except OSError:
                ok = False
            tally.add("health_checks")
            if not ok:
                tally.add("engine_unhealthy", f"engine{i}")
            with tally.lock:
                slowest = tally.counts.get("health_max_ms", 0)
                tally.counts["health_max_ms"] = max(slowest, int((time.monotonic() - t0) * 1000))
        time.sleep(1.0)


def soak(duration: float, clients: int, log_dir: Path) -> dict[str, Any]:
    from kvfleet.engine.tiny_model import tiny_model_path

    model = tiny_model_path()
    engines: list[tuple[Proc, str]] = []
    router_proc: Proc | None = None
    try:
        for i in range(2):
            port = free_port()
            proc = start_engine(
                model, port, log_dir / f"engine{i}.log", "--api-key", hostile.API_KEY,
                "--max-waiting-requests", "64", "--max-model-len", "512",
                served_name=hostile.MODEL,
            )  # fmt: skip
            engines.append((proc, f"http://127.0.0.1:{port}"))
        urls = [u for _, u in engines]
        wait_ready(urls, "/ready", procs=[p for p, _ in engines])
        port = free_port()
        router_proc = start_process(
            python_cmd("-m", "kvfleet.router.proxy", "--host", "127.0.0.1", "--port", str(port),
                       "--endpoints", ",".join(u.removeprefix("http://") for u in urls)),
            log_dir / "router.log",
        )  # fmt: skip
        router = f"http://127.0.0.1:{port}"
        wait_ready([router], "/health", procs=[router_proc])

        tally = Tally()
        started = time.monotonic()
        deadline = started + duration
        threads = [
            threading.Thread(target=_good_traffic, args=(router, deadline, tally, clients)),
            threading.Thread(target=_hostile_traffic, args=([router, *urls], deadline, tally)),
            threading.Thread(target=_health_poller, args=(engines, deadline, tally)),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.monotonic() - started

        # Once the traffic stops, every engine must be idle with no block held.
        leaked: dict[str, float] = {}
        settle = time.monotonic() + 30
        for i, url in enumerate(urls):
            while True:
                held = {
                    n: _metric(url, n)
                    for n in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                              "vllm:kv_cache_usage_perc")
                }  # fmt: skip
                if not any(held.values()) or time.monotonic() > settle:
                    break
                time.sleep(0.2)
            if any(held.values()):
                leaked[f"engine{i}"] = held  # type: ignore[assignment]
        c = tally.counts
        good_total = sum(v for k, v in c.items() if k.startswith("good_") and k[5:].isdigit())
        return {
            "duration_s": round(elapsed, 1),
            "good_requests": good_total,
            "good_ok": c["good_200"],
            "good_5xx": c["good_5xx"],
            "good_no_reply": c["good_no_reply"],
            "good_broken_streams": c["good_broken_stream"],
            "good_error_events": c["good_error_event"],
            "good_429": c["good_429"],
            "hostile_cases": c["hostile_cases"],
            "hostile_5xx": c["hostile_5xx"],
            "hostile_other_problems": c["hostile_problem"],
            "engine_exits": sum(1 for p, _ in engines if p.poll() is not None),
            "engine_unhealthy_observations": c["engine_unhealthy"],
            "health_checks": c["health_checks"],
            "health_max_ms": c["health_max_ms"],
            "engines_not_idle_after": leaked,
            "samples": tally.samples,
        }
    finally:
        stop([p for p, _ in engines] + ([router_proc] if router_proc is not None else []))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=600.0, help="seconds of traffic")
    p.add_argument("--clients", type=int, default=4, help="concurrent good clients")
    p.add_argument("--out", type=Path, help="write the summary JSON here")
    p.add_argument("--log-dir", type=Path, help="engine and router logs (default: a temp dir)")
    ns = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    log_dir = ns.log_dir or Path(tempfile.mkdtemp(prefix="kvfleet-soak-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    summary = soak(ns.duration, ns.clients, log_dir)
    summary["log_dir"] = str(log_dir)
    text = json.dumps(summary, indent=2)
    print(text)
    if ns.out:
        ns.out.write_text(text + "\n")
    failed = (
        summary["good_5xx"] or summary["hostile_5xx"] or summary["engine_exits"]
        or summary["engine_unhealthy_observations"] or summary["engines_not_idle_after"]
        or summary["good_no_reply"] or summary["good_broken_streams"]
    )  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
