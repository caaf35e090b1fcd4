"""Fleet workloads: multi-turn chat sessions sharing a few long system prompts, each turn sending
the whole history, sessions arriving as a Poisson process whose rate follows phases (a fixed
rate is one phase; a ramp is low, high, low).

Everything is drawn from the seed before the run: which system prompt a session uses, its user
turns, the assistant replies its history carries, its arrival and think times. The history holds
these scripted replies rather than the engine's (random-weight models answer noise, and the
policies must see the same prompts), so every policy of one call sends the same requests. A run
tag at the head of every system prompt keeps a run from hitting the blocks an earlier run left
in the engines' prefix caches.

With adapters, each session talks to one LoRA adapter (its requests' ``model``), drawn with a
Zipf popularity: the adapter of rank i (from 1) is chosen with weight 1 / i**s, so a few adapters
take most sessions and a long tail the rest, as tenants' fine-tunes do.

The tenant workload (make_tenant_workload) is the other shape, llm-d's benchmark of prefix-aware
routing: many tenants, each with its own long system prompt, and a stream of one-turn requests,
each a short question of one tenant's user with a short answer. Tenants are drawn per request,
uniformly or with a Zipf popularity, so the prefixes a fleet must hold are the tenants' prompts
and almost all of a request's prompt is one of them.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import aiohttp
import numpy as np

# Short common English words: about one token each for real tokenizers.
_WORDS = """
    time year people way day man thing woman life child world school state family student group
    country problem hand part place case week company system program question work government
    number night point home water room mother area money story fact month lot right study book
    eye job word business issue side kind head house service friend father power hour game line
    end member law car city name team minute idea kid body back parent face others level office
    door health person art war history party result change morning reason research girl guy
    moment air teacher force education good new first last long great little own other old big
    high different small large next early young important few public bad same able make know
    take see come think look want give use find tell ask seem feel try leave call keep hold
"""
VOCABULARY = tuple(_WORDS.split())

Target = Callable[[int], tuple[str, dict[str, str]]]  # session -> (base URL, headers)
Popularity = Literal["zipf", "uniform"]


@dataclass(frozen=True)
class Phase:
    seconds: float
    rate: float  # requests per second


def parse_phases(spec: str) -> list[Phase]:
    """``SECONDSxRATE,...``, e.g. ``20x0.5,40x4,20x0.5`` (a ramp) or ``60x2`` (a fixed rate)."""
    phases = []
    for item in spec.split(","):
        seconds, sep, rate = item.strip().partition("x")
        try:
            phase = Phase(float(seconds), float(rate))
        except ValueError:
            phase = None
        if not sep or phase is None or phase.seconds <= 0 or phase.rate < 0:
            raise ValueError(f"a phase is SECONDSxRATE with SECONDS > 0, RATE >= 0: got {item!r}")
        phases.append(phase)
    return phases


@dataclass(frozen=True)
class Session:
    index: int
    system: int  # which shared system prompt
    start: float  # seconds after the run starts
    users: tuple[str, ...]
    replies: tuple[str, ...]  # the assistant turns the history carries
    thinks: tuple[float, ...]  # seconds between a reply and the next turn
    adapter: str | None = None  # the LoRA adapter it talks to; None: the base model


@dataclass(frozen=True)
class Workload:
    systems: tuple[str, ...]
    sessions: tuple[Session, ...]
    phases: tuple[Phase, ...]
    max_tokens: int

    @property
    def seconds(self) -> float:
        return sum(p.seconds for p in self.phases)

    def messages(self, session: Session, turn: int, tag: str) -> list[dict[str, str]]:
        out = [{"role": "system", "content": f"[{tag}] {self.systems[session.system]}"}]
        for i in range(turn + 1):
            out.append({"role": "user", "content": session.users[i]})
            if i < turn:
                out.append({"role": "assistant", "content": session.replies[i]})
        return out

    def phase_at(self, t: float) -> int:
        for i, end in enumerate(np.cumsum([p.seconds for p in self.phases])):
            if t < end:
                return i
        return len(self.phases) - 1


def make_workload(
    phases: Sequence[Phase],
    *,
    turns: int,
    systems: int,
    system_words: int,
    user_words: int,
    reply_words: int,
    think_s: float,
    max_tokens: int,
    seed: int,
    adapters: Sequence[str] = (),
    zipf: float = 1.0,
) -> Workload:
    """Sessions start as a Poisson process of rate ``phase.rate / turns`` in each phase, so that
    turns arrive at about ``phase.rate`` once sessions overlap; think times are exponential.
    ``adapters``, most popular first, with Zipf exponent ``zipf`` (none: the base model)."""
    rng = random.Random(seed)
    # Its own generator: the sessions' text stays what it is without adapters.
    adapter_rng = random.Random(seed + 1)
    weights = zipf_weights(len(adapters), zipf)
    prompts = tuple(text(rng, system_words) for _ in range(systems))
    sessions = tuple(
        Session(
            index=i,
            system=rng.randrange(systems),
            start=start,
            users=tuple(text(rng, user_words) for _ in range(turns)),
            replies=tuple(text(rng, reply_words) for _ in range(turns)),
            thinks=tuple(think(rng, think_s) for _ in range(turns)),
            adapter=adapter_rng.choices(adapters, weights)[0] if adapters else None,
        )
        for i, start in enumerate(arrivals(rng, phases, turns))
    )
    return Workload(prompts, sessions, tuple(phases), max_tokens)


def make_tenant_workload(
    phases: Sequence[Phase],
    *,
    tenants: int,
    system_words: int,
    question_words: int,
    max_tokens: int,
    popularity: Popularity,
    zipf: float,
    seed: int,
) -> Workload:
    """One-turn requests arriving as a Poisson process at each phase's rate, each a question of
    ``question_words`` under one of ``tenants`` system prompts of ``system_words``. The tenant of
    a request is drawn uniformly or, with ``popularity`` zipf, the tenant of rank i (from 1)
    with weight 1 / i**zipf: tenant 0 is the most popular."""
    if tenants < 1:
        raise ValueError(f"a tenant workload needs at least one tenant, got {tenants}")
    rng = random.Random(seed)
    # Its own generator: the tenants' prompts and the arrivals do not depend on the popularity.
    tenant_rng = random.Random(seed + 1)
    weights = zipf_weights(tenants, zipf if popularity == "zipf" else 0.0)
    prompts = tuple(text(rng, system_words) for _ in range(tenants))
    sessions = tuple(
        Session(
            index=i,
            system=tenant_rng.choices(range(tenants), weights)[0],
            start=start,
            users=(text(rng, question_words),),
            replies=(),
            thinks=(0.0,),
        )
        for i, start in enumerate(arrivals(rng, phases, 1))
    )
    return Workload(prompts, sessions, tuple(phases), max_tokens)


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(VOCABULARY) for _ in range(words))


def zipf_weights(n: int, exponent: float) -> list[float]:
    """The weight of rank i (from 0) is 1 / (i + 1)**exponent; exponent 0: uniform."""
    return [1 / (i + 1) ** exponent for i in range(n)]


def arrivals(rng: random.Random, phases: Sequence[Phase], turns: int) -> list[float]:
    """Session starts as a Poisson process of rate ``phase.rate / turns`` in each phase."""
    starts: list[float] = []
    t0 = 0.0
    for phase in phases:
        t = t0
        while phase.rate > 0:
            t += rng.expovariate(phase.rate / turns)
            if t >= t0 + phase.seconds:
                break
            starts.append(t)
        t0 += phase.seconds
    return starts


def think(rng: random.Random, mean_s: float) -> float:
    return rng.expovariate(1 / mean_s) if mean_s > 0 else 0.0


@dataclass
class Record:
    session: int
    turn: int
    start: float  # seconds after the run starts
    ttft: float | None = None
    latency: float | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str | None = None


async def chat(
    http: aiohttp.ClientSession,
    url: str,
    headers: dict[str, str],
    body: dict[str, object],
    record: Record,
) -> None:
    """One streamed chat completion; TTFT is the first content delta (not the role chunk)."""
    began = time.perf_counter()
    async with http.post(f"{url}/v1/chat/completions", json=body, headers=headers) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:200]}")
        async for line in resp.content:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"error in the stream: {chunk['error']}")
            if usage := chunk.get("usage"):
                record.prompt_tokens = usage.get("prompt_tokens", 0)
                record.output_tokens = usage.get("completion_tokens", 0)
            for choice in chunk.get("choices") or ():
                content = (choice.get("delta") or {}).get("content")
                if record.ttft is None and (content or choice.get("finish_reason")):
                    record.ttft = time.perf_counter() - began
    record.latency = time.perf_counter() - began
    if record.ttft is None:
        raise RuntimeError("the stream ended without content")


async def run_workload(workload: Workload, target: Target, model: str, tag: str) -> list[Record]:
    """Every session of the workload, on its schedule; a record per turn."""
    records: list[Record] = []
    t0 = time.perf_counter()

    async def session(http: aiohttp.ClientSession, s: Session) -> None:
        await asyncio.sleep(max(0.0, t0 + s.start - time.perf_counter()))
        for turn in range(len(s.users)):
            record = Record(s.index, turn, time.perf_counter() - t0)
            records.append(record)
            url, headers = target(s.index)
            body = {"model": s.adapter or model, "messages": workload.messages(s, turn, tag),
                    "max_tokens": workload.max_tokens, "temperature": 0.0, "ignore_eos": True,
                    "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
            try:
                await chat(http, url, headers, body, record)
            except (aiohttp.ClientError, TimeoutError, RuntimeError, ValueError) as e:
                record.error = f"{type(e).__name__}: {e}"
                return  # a session without its reply cannot go on
            await asyncio.sleep(s.thinks[turn])

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as http:
        await asyncio.gather(*(session(http, s) for s in workload.sessions))
    return records


def percentiles_ms(values: Sequence[float], *qs: float) -> list[float | None]:
    if not values:
        return [None for _ in qs]
    return [float(np.percentile(np.asarray(values) * 1000, q)) for q in qs]
