"""Per-engine circuit breakers: the decision logic only, no I/O, time from an injected clock.

An engine that fails ``failures`` times in a row (the router decides what a failure is: a
connection error, a timeout, a 502/503/504 without Retry-After, a stream broken mid-way) is
ejected: out of the ring for a backoff that doubles with each ejection in a row, capped, and
shortened by a random fraction (jitter) so that routers that ejected an engine together do not
probe it together. When the backoff is over the router probes the engine's ``/health``; a
healthy answer closes the breaker, anything else ejects the engine again for the next, longer
backoff. Only a probe re-admits an ejected engine: requests that were already running on it
when it was ejected say nothing about it now.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import Enum


@dataclass(frozen=True)
class BreakerPolicy:
    failures: int = 3
    backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    # The backoff is shortened by up to this fraction, at random.
    jitter: float = 0.5

    def __post_init__(self) -> None:
        if self.failures < 1 or self.backoff_s <= 0 or self.max_backoff_s < self.backoff_s:
            raise ValueError("need failures >= 1 and 0 < backoff_s <= max_backoff_s")
        if not 0 <= self.jitter < 1:
            raise ValueError("jitter must be in [0, 1)")


class State(Enum):
    CLOSED = "closed"  # in the ring
    OPEN = "open"  # ejected until the backoff ends
    PROBING = "probing"  # backoff over, one health probe running


@dataclass
class _Engine:
    state: State = State.CLOSED
    failures: int = 0  # consecutive, while closed
    ejections: int = 0  # consecutive, reset by a success
    until: float = 0.0


class Breakers:
    """The breakers of the endpoints the router knows."""

    def __init__(
        self,
        policy: BreakerPolicy,
        clock: Callable[[], float] = time.monotonic,
        rng: Callable[[], float] = random.random,
    ) -> None:
        self.policy = policy
        self._clock = clock
        self._rng = rng
        self._engines: dict[str, _Engine] = {}

    def retain(self, endpoints: Iterable[str]) -> None:
        """Forget endpoints that left: one that comes back starts with a closed breaker."""
        keep = set(endpoints)
        self._engines = {ep: e for ep, e in self._engines.items() if ep in keep}

    def state(self, endpoint: str) -> State:
        engine = self._engines.get(endpoint)
        return engine.state if engine else State.CLOSED

    def ejected(self) -> frozenset[str]:
        return frozenset(ep for ep, e in self._engines.items() if e.state is not State.CLOSED)

    def success(self, endpoint: str) -> None:
        engine = self._engines.get(endpoint)
        if engine is not None and engine.state is State.CLOSED:
            engine.failures = 0
            engine.ejections = 0

    def failure(self, endpoint: str) -> bool:
        """Count a failure; True when it ejects the endpoint."""
        engine = self._engines.setdefault(endpoint, _Engine())
        if engine.state is not State.CLOSED:
            return False
        engine.failures += 1
        if engine.failures < self.policy.failures:
            return False
        self._eject(engine)
        return True

    def due_probes(self) -> list[str]:
        """Ejected endpoints whose backoff is over; each is now probing (probe it once)."""
        now = self._clock()
        due = [ep for ep, e in self._engines.items() if e.state is State.OPEN and now >= e.until]
        for ep in due:
            self._engines[ep].state = State.PROBING
        return due

    def probe_result(self, endpoint: str, healthy: bool) -> bool:
        """Record a probe's outcome; True when it ejects the endpoint again."""
        engine = self._engines.get(endpoint)
        if engine is None or engine.state is not State.PROBING:
            return False  # the endpoint left meanwhile
        if healthy:
            engine.state = State.CLOSED
            engine.failures = 0
            return False
        self._eject(engine)
        return True

    def backoff(self, ejections: int) -> float:
        """The n-th ejection in a row (0-based) lasts this long, before jitter."""
        p = self.policy
        # The exponent is capped before it can overflow a float.
        return min(p.max_backoff_s, p.backoff_s * 2.0 ** min(ejections, 60))

    def _eject(self, engine: _Engine) -> None:
        wait = self.backoff(engine.ejections) * (1.0 - self.policy.jitter * self._rng())
        engine.state = State.OPEN
        engine.until = self._clock() + wait
        engine.ejections += 1
        engine.failures = 0
