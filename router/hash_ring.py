"""Consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam 2018): a key goes to
the first endpoint clockwise from its hash whose in-flight count stays within
ceil(load_factor * (total + 1) / n). Keys stay where their KV cache is, until that endpoint is
overloaded; membership changes move only the keys of the endpoints that came or went."""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Iterable, Mapping


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


class HashRing:
    def __init__(self, vnodes: int = 160, load_factor: float = 1.25) -> None:
        if vnodes < 1:
            raise ValueError("vnodes must be >= 1")
        if load_factor < 1.0:
            raise ValueError("load_factor must be >= 1 (1 forces perfect balance)")
        self.vnodes = vnodes
        self.load_factor = load_factor
        self._points: list[int] = []
        self._owners: list[str] = []
        self.endpoints: tuple[str, ...] = ()

    def set_endpoints(self, endpoints: Iterable[str]) -> None:
        eps = tuple(sorted(set(endpoints)))
        if eps == self.endpoints:
            return
        ring = sorted((_hash(f"{ep}#{i}"), ep) for ep in eps for i in range(self.vnodes))
        self._points = [p for p, _ in ring]
        self._owners = [ep for _, ep in ring]
        self.endpoints = eps

    def capacity(self, load: Mapping[str, int], exclude: frozenset[str] = frozenset()) -> int:
        included = [ep for ep in self.endpoints if ep not in exclude]
        total = sum(load.get(ep, 0) for ep in included)
        return math.ceil(self.load_factor * (total + 1) / len(included))

    def home(self, key: str) -> str | None:
        """Where key goes when no endpoint is over the bound: the one that caches its prefix."""
        if not self.endpoints:
            return None
        return self._owners[bisect.bisect(self._points, _hash(key)) % len(self._points)]

    def choose(
        self,
        key: str,
        load: Mapping[str, int],
        exclude: frozenset[str] = frozenset(),
        free: frozenset[str] = frozenset(),
    ) -> str | None:
        """The endpoint for key given the current loads; None when no endpoint is left. The
        bound guarantees some endpoint qualifies, so the walk always ends.

        ``exclude`` (the engines a request already failed on, or those the breaker ejected) are
        passed by and left out of the bound, exactly as a ring without them would choose, at no
        cost of rebuilding one. ``free`` endpoints (free batch slots, nothing queued: they would
        start one more request at once) qualify whatever their load: sending a key past its home
        then buys nothing and costs its cached prefix. That only adds endpoints that qualify, so
        the bound's guarantee holds."""
        if not any(ep not in exclude for ep in self.endpoints):
            return None
        cap = self.capacity(load, exclude)
        start = bisect.bisect(self._points, _hash(key))
        n = len(self._points)
        for step in range(n):
            owner = self._owners[(start + step) % n]
            if owner not in exclude and (owner in free or load.get(owner, 0) + 1 <= cap):
                return owner
        raise AssertionError("bounded-load invariant broken")  # unreachable: see capacity()

    def walk(self, key: str, exclude: frozenset[str] = frozenset()) -> list[str]:
        """Every endpoint not excluded, in the order the ring meets them clockwise from key's
        hash: the order ``choose`` tries them in, for choices among a subset."""
        if not self._points:
            return []
        wanted = len([ep for ep in self.endpoints if ep not in exclude])
        start = bisect.bisect(self._points, _hash(key))
        order: dict[str, None] = {}
        n = len(self._points)
        for step in range(n):
            owner = self._owners[(start + step) % n]
            if owner not in exclude:
                order.setdefault(owner)
                if len(order) == wanted:
                    break
        return list(order)

    def least_loaded(
        self, load: Mapping[str, int], exclude: frozenset[str] = frozenset()
    ) -> str | None:
        candidates = [ep for ep in self.endpoints if ep not in exclude]
        if not candidates:
            return None
        return min(candidates, key=lambda ep: (load.get(ep, 0), ep))
