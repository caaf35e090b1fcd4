"""Reading another process's Prometheus /metrics, which is untrusted input: the operator's
autoscaler reads engines and routers, the router reads engines.

One peer must not exhaust the reader's memory or stall its event loop. So a body is streamed and
cut off past ``max_body_bytes`` or at a line longer than ``max_line_chars``; only the sample lines
of the wanted metrics are kept, a chunk at a time, so memory stays a chunk and a line whatever
the body; a deadline is the caller's (it owns the request). Parsing is prometheus-client's, so
the exposition format (escapes, timestamps, comments) is read as Prometheus reads it. Each
reader checks the values against what its metrics can be.
"""

from __future__ import annotations

import codecs
import functools
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


def parse_samples(lines: Iterable[str], names: Iterable[str]) -> dict[str, float]:
    """The sum over series of each named metric in some sample lines; absent ones are left out.
    A named ``<histogram>_bucket`` is kept per bucket, under bucket_key. Raises ScrapeError on
    text that is not the exposition format."""
    wanted = set(names)
    found: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families("\n".join(lines) + "\n"):
            for sample in family.samples:
                if sample.name in wanted:
                    key = sample.name
                    if key.endswith("_bucket") and "le" in sample.labels:
                        key = bucket_key(key.removesuffix("_bucket"), sample.labels["le"])
                    found[key] = found.get(key, 0.0) + sample.value
    except ValueError as e:
        raise ScrapeError("unparsable", f"unreadable metrics: {e}") from None
    return found
