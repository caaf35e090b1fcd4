"""Reading another process's Prometheus /metrics, which is untrusted input: the operator's
autoscaler reads engines and routers, the router reads engines.

One peer must not exhaust the reader's memory or stall its event loop, so a body is streamed,
cut off past a size or at a line too long, and only the wanted metrics' sample lines are kept,
a chunk at a time; the deadline is the caller's (it owns the request). Parsing is
prometheus-client's, so the format is read as Prometheus reads it; each reader checks the
values against what its metrics can be.
"""

from __future__ import annotations

import codecs
import functools
import hashlib
import math
import re
from collections.abc import AsyncIterator, Iterable

import aiohttp
from prometheus_client.parser import text_string_to_metric_families


class ScrapeError(Exception):
    """Why a peer's metrics are not used: ``reason`` is a short fixed word, for a metric label."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@functools.cache
def _sample_line(names: tuple[str, ...]) -> re.Pattern[str]:
    """Matches the whole sample lines of the named metrics (and of no metric they prefix)."""
    alternatives = "|".join(re.escape(n) for n in names)
    return re.compile(rf"^[ \t]*(?:{alternatives})[{{ \t].*$", re.MULTILINE)


async def sample_lines(
    response: aiohttp.ClientResponse,
    names: Iterable[str],
    *,
    max_body_bytes: int,
    max_line_chars: int,
) -> AsyncIterator[list[str]]:
    """The sample lines of the named metrics in a 200 response's body, a chunk's worth at a time.
    Leaving early closes the connection: the rest of the body is never read. Raises ScrapeError."""
    if response.status != 200:
        raise ScrapeError("http_status", f"/metrics answered {response.status}")
    pattern = _sample_line(tuple(names))
    decoder = codecs.getincrementaldecoder("utf-8")()
    size, rest = 0, ""
    async for chunk in response.content.iter_any():
        size += len(chunk)
        if size > max_body_bytes:
            raise ScrapeError("too_large", f"metrics body over {max_body_bytes} bytes")
        try:
            text = rest + decoder.decode(chunk)
        except UnicodeDecodeError as e:
            raise ScrapeError("not_utf8", f"metrics body is not UTF-8: {e}") from None
        end = text.rfind("\n") + 1
        text, rest = text[:end], text[end:]
        if len(rest) > max_line_chars:
            raise ScrapeError("too_large", f"a metrics line over {max_line_chars} characters")
        if lines := pattern.findall(text):
            yield lines
    try:
        rest += decoder.decode(b"", final=True)
    except UnicodeDecodeError as e:
        raise ScrapeError("not_utf8", f"metrics body is not UTF-8: {e}") from None
    if lines := pattern.findall(rest):
        yield lines


def bucket_key(histogram: str, le: str) -> str:
    """The key of one histogram bucket among parse_samples' results, as Prometheus names the
    series: ``<histogram>_bucket{le="..."}``."""
    return f'{histogram}_bucket{{le="{le}"}}'


class SeriesSums:
    """The sum over series of each named metric in an exposition's sample lines, fed a chunk of
    lines at a time (``add``); a named ``<histogram>_bucket`` is summed per bucket, under
    bucket_key. Each series (name and labels) counts once; at most ``max_series`` of them.

    A series repeated with the same value is read as if said once (summing it would report
    demand that does not exist); one repeated with another value is not read at all, since which
    value holds cannot be known. Series are remembered by a digest of name and labels, a bounded
    few bytes each whatever a line's length."""

    def __init__(self, names: Iterable[str], *, max_series: int) -> None:
        self.wanted = frozenset(names)
        self.max_series = max_series
        self.sums: dict[str, float] = {}
        self._seen: dict[bytes, float] = {}  # a series' digest: its value

    def add(self, lines: Iterable[str]) -> None:
        """Raises ScrapeError on text that is not the exposition format, on a series repeated
        with another value, or past ``max_series`` series."""
        try:
            families = list(text_string_to_metric_families("\n".join(lines) + "\n"))
        except ValueError as e:
            raise ScrapeError("unparsable", f"unreadable metrics: {e}") from None
        for family in families:
            for sample in family.samples:
                if sample.name in self.wanted:
                    self._add(sample.name, sample.labels, sample.value)

    def _add(self, name: str, labels: dict[str, str], value: float) -> None:
        series = repr((name, sorted(labels.items()))).encode()
        digest = hashlib.blake2b(series, digest_size=16).digest()
        if (seen := self._seen.get(digest)) is not None:
            if seen != value and not (math.isnan(seen) and math.isnan(value)):
                # Not the labels: they are the peer's text, of any length, and this is reported.
                raise ScrapeError(
                    "conflicting_series", f"{name}: one series is both {seen:g} and {value:g}"
                )
            return
        if len(self._seen) >= self.max_series:
            raise ScrapeError("too_many_series", f"over {self.max_series} series")
        self._seen[digest] = value
        key = name
        if name.endswith("_bucket") and "le" in labels:
            key = bucket_key(name.removesuffix("_bucket"), labels["le"])
        self.sums[key] = self.sums.get(key, 0.0) + value


def parse_samples(lines: Iterable[str], names: Iterable[str]) -> dict[str, float]:
    """SeriesSums' sums of some sample lines, all at once; absent metrics are left out. Raises
    ScrapeError."""
    lines = list(lines)
    sums = SeriesSums(names, max_series=len(lines))
    sums.add(lines)
    return sums.sums
