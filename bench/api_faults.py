"""A seeded random mix of Kubernetes API faults for the operator soak (bench/operator_soak.py):
what a real API server, or a proxy in front of it, does under load, during an upgrade or a
network blip. kmock's emulator (tests/support/kmock.py) asks it about each request first; it
acts on the operator's requests only (kopf's and the operator's client's), never the soak's.

The faults come in episodes, each drawn from the seed before the run: a start (the gaps between
starts are exponential, ``mean_gap`` on average), a kind, a target and an end. Kinds:

* ``gone``: the open watches of one collection the operator watches are cut, and the next 1 to
  3 lists or watches of it are answered HTTP 410 (a resourceVersion the API server no longer
  has: an API server restarted behind a load balancer);
* ``ended``: the open watches of one collection are cut, and every new one is answered 200 with
  a stream that ends at once with no event (an API server shedding watches, a proxy's idle
  timeout), for 3 to 15 s;
* ``conflict``, ``error``: HTTP 409 or 500 answers to every write to one service's objects (its
  status, its children, its pods) for 10 to 60 s;
* ``slow``: half of the requests held 1 to 5 s before they are served, for 10 to 30 s;
* ``reset``: a fifth of the open watches cut as the episode starts, and a fifth of the requests'
  connections closed with no answer, for 5 to 20 s.

Cutting a watch (its connection closed under it) is what makes the operator ask again: kmock's
watches otherwise last until the client gives up on them.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp.web
import kmock

from tests.support.kmock import WRITES, from_operator

KINDS = ("gone", "ended", "conflict", "error", "slow", "reset")
SLOW_SHARE, SLOW_S = 0.5, (1.0, 5.0)
RESET_SHARE = 0.2
# Seconds an episode of each kind lasts (gone: none, it is a number of answers).
LASTS = {"ended": (3, 15), "conflict": (10, 60), "error": (10, 60), "slow": (10, 30),
         "reset": (5, 20)}  # fmt: skip
STATUS = {"gone": 410, "conflict": 409, "error": 500}


@dataclass
class Episode:
    kind: str
    start: float  # seconds after the mix started
    end: float
    target: str = ""  # a collection's plural (gone, ended), a service's name (conflict, error)
    times: int = 0  # gone: the answers it gives
    hits: int = 0

    def describe(self, offset: float = 0.0) -> str:
        """When (``offset`` seconds later than the mix's start), what and for how long."""
        on = f" on {self.target}" if self.target else ""
        lasts = f"x{self.times}" if self.kind == "gone" else f"for {self.end - self.start:.0f}s"
        return f"{offset + self.start:.0f}s {self.kind}{on} {lasts}"


def schedule(
    rng: random.Random,
    kinds: Sequence[str],
    duration: float,
    mean_gap: float,
    collections: Sequence[str],
    services: Sequence[str],
) -> list[Episode]:
    """The episodes of a run, in order of start; none starts or lasts past ``duration``."""
    episodes: list[Episode] = []
    t = 0.0
    while kinds:
        t += rng.expovariate(1 / mean_gap)
        if t >= duration:
            return episodes
        kind = rng.choice(list(kinds))
        if kind == "gone":
            episode = Episode(kind, t, duration, rng.choice(list(collections)), rng.randint(1, 3))
        else:
            low, high = LASTS[kind]
            target = {"ended": collections, "conflict": services, "error": services}.get(kind)
            episode = Episode(
                kind, t, min(duration, t + rng.uniform(low, high)),
                rng.choice(list(target)) if target else "",
            )  # fmt: skip
        episodes.append(episode)
    return episodes


def _is_watch_or_list(request: kmock.Request, plural: str) -> bool:
    return (
        request.action in (kmock.action.LIST, kmock.action.WATCH)
        and request.resource is not None
        and request.resource.plural == plural
    )


def _writes_to(request: kmock.Request, service: str) -> bool:
    name = request.name or ""
    return request.method.value in WRITES and (name == service or name.startswith(service + "-"))


class FaultMix:
    """kmock's interceptor (APIServer.faults); faults only between ``start`` and ``stop``."""

    def __init__(
        self,
        seed: int,
        kinds: Sequence[str],
        duration: float,
        *,
        collections: Sequence[str],
        services: Sequence[str],
        mean_gap: float = 8.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        unknown = set(kinds) - set(KINDS)
        if unknown:
            raise ValueError(f"unknown fault kinds {sorted(unknown)}; known: {', '.join(KINDS)}")
        self._rng = random.Random(seed)
        self.episodes = schedule(self._rng, kinds, duration, mean_gap, collections, services)
        self._clock = clock
        self._started: float | None = None
        self._cutter: asyncio.Task[None] | None = None
        self._watches: list[tuple[str, Any]] = []  # (plural, raw request) of open watches
        self.injected: Counter[str] = Counter()  # answers (or holds) given, by kind

    def start(self) -> None:
        """Faults from now on (in a running event loop)."""
        self._started = self._clock()
        self._cutter = asyncio.create_task(self._cut_watches(), name="fault mix: cut watches")

    def stop(self) -> None:
        self._started = None
        if self._cutter is not None:
            self._cutter.cancel()

    async def _cut_watches(self) -> None:
        """As each gone, ended or reset episode starts, close the watches it cuts."""
        assert self._started is not None
        for episode in self.episodes:
            if episode.kind not in ("gone", "ended", "reset"):
                continue
            await asyncio.sleep(max(0.0, self._started + episode.start - self._clock()))
            self._watches = [(p, raw) for p, raw in self._watches if raw.transport is not None]
            for plural, raw in self._watches:
                if plural == episode.target or (
                    episode.kind == "reset" and self._rng.random() < RESET_SHARE
                ):
                    self.injected[f"{episode.kind}_cut"] += 1
                    raw.transport.abort()

    def active(self) -> list[Episode]:
        if self._started is None:
            return []
        now = self._clock() - self._started
        return [
            e
            for e in self.episodes
            if e.start <= now < e.end and not (e.kind == "gone" and e.hits >= e.times)
        ]

    async def answer(self, request: kmock.Request) -> aiohttp.web.StreamResponse | None:
        if not from_operator(request):
            return None
        for episode in self.active():
            if (response := await self._act(episode, request)) is not None:
                return response
        # Remembered from the start, so that an episode can cut the watches opened before.
        if request.action == kmock.action.WATCH and request.resource is not None:
            self._watches.append((request.resource.plural, request._raw_request))
        return None

    async def _act(
        self, episode: Episode, request: kmock.Request
    ) -> aiohttp.web.StreamResponse | None:
        kind = episode.kind
        if kind == "slow":
            if self._rng.random() < SLOW_SHARE:
                self._hit(episode)
                await asyncio.sleep(self._rng.uniform(*SLOW_S))
            return None
        if kind == "reset":
            raw: Any = request._raw_request
            if self._rng.random() >= RESET_SHARE or raw is None or raw.transport is None:
                return None
            self._hit(episode)
            raw.transport.abort()
            return aiohttp.web.Response(status=500)  # never sent: the connection is gone
        if kind == "ended":
            if request.action != kmock.action.WATCH or not _is_watch_or_list(
                request, episode.target
            ):
                return None
            self._hit(episode)
            return aiohttp.web.Response(status=200, content_type="application/json")
        matches = (
            _is_watch_or_list(request, episode.target)
            if kind == "gone"
            else _writes_to(request, episode.target)
        )
        if not matches:
            return None
        self._hit(episode)
        status = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": STATUS[kind],
                  "message": f"injected {kind} ({episode.describe()})"}  # fmt: skip
        return aiohttp.web.json_response(status, status=STATUS[kind])

    def _hit(self, episode: Episode) -> None:
        episode.hits += 1
        self.injected[episode.kind] += 1
