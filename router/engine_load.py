"""The engines' own load, as their /metrics report it, so that the bounded-load check counts the
whole fleet's requests and not only this router's.

Several router replicas each see a fraction of the traffic: by its own count alone, a router
finds an engine idle that the others keep full, and its bound (a multiple of the mean of its own
counts) is a handful of requests, so keyed requests spill off warm engines at low load. Every
``interval`` seconds the poller reads ``vllm:num_requests_running`` and ``_waiting`` (summed
over series), ``kvfleet_engine_max_num_seqs`` and ``vllm:kv_cache_usage_perc`` (for precise
prefix scoring's load, prefix_score.py) from each ready engine; between scrapes the
router adds the requests it started there since and takes off those that finished
(``estimated_load``). The same scrape reads which LoRA adapters the engine holds, per tier, and
its GPU slots (``adapters_of``), for adapter placement. An engine with free batch slots and an
empty queue starts a request at once, so it is never over the bound (``has_free_slots``):
spilling off it would only cost a prefix-cache miss.

An engine's /metrics is semi-trusted input, read as kvfleet.telemetry.metrics_reader reads one:
a scrape has a deadline and a byte limit, keeps only the sample lines of those metrics (a
bounded number of them), and checks every value. A
failed scrape, whatever the reason, drops that engine's report: the router then counts only its
own requests there, as it does with the poller off.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from kvfleet.router.adapter_placement import EngineAdapters
from kvfleet.telemetry.metric_names import (
    KV_CACHE_USAGE,
    LORA_NAME,
    LORA_REQUESTS_INFO,
    LORA_REQUESTS_INFO_LABELS,
    LORA_RESIDENT,
    LORA_TIER,
    MAX_NUM_SEQS,
    RUNNING,
    WAITING,
)
from kvfleet.telemetry.metrics_reader import ScrapeError, parse_samples, sample_lines

logger = logging.getLogger("kvfleet.router.engine_load")

LOAD_NAMES = (RUNNING, WAITING, MAX_NUM_SEQS, KV_CACHE_USAGE)
NAMES = (*LOAD_NAMES, LORA_RESIDENT, LORA_REQUESTS_INFO)
MAX_LORA_LABEL = LORA_REQUESTS_INFO_LABELS[2]
# An engine's whole exposition is tens of KiB.
MAX_BODY_BYTES = 1 * 2**20
# A line this long is no exposition line; keeping it would let one line hold the whole body.
MAX_LINE_CHARS = 4096
# One series per served model name, and one per adapter an engine holds (--max-cpu-loras, at
# most 1024 where the operator sets it); more is garbage, and few lines keep parsing on the
# loop cheap.
MAX_SERIES = 64 + 1024
# No engine holds a million requests: a larger value is broken, not busy.
MAX_VALUE = 1e6


@dataclass(frozen=True)
class EngineReport:
    """One scrape: the engine's running and waiting requests (every router's), its batch size
    when it exports one, and this router's own requests in flight there when it answered."""

    running: int
    waiting: int
    max_num_seqs: int | None
    own_at_scrape: int
    # The LoRA adapters it holds; None when it reports none (LoRA off, or an older engine).
    adapters: EngineAdapters | None = None
    # The fraction of its KV cache in use (0 to 1); None when it exports none.
    kv_usage: float | None = None


def estimated_load(own: int, report: EngineReport | None) -> int:
    """The requests on an engine now: what it reported, plus this router's requests started
    there since, less those finished since; never less than this router's own in flight."""
    if report is None:
        return own
    return max(own, report.running + report.waiting + own - report.own_at_scrape)


def has_free_slots(own: int, report: EngineReport | None) -> bool:
    """Whether one more request would start at once: nothing queued and a batch slot free."""
    return (
        report is not None
        and report.max_num_seqs is not None
        and report.waiting == 0
        and estimated_load(own, report) < report.max_num_seqs
    )


def adapters_of(lines: Iterable[str]) -> EngineAdapters | None:
    """The adapters an engine holds, from its LORA_RESIDENT series (one per adapter held,
    labelled by name and tier) and LORA_REQUESTS_INFO's max_lora (its GPU slots); None when it
    exports neither. Raises ScrapeError."""
    wanted = [
        line for line in lines if line.lstrip().startswith((LORA_RESIDENT, LORA_REQUESTS_INFO))
    ]
    if not wanted:
        return None
    tiers: dict[str, set[str]] = {"gpu": set(), "cpu": set()}
    max_loras: int | None = None
    try:
        families = list(text_string_to_metric_families("\n".join(wanted) + "\n"))
    except ValueError as e:
        raise ScrapeError("unparsable", f"unreadable metrics: {e}") from None
    for family in families:
        for sample in family.samples:
            if sample.name == LORA_RESIDENT and sample.value > 0:
                tier, name = sample.labels.get(LORA_TIER), sample.labels.get(LORA_NAME)
                if tier in tiers and name:
                    tiers[tier].add(name)
            elif sample.name == LORA_REQUESTS_INFO:
                slots = sample.labels.get(MAX_LORA_LABEL, "")
                if not slots.isdigit() or not 0 < int(slots) <= MAX_VALUE:
                    raise ScrapeError(
                        "out_of_range", f"{LORA_REQUESTS_INFO} max_lora {slots[:32]!r}"
                    )
                max_loras = int(slots)
    gpu = frozenset(tiers["gpu"])
    return EngineAdapters(gpu=gpu, cpu=frozenset(tiers["cpu"]) - gpu, max_loras=max_loras)


def report_of(lines: Iterable[str], own_at_scrape: int) -> EngineReport:
    """The report of the sample lines of an exposition (``NAMES`` only); raises ScrapeError."""
    lines = list(lines)
    found = parse_samples(lines, LOAD_NAMES)
    if missing := [n for n in (RUNNING, WAITING) if n not in found]:
        raise ScrapeError("missing", f"metrics lack {', '.join(missing)}")
    for name, value in found.items():
        top = 1.0 if name == KV_CACHE_USAGE else MAX_VALUE
        if not (math.isfinite(value) and 0 <= value <= top):
            raise ScrapeError("out_of_range", f"{name} = {value}")
    batch = found.get(MAX_NUM_SEQS)
    return EngineReport(
        running=round(found[RUNNING]),
        waiting=round(found[WAITING]),
        max_num_seqs=round(batch) if batch else None,
        own_at_scrape=own_at_scrape,
        adapters=adapters_of(lines),
        kv_usage=found.get(KV_CACHE_USAGE),
    )


async def read_samples(response: aiohttp.ClientResponse, max_body_bytes: int) -> list[str]:
    """The wanted sample lines of a /metrics body, at most MAX_SERIES of them (few lines keep
    parsing them on the event loop cheap). Raises ScrapeError."""
    lines: list[str] = []
    async for chunk in sample_lines(
        response, NAMES, max_body_bytes=max_body_bytes, max_line_chars=MAX_LINE_CHARS
    ):
        lines += chunk
        if len(lines) > MAX_SERIES:
            raise ScrapeError("too_many_series", f"over {MAX_SERIES} series")
    return lines


class EngineLoadPoller:
    """Scrapes every ready engine's /metrics each ``interval`` seconds and hands each result to
    ``on_report`` (None for a failed scrape). ``endpoints`` and ``own`` are read at scrape time:
    the ready endpoints, and this router's requests in flight on one."""

    def __init__(
        self,
        interval: float,
        endpoints: Callable[[], Iterable[str]],
        own: Callable[[str], int],
        on_report: Callable[[str, EngineReport | None], None],
        on_failure: Callable[[str, str], None],
        *,
        max_body_bytes: int = MAX_BODY_BYTES,
    ) -> None:
        if interval <= 0:
            raise ValueError("the engine load interval must be > 0")
        self.interval = interval
        # A report older than a round is as stale as none, and a slow engine must not hold the
        # round up: each scrape gets the interval, at most 2 s.
        self.timeout = min(interval, 2.0)
        self.endpoints = endpoints
        self.own = own
        self.on_report = on_report
        self.on_failure = on_failure
        self.max_body_bytes = max_body_bytes

    async def run(self) -> None:
        """Scrape until cancelled."""
        loop = asyncio.get_running_loop()
        async with aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None),  # each scrape has its own deadline
            auto_decompress=False,  # an engine's exposition is never worth a decompression bomb
            connector=aiohttp.TCPConnector(limit=0),
        ) as session:
            while True:
                started = loop.time()
                await self.poll(session)
                await asyncio.sleep(max(0.0, started + self.interval - loop.time()))

    async def poll(self, session: aiohttp.ClientSession) -> None:
        """One round: every ready engine, at once."""
        endpoints = sorted(self.endpoints())
        await asyncio.gather(*(self._scrape(session, ep) for ep in endpoints))

    async def _scrape(self, session: aiohttp.ClientSession, endpoint: str) -> None:
        try:
            async with asyncio.timeout(self.timeout):
                async with session.get(
                    f"http://{endpoint}/metrics", headers={"Accept-Encoding": "identity"}
                ) as response:
                    # The engine's numbers are as of its answer: count own requests from here.
                    own = self.own(endpoint)
                    lines = await read_samples(response, self.max_body_bytes)
            report = report_of(lines, own)
        except ScrapeError as e:
            self._failed(endpoint, e.reason, str(e))
        except TimeoutError:
            self._failed(endpoint, "timeout", f"no metrics within {self.timeout:g}s")
        except (aiohttp.ClientError, OSError) as e:
            self._failed(endpoint, "connection", f"no metrics: {e!r}")
        except Exception as e:  # a failure mode not foreseen, on semi-trusted input
            logger.exception("engine load of %s: scrape failed", endpoint)
            self._failed(endpoint, "error", repr(e))
        else:
            self.on_report(endpoint, report)

    def _failed(self, endpoint: str, reason: str, message: str) -> None:
        logger.debug("engine load of %s: %s", endpoint, message)
        self.on_failure(endpoint, reason)
        self.on_report(endpoint, None)
