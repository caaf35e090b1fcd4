"""Router benchmark on CPU engine processes.

1. Affinity: a multi-turn chat workload (conversations sharing a few system prompts, each turn
   sending the whole history) against N real engines, through the router and round robin
   (straight to the engines in turn). Reported: the engines' own prefix-cache hit rate
   (delta of ``vllm:prefix_cache_hits`` over ``vllm:prefix_cache_queries``) and client TTFT.
   Each run uses its own prompts (another seed), so no run finds the previous run's blocks.
2. Added latency: stub engines answering an 8-event SSE stream at once, hit at a fixed rate
   (``--rate``) directly and through a router, with long chat prompts (``--latency-prompts`` of
   ``--latency-prompt-words``, about 1.5 tokens a word); reported: time to first byte and to the
   last byte, p50/p99, and what the router adds to each. Two routers: one without a tokenizer
   (``router``), and one with precise prefix scoring (``router, precise``: ``--tokenizer``,
   ``--prefix-scoring precise``), which tokenizes each prompt and scores the engines from their
   KV event streams: each stub engine serves ``GET /kv_events`` with a snapshot holding the
   blocks of its share of the prompts, and counts the requests that reach it with a prompt it
   holds (reported as ``on holding engine``, which shows precise scoring was in effect).

    python bench/router_bench.py --engines 3 --conversations 24 --turns 6 --result-json out.json
    python bench/router_bench.py --latency-only --rate 500 --latency-requests 5000

Engines serve a random-weight Llama built here (``--hidden-size``, ``--layers``; the tiny test
model's tokenizer); the routers get its tokenizer (``--tokenizer``). The affinity routers are
session keys and prefix keys (both ``--prefix-scoring approximate``) and precise scoring from the
engines' KV events (``--prefix-scoring precise``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import logging
import random
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp
import numpy as np
from aiohttp import web

from kvfleet.protocol import kv_events
from kvfleet.telemetry import metric_names as names

# bench/ for its modules, and the repository root for the tests' tiny model (tests/support).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    Proc,
    free_port,
    python_cmd,
    start_engine,
    start_router,
    stop,
    wait_ready,
    watched,
)

logger = logging.getLogger("kvfleet.bench.router")

MODEL = "tiny"
# Plain words: about 1.5 tokens each with the tiny model's tokenizer.
WORDS = tuple(
    " ".join(
        (
            "the of and to in is you that it he was for on are as with his they at be this have",
            "from or one had by word but not what all were we when your can said there use an",
            "each which she do how their if will up other about out many then them these so some",
            "her would make like him into time has look two more write go see number no way could",
            "people my than first water been call who oil its now find long down day did get come",
        )
    ).split()
)


# --------------------------------------------------------------------------------------------
# Workload
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Conversation:
    system: str
    users: tuple[str, ...]


def make_conversations(
    num: int, turns: int, num_systems: int, system_words: int, user_words: int, seed: int
) -> list[Conversation]:
    rng = random.Random(seed)

    def text(n: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(n))

    systems = [f"[{seed}-{i}] {text(system_words)}" for i in range(num_systems)]
    return [
        Conversation(systems[c % num_systems], tuple(text(user_words) for _ in range(turns)))
        for c in range(num)
    ]


Target = Callable[[int], tuple[str, dict[str, str]]]  # conversation -> (base URL, headers)


async def chat_turn(
    session: aiohttp.ClientSession,
    url: str,
    messages: list[dict[str, str]],
    max_tokens: int,
    headers: dict[str, str],
) -> tuple[float, str]:
    """One greedy streamed turn: (TTFT in seconds, reply text). TTFT is the first content
    delta, not the role chunk the engine sends before generating."""
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "stream": True,
            "temperature": 0.0, "ignore_eos": True}  # fmt: skip
    start = time.perf_counter()
    ttft: float | None = None
    parts: list[str] = []
    async with session.post(f"{url}/v1/chat/completions", json=body, headers=headers) as r:
        r.raise_for_status()
        async for line in r.content:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            for choice in json.loads(line[6:])["choices"]:
                text = (choice.get("delta") or {}).get("content") or ""
                if text or choice.get("finish_reason"):
                    ttft = time.perf_counter() - start if ttft is None else ttft
                    parts.append(text)
    assert ttft is not None, "no content in the stream"
    return ttft, "".join(parts)


async def run_conversations(
    convs: Sequence[Conversation], target: Target, max_tokens: int, think_s: float = 0.0
) -> list[float]:
    """All conversations at once, each turn after the previous reply and a think time (uniform
    in [0, 2 think_s], the same draws for every run); the TTFT of every turn. Without think
    time the conversations move in lockstep, which makes round robin accidentally sticky."""
    ttfts: list[float] = []

    async def one(session: aiohttp.ClientSession, i: int, conv: Conversation) -> None:
        rng = random.Random(i)
        messages = [{"role": "system", "content": conv.system}]
        for user in conv.users:
            await asyncio.sleep(rng.uniform(0, 2 * think_s))
            messages.append({"role": "user", "content": user})
            url, headers = target(i)
            ttft, reply = await chat_turn(session, url, messages, max_tokens, headers)
            ttfts.append(ttft)
            messages.append({"role": "assistant", "content": reply})

    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(*(one(session, i, c) for i, c in enumerate(convs)))
    return ttfts


async def counters(urls: Sequence[str], *names: str) -> list[float]:
    """Each named counter summed over the servers' /metrics."""
    sums = dict.fromkeys(names, 0.0)
    async with aiohttp.ClientSession() as s:
        for url in urls:
            async with s.get(f"{url}/metrics") as r:
                for line in (await r.text()).splitlines():
                    sample, _, value = line.rpartition(" ")
                    name = sample.partition("{")[0]  # summed over label sets
                    if name in sums:
                        sums[name] += float(value)
    return [sums[n] for n in names]


PREFIX_COUNTERS = ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total")
SPILLED = "kvfleet_router_spilled_total"


@dataclass
class AffinityResult:
    policy: str
    requests: int
    hit_rate: float
    ttft_p50_ms: float
    ttft_p90_ms: float
    seconds: float
    spilled: int | None  # routed past the key's home engine (the load bound); None: no router


async def measure_affinity(
    policy: str,
    engine_urls: Sequence[str],
    target: Target,
    convs: Sequence[Conversation],
    max_tokens: int,
    think_s: float = 0.0,
    router_url: str | None = None,
) -> AffinityResult:
    routers = [router_url] if router_url else []
    h0, q0 = await counters(engine_urls, *PREFIX_COUNTERS)
    (s0,) = await counters(routers, SPILLED)
    start = time.perf_counter()
    ttfts = await run_conversations(convs, target, max_tokens, think_s)
    seconds = time.perf_counter() - start
    h1, q1 = await counters(engine_urls, *PREFIX_COUNTERS)
    (s1,) = await counters(routers, SPILLED)
    ms = np.asarray(ttfts) * 1000
    return AffinityResult(
        policy,
        len(ttfts),
        (h1 - h0) / (q1 - q0),
        float(np.percentile(ms, 50)),
        float(np.percentile(ms, 90)),
        seconds,
        int(s1 - s0) if router_url else None,
    )


def round_robin(urls: Sequence[str]) -> Target:
    turn = itertools.count()
    return lambda _conv: (urls[next(turn) % len(urls)], {})


# --------------------------------------------------------------------------------------------
# Processes
# --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def engines(n: int, model: Path, log_dir: Path, *extra: str) -> Iterator[list[tuple[Proc, str]]]:
    """n engine processes serving ``model`` (built beforehand: n processes would race to build
    it), as (process, base URL)."""
    procs = []
    try:
        for i in range(n):
            port = free_port()
            proc = start_engine(model, port, log_dir / f"engine{i}.log", *extra, served_name=MODEL)
            procs.append((proc, f"http://127.0.0.1:{port}"))
        wait_ready([u for _, u in procs], "/ready", procs=[p for p, _ in procs])
        yield procs
    finally:
        stop([p for p, _ in procs])


def bench_model(cache_dir: Path, hidden_size: int, layers: int) -> Path:
    """A random Llama with the tiny test model's tokenizer (vocab 1024), large enough that
    prefill costs something on a CPU, so that cache hits show in TTFT."""
    from tests.support.tiny_model import build_tiny_model

    return build_tiny_model(
        cache_dir / f"router-bench-llama-h{hidden_size}-l{layers}", "llama", seed=0,
        vocab_size=1024, hidden_size=hidden_size, num_layers=layers, num_heads=8,
        num_kv_heads=2, max_position_embeddings=4096,
    )  # fmt: skip


# --------------------------------------------------------------------------------------------
# Added latency
# --------------------------------------------------------------------------------------------

STUB_EVENTS = b"".join(b'data: {"choices":[{"delta":{"content":"tok"}}]}\n\n' for _ in range(8))


def latency_prompts(num: int, words: int, seed: int = 7) -> list[list[dict[str, str]]]:
    """``num`` chat requests' messages, each a system prompt of ``words`` tagged ``[i]`` (the
    stub engines read the tag) and a short question."""
    rng = random.Random(seed)
    return [
        [{"role": "system", "content": f"[{i}] " + " ".join(rng.choices(WORDS, k=words))},
         {"role": "user", "content": "what does it say?"}]
        for i in range(num)
    ]  # fmt: skip


def holding_engine(prompt: int, engines: int) -> int:
    """The stub engine whose cache holds prompt ``prompt``'s blocks."""
    return prompt % engines


def snapshot_blocks(
    tokenizer: str, prompts: Sequence[list[dict[str, str]]], engines: int
) -> tuple[list[list[str]], float]:
    """Each stub engine's blocks (hex hashes of its prompts' full blocks, as the router hashes
    the tokens the engine's chat template gives), and the prompts' mean length in tokens."""
    from kvfleet.protocol.block_hash import prompt_block_hashes
    from kvfleet.router.prompt_tokenizer import EngineTokenizer

    tok = EngineTokenizer(tokenizer)
    blocks: list[list[str]] = [[] for _ in range(engines)]
    lengths = []
    for i, messages in enumerate(prompts):
        tokens = tok.chat(messages, True, None)
        lengths.append(len(tokens))
        blocks[holding_engine(i, engines)] += [h.hex() for h in prompt_block_hashes(tokens)]
    return blocks, sum(lengths) / len(lengths)


class StubEngine:
    """An engine that answers every chat request at once, is idle in its /metrics, and holds
    ``blocks`` in its prefix cache, which ``GET /kv_events`` publishes (a snapshot, then
    heartbeats: nothing changes)."""

    def __init__(self, index: int, engines: int, blocks: list[str]) -> None:
        self.index, self.engines, self.blocks = index, engines, blocks
        self.engine_id = uuid.uuid4().hex  # a new id each process start, as an engine's
        self.requests = 0
        self.on_holder = 0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/stub_stats", self.stats)
        app.router.add_get(kv_events.PATH, self.kv_events)
        return app

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests += 1
        tag = body["messages"][0]["content"].partition("]")[0].lstrip("[")
        self.on_holder += holding_engine(int(tag), self.engines) == self.index
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(STUB_EVENTS + b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def health(self, _request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def metrics(self, _request: web.Request) -> web.Response:
        lines = [f"{names.RUNNING} 0", f"{names.WAITING} 0", f"{names.MAX_NUM_SEQS} 256",
                 f"{names.KV_CACHE_USAGE} 0.5"]  # fmt: skip
        return web.Response(text="\n".join(lines) + "\n")

    async def stats(self, _request: web.Request) -> web.Response:
        return web.json_response({"requests": self.requests, "on_holder": self.on_holder})

    async def kv_events(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": kv_events.CONTENT_TYPE})
        await resp.prepare(request)
        blocks = kv_events.SnapshotBlocks(gpu=self.blocks)
        await resp.write(kv_events.encode_line(
            kv_events.Snapshot(engine_id=self.engine_id, seq=0, blocks=blocks)
        ))  # fmt: skip
        with contextlib.suppress(ConnectionResetError):
            while True:
                await asyncio.sleep(kv_events.HEARTBEAT_SECONDS)
                await resp.write(kv_events.encode_line(kv_events.Heartbeat(seq=0)))
        return resp


async def serve_stubs(ports: Sequence[int], blocks: list[list[str]]) -> None:
    """The stub engines, one a port, in this process, until it is stopped."""
    runners = []
    for i, port in enumerate(ports):
        runner = web.AppRunner(StubEngine(i, len(ports), blocks[i]).app(), access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        runners.append(runner)
    await asyncio.Event().wait()


async def fixed_rate(
    url: str, rate: float, n: int, prompts: Sequence[list[dict[str, str]]]
) -> tuple[list[float], list[float]]:
    """n streamed requests, one every 1/rate seconds, the prompts in turn: (TTFB, total) per
    request, seconds."""
    bodies = [{"model": MODEL, "messages": m, "stream": True} for m in prompts]
    ttfb: list[float] = []
    total: list[float] = []

    async def one(session: aiohttp.ClientSession, body: dict[str, object]) -> None:
        start = time.perf_counter()
        async with session.post(f"{url}/v1/chat/completions", json=body) as r:
            r.raise_for_status()
            await r.content.readany()
            ttfb.append(time.perf_counter() - start)
            await r.read()
            total.append(time.perf_counter() - start)

    async with aiohttp.ClientSession() as session:
        tasks = []
        t0 = time.perf_counter()
        for i in range(n):
            await asyncio.sleep(max(0.0, t0 + i / rate - time.perf_counter()))
            tasks.append(asyncio.create_task(one(session, bodies[i % len(bodies)])))
        await asyncio.gather(*tasks)
    return ttfb, total


@dataclass
class LatencyResult:
    path: str
    requests: int
    rate: float
    ttfb_p50_ms: float
    ttfb_p99_ms: float
    total_p50_ms: float
    total_p99_ms: float
    # The router's added time to the last byte (its total less the direct path's); None: direct.
    added_p50_ms: float | None = None
    added_p99_ms: float | None = None
    # Share of the requests that reached the engine holding their prompt; None: not counted.
    on_holding_engine: float | None = None


def latency_result(path: str, rate: float, ttfb: list[float], total: list[float]) -> LatencyResult:
    a, b = np.asarray(ttfb) * 1000, np.asarray(total) * 1000
    return LatencyResult(path, len(total), rate, *(float(np.percentile(x, p))
                         for x in (a, b) for p in (50, 99)))  # fmt: skip


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--engines", type=int, default=3)
    p.add_argument("--conversations", type=int, default=24)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--system-prompts", type=int, default=4)
    p.add_argument("--system-words", type=int, default=130, help="about 200 tokens")
    p.add_argument("--user-words", type=int, default=60)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--kv-blocks", type=int, default=1024,
                   help="KV cache blocks per engine (0: the engine's default, which on a CPU "
                   "holds the whole workload many times over)")  # fmt: skip
    p.add_argument("--think-time", type=float, default=1.0, help="mean seconds between turns")
    p.add_argument("--hidden-size", type=int, default=384, help="of the bench model")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--load-factor", type=float, default=1.25, help="the routers' bound")
    p.add_argument("--prefix-length", type=int, default=128,
                   help="router --prefix-length for the prefix-key run")  # fmt: skip
    p.add_argument("--rate", type=float, default=500.0, help="added-latency request rate")
    p.add_argument("--latency-requests", type=int, default=1000)
    p.add_argument("--latency-engines", type=int, default=4, help="stub engines")
    p.add_argument("--latency-prompts", type=int, default=64,
                   help="distinct chat prompts, spread over the stub engines' caches")  # fmt: skip
    p.add_argument("--latency-prompt-words", type=int, default=1600,
                   help="words of each prompt's system message (about 2.4k tokens)")  # fmt: skip
    p.add_argument("--latency-only", action="store_true",
                   help="the added latency alone, without the affinity runs")  # fmt: skip
    p.add_argument("--cache-dir", type=Path, help="where the bench model is built (default: temp)")
    p.add_argument("--result-json", type=Path)
    p.add_argument("--stub-ports", help=argparse.SUPPRESS)
    p.add_argument("--stub-blocks", type=Path, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def print_tables(affinity: list[AffinityResult], latency: list[LatencyResult]) -> None:
    if affinity:
        print_affinity(affinity)
    print_latency(latency)


def print_affinity(affinity: list[AffinityResult]) -> None:
    rr = next(r for r in affinity if r.policy == "round robin")
    print("| policy | requests | prefix-cache hit rate | vs round robin | TTFT p50 ms "
          "| TTFT p90 ms | seconds | spilled |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for r in affinity:
        spilled = "" if r.spilled is None else r.spilled
        ratio = f"{r.hit_rate / rr.hit_rate:.2f}x" if rr.hit_rate else "-"
        print(f"| {r.policy} | {r.requests} | {r.hit_rate:.1%} | {ratio} "
              f"| {r.ttft_p50_ms:.1f} | {r.ttft_p90_ms:.1f} | {r.seconds:.1f} "
              f"| {spilled} |")  # fmt: skip
    print()


def print_latency(latency: list[LatencyResult]) -> None:
    print("| path | requests | rate/s | TTFB p50 ms | TTFB p99 ms | total p50 ms | total p99 ms "
          "| added p50 ms | added p99 ms | on holding engine |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")

    def f(x: float | None, fmt: str) -> str:
        return "" if x is None else format(x, fmt)

    for r in latency:
        print(f"| {r.path} | {r.requests} | {r.rate:g} | {r.ttfb_p50_ms:.2f} | {r.ttfb_p99_ms:.2f} "
              f"| {r.total_p50_ms:.2f} | {r.total_p99_ms:.2f} | {f(r.added_p50_ms, '.2f')} "
              f"| {f(r.added_p99_ms, '.2f')} | {f(r.on_holding_engine, '.1%')} |")  # fmt: skip


async def affinity_runs(
    ns: argparse.Namespace, engine_procs: list[tuple[Proc, str]], tokenizer: str, log_dir: Path
) -> list[AffinityResult]:
    urls = [u for _, u in engine_procs]
    hosts = [u.removeprefix("http://") for u in urls]
    common = ("--tokenizer", tokenizer, "--load-factor", str(ns.load_factor))
    scorings = {"session": "approximate", "prefix": "approximate", "precise": "precise"}
    ports = {name: free_port() for name in scorings}
    routers = [
        start_router(hosts, ports[name], log_dir / f"router-{name}.log", *common,
                     "--prefix-length", str(ns.prefix_length), "--prefix-scoring", scoring)
        for name, scoring in scorings.items()
    ]  # fmt: skip
    try:
        router_urls = {name: f"http://127.0.0.1:{p}" for name, p in ports.items()}
        wait_ready(list(router_urls.values()), "/health", procs=routers)
        with watched([*routers, *(p for p, _ in engine_procs)]):
            return await _affinity(ns, urls, router_urls)
    finally:
        stop(routers)


async def _affinity(
    ns: argparse.Namespace, urls: list[str], routers: dict[str, str]
) -> list[AffinityResult]:
    def workload(seed: int) -> list[Conversation]:
        return make_conversations(ns.conversations, ns.turns, ns.system_prompts,
                                  ns.system_words, ns.user_words, seed)  # fmt: skip

    # Warm-up: the first requests of a process pay one-off costs (allocator, lazy imports).
    await run_conversations(workload(99)[: ns.engines * 2], round_robin(urls), 4)
    session, prefix, precise = routers["session"], routers["prefix"], routers["precise"]
    runs: list[tuple[str, Target, str | None]] = [
        ("round robin", round_robin(urls), None),
        ("router, session header",
         lambda i: (session, {"x-session-id": f"conv-{i}"}), session),
        (f"router, prefix key ({ns.prefix_length} tokens)", lambda _i: (prefix, {}), prefix),
        ("router, precise", lambda _i: (precise, {}), precise),
    ]  # fmt: skip
    results = []
    for seed, (policy, target, router_url) in enumerate(runs):
        r = await measure_affinity(
            policy, urls, target, workload(seed), ns.max_tokens, ns.think_time, router_url
        )
        logger.info("%s", r)
        results.append(r)
    return results


async def latency_runs(
    ns: argparse.Namespace, tokenizer: Path, log_dir: Path
) -> list[LatencyResult]:
    prompts = latency_prompts(ns.latency_prompts, ns.latency_prompt_words)
    blocks, mean_tokens = snapshot_blocks(str(tokenizer), prompts, ns.latency_engines)
    logger.info("latency prompts: %d of %.0f tokens on average", len(prompts), mean_tokens)
    (log_dir / "stub-blocks.json").write_text(json.dumps(blocks))
    stub_ports = [free_port() for _ in range(ns.latency_engines)]
    stub = subprocess.Popen(
        python_cmd(__file__, "--stub-ports", ",".join(map(str, stub_ports)),
                   "--stub-blocks", str(log_dir / "stub-blocks.json"))
    )  # fmt: skip
    stubs = [f"http://127.0.0.1:{p}" for p in stub_ports]
    hosts = [u.removeprefix("http://") for u in stubs]
    plain_port, precise_port = free_port(), free_port()
    routers = [
        start_router(hosts, plain_port, log_dir / "router-stub.log"),
        start_router(hosts, precise_port, log_dir / "router-stub-precise.log", "--tokenizer",
                     str(tokenizer), "--prefix-scoring", "precise"),
    ]  # fmt: skip
    try:
        plain, precise = (f"http://127.0.0.1:{p}" for p in (plain_port, precise_port))
        wait_ready([*stubs, plain, precise], "/health", procs=[stub, *routers])
        out = []
        with watched([stub, *routers]):
            paths = [("direct", stubs[0]), ("router", plain), ("router, precise", precise)]
            # The first round warms every path up (and lets the precise router read the
            # engines' snapshots); the second is reported.
            for round_ in range(2):
                for path, url in paths:
                    before = await stub_counts(stubs)
                    ttfb, total = await fixed_rate(url, ns.rate, ns.latency_requests, prompts)
                    after = await stub_counts(stubs)
                    if round_ == 0:
                        continue
                    r = latency_result(path, ns.rate, ttfb, total)
                    if out:
                        r.added_p50_ms = r.total_p50_ms - out[0].total_p50_ms
                        r.added_p99_ms = r.total_p99_ms - out[0].total_p99_ms
                    requests = after[0] - before[0]
                    r.on_holding_engine = (after[1] - before[1]) / requests if requests else None
                    out.append(r)
                    logger.info("%s", r)
        return out
    finally:
        stop([stub, *routers])


async def stub_counts(stubs: Sequence[str]) -> tuple[int, int]:
    """(requests, requests on their prompt's holding engine), summed over the stub engines."""
    requests = on_holder = 0
    async with aiohttp.ClientSession() as session:
        for url in stubs:
            async with session.get(f"{url}/stub_stats") as r:
                doc = await r.json()
                requests, on_holder = requests + doc["requests"], on_holder + doc["on_holder"]
    return requests, on_holder


def main(argv: Sequence[str] | None = None) -> int:
    ns = parse_args(argv)
    if ns.stub_ports:
        ports = [int(p) for p in ns.stub_ports.split(",")]
        asyncio.run(serve_stubs(ports, json.loads(ns.stub_blocks.read_text())))
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    affinity: list[AffinityResult] = []
    with tempfile.TemporaryDirectory() as tmp:
        log_dir = Path(tmp)
        model = bench_model(ns.cache_dir or log_dir, ns.hidden_size, ns.layers)
        blocks = ("--num-gpu-blocks-override", str(ns.kv_blocks)) if ns.kv_blocks else ()
        if not ns.latency_only:
            with engines(ns.engines, model, log_dir, *blocks) as procs:
                affinity = asyncio.run(affinity_runs(ns, procs, str(model), log_dir))
        latency = asyncio.run(latency_runs(ns, model, log_dir))
    print_tables(affinity, latency)
    if ns.result_json:
        doc = {
            "args": {k: str(v) for k, v in vars(ns).items()},
            "affinity": [asdict(r) for r in affinity],
            "latency": [asdict(r) for r in latency],
        }
        ns.result_json.write_text(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
