"""Exponential backoff with jitter: the delay after failures in a row, and the same kept per key
(an object's URL) for the writes of the operator's client.

After n failures in a row the next attempt waits ``first * 2**(n-1)``, at most ``cap``, times a
random factor in [0.5, 1]: clients that failed together (an API outage) spread out when they
come back, and a retry never waits less than half its nominal delay.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


def backoff_delay(failures: int, first: float, cap: float) -> float:
    """The delay before the attempt that follows ``failures`` failures in a row."""
    nominal = min(first * 2 ** (failures - 1), cap)
    return nominal * random.uniform(0.5, 1.0)


@dataclass(frozen=True)
class Failing:
    """A key's failures in a row, when the last one was and when it may be tried next, and why
    the last attempt failed."""

    failures: int
    failed_at: float
    retry_at: float
    last: str
    status: int  # the last failure's HTTP status (0: no answer)


class PerKeyBackoff(Generic[K]):
    """Which keys failed last time they were tried, and until when each backs off.

    A key is remembered from its first failure to its next success, or until it has not failed
    for ``forget_after`` seconds (an object deleted meanwhile is never tried again): the number
    of keys held is the number of keys that failed within that time."""

    def __init__(
        self,
        first: float,
        cap: float,
        *,
        forget_after: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.first, self.cap = first, cap
        self._forget_after = forget_after
        self._clock = clock
        self._failing: dict[K, Failing] = {}

    def failing(self, key: K) -> Failing | None:
        """The key's failures, None when its last attempt succeeded (or was long ago)."""
        state = self._failing.get(key)
        if state is not None and self._clock() - state.failed_at > self._forget_after:
            del self._failing[key]
            return None
        return state

    def wait(self, key: K) -> float:
        """Seconds until the key may be tried again; 0 when it may be now."""
        state = self.failing(key)
        return max(0.0, state.retry_at - self._clock()) if state is not None else 0.0

    def failed(self, key: K, last: str, status: int) -> Failing:
        """Record a failure; the returned state says when the key may be tried next."""
        now = self._clock()
        previous = self.failing(key)
        self._failing = {
            k: s for k, s in self._failing.items() if now - s.failed_at <= self._forget_after
        }
        failures = (previous.failures if previous else 0) + 1
        retry_at = now + backoff_delay(failures, self.first, self.cap)
        state = self._failing[key] = Failing(failures, now, retry_at, last, status)
        return state

    def succeeded(self, key: K) -> None:
        self._failing.pop(key, None)
