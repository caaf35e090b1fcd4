"""Where a request for a LoRA adapter goes. Pure: no I/O.

An engine serves any adapter of its service, but one it holds in a GPU slot costs nothing
extra, one in host memory a copy to the GPU, and one on disk a read and, with every slot taken,
the eviction of another adapter that its own requests then have to load back. So a request
naming an adapter goes, in this order:

1. to an engine holding it in a GPU slot, then to one holding it in host memory, if that
   engine is within the load bound (the bounded-load rule of hash_ring.py, the same for
   prefixes); among several holders the request's key picks by the ring's order, so prefix
   affinity holds within the adapter's engines;
2. else to an engine within the bound that loads it: one with a free GPU slot first, then the
   one whose least used adapter on the GPU had the fewest recent requests (the least useful
   one to evict), then the least loaded.

An adapter's traffic so spreads by load: its holders take it until they are over the bound,
and the next request loads it on another engine, which holds it from then on (replication);
as its traffic falls, engines evict it for busier adapters. Nothing pins an adapter to one
engine, so a hot adapter never makes a hotspot, and a cold one never evicts a busy one while an
engine with a free slot or a colder adapter exists.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from kvfleet.router.hash_ring import HashRing

Reason = Literal["resident_gpu", "resident_cpu", "load_free_slot", "load_evict"]
REASONS: tuple[Reason, ...] = ("resident_gpu", "resident_cpu", "load_free_slot", "load_evict")


@dataclass(frozen=True)
class EngineAdapters:
    """The adapters one engine holds, as its metrics report them: in GPU slots, in host
    memory (the GPU's not repeated), and its GPU slots (None: not reported)."""

    gpu: frozenset[str] = frozenset()
    cpu: frozenset[str] = frozenset()
    max_loras: int | None = None

    def holds(self, adapter: str) -> bool:
        return adapter in self.gpu or adapter in self.cpu


@dataclass(frozen=True)
class Placement:
    endpoint: str
    reason: Reason


def eviction_cost(
    endpoint: str, held: EngineAdapters | None, usage: Callable[[str, str], float]
) -> tuple[bool, float]:
    """What loading one more adapter on an engine costs, to compare: (False, 0) with a free GPU
    slot, else (True, the recent requests of the least used adapter it would evict); infinite
    when unknown (no report), so that an engine that reports comes first."""
    if held is None or held.max_loras is None:
        return True, math.inf
    if len(held.gpu) < held.max_loras:
        return False, 0.0
    return True, min((usage(endpoint, a) for a in held.gpu), default=0.0)


def place(
    adapter: str,
    key: str,
    ring: HashRing,
    load: Mapping[str, int],
    holdings: Mapping[str, EngineAdapters],
    usage: Callable[[str, str], float],
    exclude: frozenset[str] = frozenset(),
    free: frozenset[str] = frozenset(),
    preferred: Sequence[str] | None = None,
) -> Placement | None:
    """The engine for a request naming ``adapter``; None when no endpoint is left.

    ``key``: the request's routing key (its session, user or prompt prefix; the adapter's name
    when it has none), which orders the holders. ``holdings``: per endpoint, what it holds.
    ``usage(endpoint, adapter)``: recent requests for an adapter there. ``exclude`` and ``free``
    as HashRing.choose takes them: an endpoint that would start the request at once is within
    the bound whatever its load. ``preferred``: the endpoints not excluded in the order to try
    them (precise prefix scoring's ranking, prefix_score.py); default the ring's walk from key."""
    order = list(preferred) if preferred is not None else ring.walk(key, exclude)
    if not order:
        return None
    cap = ring.capacity(load, exclude)

    def fits(ep: str) -> bool:
        return ep in free or load.get(ep, 0) + 1 <= cap

    resident: tuple[tuple[Reason, Callable[[EngineAdapters], frozenset[str]]], ...] = (
        ("resident_gpu", lambda h: h.gpu),
        ("resident_cpu", lambda h: h.cpu),
    )
    for reason, tier in resident:
        for ep in order:
            held = holdings.get(ep)
            if held is not None and adapter in tier(held) and fits(ep):
                return Placement(ep, reason)
    # The bound guarantees an endpoint within it (hash_ring.capacity), and no holder is.
    rank = {ep: i for i, ep in enumerate(order)}
    best = min(
        (ep for ep in order if fits(ep)),
        key=lambda ep: (eviction_cost(ep, holdings.get(ep), usage), load.get(ep, 0), rank[ep]),
    )
    evicts, _ = eviction_cost(best, holdings.get(best), usage)
    return Placement(best, "load_evict" if evicts else "load_free_slot")


class AdapterUsage:
    """Recent requests per (endpoint, adapter): counts that halve every ``half_life`` seconds,
    so "recent" weighs the last minutes; an adapter whose count fell below ``floor`` is
    forgotten, which bounds the table by the traffic of the last few half-lives."""

    def __init__(self, half_life: float = 60.0, floor: float = 0.01) -> None:
        if half_life <= 0:
            raise ValueError("half_life must be > 0")
        self.half_life = half_life
        self.floor = floor
        self._counts: dict[tuple[str, str], tuple[float, float]] = {}  # (count, as of)

    def _decayed(self, entry: tuple[float, float], now: float) -> float:
        count, at = entry
        return count * 0.5 ** (max(0.0, now - at) / self.half_life)

    def add(self, endpoint: str, adapter: str, now: float) -> None:
        entry = self._counts.get((endpoint, adapter))
        self._counts[endpoint, adapter] = (
            (self._decayed(entry, now) if entry else 0.0) + 1.0,
            now,
        )

    def of(self, endpoint: str, adapter: str, now: float) -> float:
        entry = self._counts.get((endpoint, adapter))
        return self._decayed(entry, now) if entry else 0.0

    def prune(self, now: float, endpoints: frozenset[str]) -> None:
        """Forget departed endpoints and counts decayed below the floor."""
        self._counts = {
            k: v
            for k, v in self._counts.items()
            if k[0] in endpoints and self._decayed(v, now) >= self.floor
        }
