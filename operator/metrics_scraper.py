"""Reading the engines' and routers' Prometheus metrics for the autoscaler.

Targets are pods, not Services: the autoscaler needs each engine's own numbers, and a Service
would answer from one pod at random. A pod's /metrics is untrusted input, so a body is read as
kvfleet.telemetry.metrics_reader reads one, within a deadline, parsed off the event loop, and
every value is checked. A pod that does not answer or answers something unusable is reported
unanswered with the reason, never as idle, and counted in kvfleet_operator_scrape_failures_total
(docs/autoscaling.md#pods-that-do-not-answer-pods-still-starting).
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
from prometheus_client import Counter

from kvfleet.operator.latency import Buckets
from kvfleet.operator.scaling_policy import MAX_BLOCKS, MAX_REQUESTS, PodMetrics, out_of_range
from kvfleet.telemetry.metric_names import (
    KV_CACHE_USAGE,
    PREFIX_CACHE_BLOCKS,
    ROUTER_HELD_REQUESTS,
    RUNNING,
    WAITING,
)
from kvfleet.telemetry.metrics_reader import ScrapeError, SeriesSums, sample_lines

logger = logging.getLogger("kvfleet.operator.metrics")

# What the autoscaler reads of each engine; the prefix-cache blocks are optional: engines before
# them lack them, and the autoscaler then ranks warmth by KV-cache usage.
ENGINE_REQUIRED = (RUNNING, WAITING, KV_CACHE_USAGE)
ENGINE_NAMES = (*ENGINE_REQUIRED, PREFIX_CACHE_BLOCKS)
METRICS_PATH = "/metrics"

# A counter past 2**53 can no longer count by ones in a float: broken, not busy.
MAX_COUNT = float(2**53)
MAX_BODY_BYTES = 4 * 2**20  # an engine's whole exposition is tens of KiB
# A line this long is no exposition line; keeping it would let one line hold the whole body.
MAX_LINE_CHARS = 64 * 2**10
# Series of the wanted metrics in one answer: an engine has a few per served model (each bucket
# of a histogram is one); each is remembered for the scrape, to count it once.
MAX_SERIES = 1024

SCRAPE_FAILURES = Counter(
    "kvfleet_operator_scrape_failures",
    "Pod /metrics scrapes whose numbers were not used, by reason.",
    ["reason"],
)


@dataclass(frozen=True)
class Target:
    name: str  # the pod's name, as reported in status
    url: str


def _is_ready(pod: Mapping[str, Any]) -> bool:
    status = pod.get("status") or {}
    return (
        not (pod.get("metadata") or {}).get("deletionTimestamp")
        and bool(status.get("podIP"))
        and any(
            c.get("type") == "Ready" and c.get("status") == "True"
            for c in status.get("conditions") or []
        )
    )


def _http_port(pod: Mapping[str, Any], default: int) -> int:
    for container in (pod.get("spec") or {}).get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("name") == "http" and port.get("containerPort"):
                return int(port["containerPort"])
    return default


def ready_targets(pods: Iterable[Mapping[str, Any]], default_port: int) -> list[Target]:
    """The /metrics URL of each Ready pod that has an IP, by pod name, on its container port
    named ``http`` (what the operator's Deployments declare; tests point it at their own
    servers), else ``default_port``."""
    targets = []
    for pod in pods:
        if not _is_ready(pod):
            continue
        ip = pod["status"]["podIP"]
        host = f"[{ip}]" if ":" in ip else ip
        port = _http_port(pod, default_port)
        targets.append(Target(pod["metadata"]["name"], f"http://{host}:{port}{METRICS_PATH}"))
    return sorted(targets, key=lambda t: t.name)


def histogram_buckets(values: Mapping[str, float], histogram: str) -> Buckets | None:
    """One histogram's buckets out of parse_samples' results, by bound; None when it has none
    or no +Inf bucket (a cut-off or broken exposition)."""
    prefix = f'{histogram}_bucket{{le="'
    buckets = []
    for key, count in values.items():
        if key.startswith(prefix):
            try:
                buckets.append((float(key[len(prefix) : -2]), count))
            except ValueError:
                return None
    buckets.sort()
    if not buckets or not math.isinf(buckets[-1][0]):
        return None
    return tuple(buckets)


class Scraper:
    """Scrapes pods' /metrics over one connection pool; ``close`` it when done.

    The pool is sized for ``max_concurrent`` scrapes, with a semaphore of as many slots: a pod's
    timeout starts once it holds a slot, so waiting behind other pods never counts against it,
    and the wait for a slot has its own deadline."""

    def __init__(
        self,
        *,
        timeout: float = 2.0,
        max_body_bytes: int = MAX_BODY_BYTES,
        max_concurrent: int = 256,
        slot_wait: float = 5.0,
        session: aiohttp.ClientSession | None = None,
    ) -> None:
        """``timeout``: per pod, from a held slot to the last byte. ``max_concurrent``: scrapes
        in flight at once, over all services. ``slot_wait``: the longest wait for a slot before
        the pod counts as unreachable. ``session``: a caller's own client, not closed here (its
        connector's limit then applies too)."""
        self.timeout = timeout
        self.max_body_bytes = max_body_bytes
        self.max_concurrent = max_concurrent
        self.slot_wait = slot_wait
        self._session = session
        self._own_session = session is None
        # Made on first use, in the loop that scrapes.
        self._slots: asyncio.Semaphore | None = None

    async def close(self) -> None:
        if self._own_session and self._session is not None:
            await self._session.close()
            self._session = None
        self._slots = None

    async def __aenter__(self) -> Scraper:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()

    def _client(self) -> tuple[aiohttp.ClientSession, asyncio.Semaphore]:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                # As many connections as slots: a slot's holder never waits for one.
                connector=aiohttp.TCPConnector(limit=self.max_concurrent, limit_per_host=0),
                timeout=aiohttp.ClientTimeout(total=None),  # each scrape has its own deadline
            )
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.max_concurrent)
        return self._session, self._slots

    async def _values(self, target: Target, names: Sequence[str]) -> dict[str, float]:
        """The named metrics of one pod, summed over series and checked; raises ScrapeError."""
        session, slots = self._client()
        try:
            async with asyncio.timeout(self.slot_wait):
                await slots.acquire()
        except TimeoutError:
            raise ScrapeError("no_slot", f"no scrape slot within {self.slot_wait:g}s") from None
        try:
            async with asyncio.timeout(self.timeout):
                values = await self._fetch(session, target, names)
        except TimeoutError:
            raise ScrapeError("timeout", f"no metrics within {self.timeout:g}s") from None
        except (aiohttp.ClientError, OSError) as e:
            raise ScrapeError("connection", f"no metrics: {e!r}") from None
        finally:
            slots.release()
        for name, value in values.items():
            high = {KV_CACHE_USAGE: 1.0, PREFIX_CACHE_BLOCKS: MAX_BLOCKS}.get(name, MAX_REQUESTS)
            if name.endswith("}"):  # a histogram bucket: a count since the engine started
                high = MAX_COUNT
            if why := out_of_range(value, high):
                raise ScrapeError("out_of_range", f"{name}: {why}")
        return values

    async def _fetch(
        self, session: aiohttp.ClientSession, target: Target, names: Sequence[str]
    ) -> dict[str, float]:
        async with session.get(target.url) as response:
            found = SeriesSums(names, max_series=MAX_SERIES)
            async for lines in sample_lines(
                response, names, max_body_bytes=self.max_body_bytes, max_line_chars=MAX_LINE_CHARS
            ):
                # Off the event loop: a hostile body may be all wanted lines.
                await asyncio.to_thread(found.add, lines)
            return found.sums

    async def _scrape(
        self, targets: Sequence[Target], names: Sequence[str], *, required: Sequence[str] = ()
    ) -> list[dict[str, float] | str]:
        """Per target, its values or why there are none. One pod's failure, whatever it is, never
        stops the others'."""

        async def one(target: Target) -> dict[str, float] | str:
            try:
                values = await self._values(target, names)
                if missing := [n for n in required if n not in values]:
                    raise ScrapeError("missing", f"metrics lack {', '.join(missing)}")
                return values
            except ScrapeError as e:
                reason, message = e.reason, str(e)
            except Exception as e:  # a bug or a failure mode not foreseen, on untrusted input
                logger.exception("%s: scraping %s failed", target.name, target.url)
                reason, message = "error", f"scrape failed: {e!r}"
            SCRAPE_FAILURES.labels(reason).inc()
            logger.warning("%s: %s (%s)", target.name, message, target.url)
            return message

        return await asyncio.gather(*(one(t) for t in targets))

    async def engines(
        self, targets: Sequence[Target], latency_histogram: str | None = None
    ) -> list[PodMetrics]:
        """Queue depth, KV-cache usage and cached blocks of each engine, and the cumulative
        buckets of ``latency_histogram`` if named; a pod without the first two is unanswered,
        with the reason as its ``error``."""
        names = ENGINE_NAMES
        if latency_histogram is not None:
            names = (*names, f"{latency_histogram}_bucket")
        results = await self._scrape(targets, names, required=ENGINE_REQUIRED)
        return [
            PodMetrics(target.name, error=values)
            if isinstance(values, str)
            else PodMetrics(
                target.name,
                values[RUNNING],
                values[WAITING],
                values[KV_CACHE_USAGE],
                cached_blocks=values.get(PREFIX_CACHE_BLOCKS),
                latency=histogram_buckets(values, latency_histogram) if latency_histogram else None,
            )
            for target, values in zip(targets, results, strict=True)
        ]

    async def held_requests(self, targets: Sequence[Target]) -> tuple[float, dict[str, str]]:
        """Requests the routers hold for want of a ready engine, summed; and why each router that
        did not count did not. A router that answers without the gauge holds nothing (a labelled
        gauge has no series until first set)."""
        results = await self._scrape(targets, (ROUTER_HELD_REQUESTS,))
        held, failed = 0.0, {}
        for target, values in zip(targets, results, strict=True):
            if isinstance(values, str):
                failed[target.name] = values
            else:
                held += values.get(ROUTER_HELD_REQUESTS, 0.0)
        return held, failed
