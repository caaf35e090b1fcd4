"""kopf's watch streams recover from every failure in process, with a backoff that grows.

kopf 1.45 retries each request of a stream but not the stream itself: an answer it does not
retry (410 Gone, 400, 404) or an ERROR event ends its watcher and then the whole operator, and
a watch that ends at once without an event, or drops mid-stream, is reopened in a hot loop. No
public setting reaches these, so ``install()`` wraps the two functions of
``kopf._cogs.clients.watching`` that kopf looks up by name (``continuous_watch``,
``watch_objs``): any exception makes kopf list again, as a 410 event does, and each request
first waits what the stream's WatchPacer says. kopf's own listing and event handling are
unchanged. They rely on kopf's internals, so the versions they were written against are checked
at import and pyproject.toml pins kopf to that series. docs/operations.md#api-outages has the
behaviour and its bounds.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import logging
import time
import weakref
from collections.abc import AsyncIterator, Iterable, Iterator
from importlib.metadata import version
from typing import Any

from kopf._cogs.clients import watching

logger = logging.getLogger("kvfleet.operator.watch")

KOPF_SERIES = "1.45."
# A stream that stays open this long costs no more requests than the longest wait would.
HEALTHY_STREAM_S = 30.0


def _check_kopf() -> None:
    """Fail at import, not at the first watch failure, if kopf is not what this was written for:
    the wrappers must be called where kopf's functions were, with the same parameters."""
    problems = []
    if not (found := version("kopf")).startswith(KOPF_SERIES):
        problems.append(f"kopf {found} is not {KOPF_SERIES}x")
    stream = {"settings", "resource", "namespace", "operator_pause_waiter"}
    for caller, callee, params in (
        ("infinite_watch", "continuous_watch", stream),
        ("continuous_watch", "watch_objs", stream | {"since"}),
    ):
        outer, inner = getattr(watching, caller, None), getattr(watching, callee, None)
        if not (inspect.isasyncgenfunction(outer) and inspect.isasyncgenfunction(inner)):
            problems.append(f"watching.{caller} or watching.{callee} is gone")
            continue
        if callee not in outer.__code__.co_names:
            problems.append(f"watching.{caller} no longer calls {callee} by name")
        if not params <= set(inspect.signature(inner).parameters):
            problems.append(f"watching.{callee} takes other parameters")
    if not hasattr(getattr(watching, "Bookmark", None), "LISTED"):
        problems.append("no watching.Bookmark.LISTED")
    if problems:
        raise ImportError("kvfleet's watch recovery wraps kopf's internals: " + "; ".join(problems))


_check_kopf()
_kopf_continuous_watch = watching.continuous_watch
_kopf_watch_objs = watching.watch_objs


def _delays(backoffs: float | Iterable[float]) -> Iterator[float]:
    """kopf's error_backoffs as an endless sequence: a finite one repeats its last delay."""
    if isinstance(backoffs, int | float):
        yield from itertools.repeat(float(backoffs))
        return
    last = 0.0
    for last in backoffs:
        yield last
    yield from itertools.repeat(last)


class WatchPacer:
    """When a watch stream's next list or watch request may go, and since when the stream has
    been failing. Pure: the caller passes its monotonic clock's time to each call.

    A failure is an error out of a list or a watch, or a watch that ends (by its end or by an
    ERROR event) before it delivered an event or had been open healthy_after seconds. Each
    failure in a row draws the next of ``backoffs``; an event, or a watch open that long, starts
    them again. A completed list ends failing_for but not the backoff: a watch failing after
    each list must not make the lists come faster; the watch that follows it goes at once."""

    def __init__(
        self, backoffs: float | Iterable[float], healthy_after: float = HEALTHY_STREAM_S
    ) -> None:
        self._backoffs = backoffs
        self._healthy_after = healthy_after
        self._next: Iterator[float] | None = None
        self.delay = 0.0  # before the next request
        self.failures = 0  # in a row
        self._failing_since: float | None = None
        self._opened: float | None = None
        self._events = 0

    def failed(self, now: float) -> None:
        if self._next is None:
            self._next = _delays(self._backoffs)
        self.delay = next(self._next)
        self.failures += 1
        if self._failing_since is None:
            self._failing_since = now
        self._opened = None

    def listed(self, now: float) -> None:
        # The watch that follows a list goes at once (a wait would only delay the events since
        # the list), and the next failure draws the next delay.
        self._failing_since, self.delay = None, 0.0

    def opened(self, now: float) -> None:
        self._opened, self._events = now, 0

    def event(self, now: float) -> None:
        self._events += 1
        self._recovered()

    def ended(self, now: float) -> None:
        """The watch opened last has ended, by itself or with an ERROR event."""
        if self._opened is None:
            return
        if self._events or now - self._opened >= self._healthy_after:
            self._recovered()
            self._opened = None
        else:
            self.failed(now)

    def paused(self) -> None:
        """kopf stopped the stream to pause (peering): not a failure, and nothing to judge."""
        self._opened, self._failing_since = None, None

    def failing_for(self, now: float) -> float:
        """Seconds since the first failure that nothing has made good since; 0 when working."""
        if self._failing_since is None:
            return 0.0
        if self._opened is not None and now - self._opened >= self._healthy_after:
            return 0.0  # a watch open long enough works, events or not
        return now - self._failing_since

    def _recovered(self) -> None:
        self._next, self.delay, self.failures, self._failing_since = None, 0.0, 0, None


# Each watch stream's pacer, by the watcher task of kopf's that iterates it.
PACERS: weakref.WeakKeyDictionary[asyncio.Task[Any], WatchPacer] = weakref.WeakKeyDictionary()


def _pacer(settings: Any) -> WatchPacer:
    task = asyncio.current_task()
    assert task is not None  # kopf iterates watches in its watcher tasks
    pacer = PACERS.get(task)
    if pacer is None:
        pacer = PACERS[task] = WatchPacer(settings.networking.error_backoffs)
    return pacer


async def _wait(pacer: WatchPacer, pause: asyncio.Future[Any]) -> None:
    """The pacer's delay, cut short when kopf pauses the stream."""
    if pacer.delay > 0 and not pause.done():
        await asyncio.wait([pause], timeout=pacer.delay)


def _where(resource: Any, namespace: str | None) -> str:
    return f"{resource.plural} in {namespace}" if namespace else f"{resource.plural}"


async def continuous_watch(
    *, settings: Any, resource: Any, namespace: Any, operator_pause_waiter: Any, **kwargs: Any
) -> AsyncIterator[Any]:
    pacer = _pacer(settings)
    await _wait(pacer, operator_pause_waiter)
    if operator_pause_waiter.done():
        pacer.paused()
        return
    listed = False
    try:
        async for event in _kopf_continuous_watch(
            settings=settings,
            resource=resource,
            namespace=namespace,
            operator_pause_waiter=operator_pause_waiter,
            **kwargs,
        ):
            if event is watching.Bookmark.LISTED:
                listed = True
                pacer.listed(time.monotonic())
            yield event
    except Exception as e:
        # A failure while watching is the watch's, counted by watch_objs.
        if not listed:
            pacer.failed(time.monotonic())
        logger.warning(
            "Watching %s failed, listing again in %.1fs: %r",
            _where(resource, namespace),
            pacer.delay + settings.watching.reconnect_backoff,
            e,
        )
        return
    if operator_pause_waiter.done():
        pacer.paused()
    elif not listed:
        # kopf's list ends without an error only when the connection dropped.
        pacer.failed(time.monotonic())
        logger.warning(
            "Listing %s failed (%s in a row), listing again in %.1fs",
            _where(resource, namespace),
            pacer.failures,
            pacer.delay + settings.watching.reconnect_backoff,
        )


async def watch_objs(
    *, settings: Any, resource: Any, namespace: Any, operator_pause_waiter: Any, **kwargs: Any
) -> AsyncIterator[Any]:
    pacer = _pacer(settings)
    await _wait(pacer, operator_pause_waiter)
    if operator_pause_waiter.done():
        return  # continuous_watch's loop ends with it
    pacer.opened(time.monotonic())
    ended = False
    try:
        async for raw in _kopf_watch_objs(
            settings=settings,
            resource=resource,
            namespace=namespace,
            operator_pause_waiter=operator_pause_waiter,
            **kwargs,
        ):
            if raw.get("type") == "ERROR":
                # kopf lists again (410) or raises; either way the watch has ended.
                ended = True
                pacer.ended(time.monotonic())
            else:
                pacer.event(time.monotonic())
            yield raw
    except Exception:
        pacer.failed(time.monotonic())
        raise
    if operator_pause_waiter.done():
        pacer.paused()
    elif not ended:
        pacer.ended(time.monotonic())
        if pacer.failures:
            logger.warning(
                "The watch of %s ended with no event (%s in a row), watching again in %.1fs",
                _where(resource, namespace),
                pacer.failures,
                pacer.delay,
            )


def install() -> None:
    """Put the wrappers in kopf's place; idempotent."""
    watching.continuous_watch = continuous_watch
    watching.watch_objs = watch_objs
