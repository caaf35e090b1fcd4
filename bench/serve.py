"""Online-serving benchmark client for an OpenAI-compatible server (kvfleet, vLLM, ...).

Sends random token-id prompts (or one fixed ``--prompt`` text) as streaming requests at a chosen
arrival rate and reports throughput plus TTFT / TPOT / ITL / end-to-end latency, in the spirit of
``vllm bench serve``::

    python bench/serve.py --base-url http://127.0.0.1:8000 --model NAME \\
        --num-prompts 200 --input-len 512 --output-len 128 --request-rate 8 \\
        --max-concurrency 32 --prefix-len 256 --result-json out.json

Or as closed-loop users, each sending its next request as soon as its previous one finished, for
a fixed time after a warm-up; only requests that start and finish inside the measured window
count, and throughput is over the window's length::

    python bench/serve.py --model NAME --endpoint chat --prompt "Explain RAG in 3 sentences" \\
        --output-len 200 --users 32 --warmup-duration 10 --duration 60

Random ids must lie inside the served model's vocabulary: it is taken from ``--vocab-size``, or
from the tokenizer (``--tokenizer``, else ``--model`` when that is a local directory).

The pure parts (dataset, arrival schedule, SSE parsing, per-stream bookkeeping, aggregation,
report) are plain functions and classes; only :func:`send_request`, :func:`benchmark` and
:func:`closed_loop` touch the network.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import math
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import aiohttp
import numpy as np

logger = logging.getLogger("kvfleet.bench.serve")

Endpoint = Literal["completions", "chat"]
ENDPOINT_PATHS: dict[str, str] = {
    "completions": "/v1/completions",
    "chat": "/v1/chat/completions",
}
PERCENTILES: tuple[float, ...] = (50, 90, 99)
LatencyStats = dict[str, float | None]


# --------------------------------------------------------------------------------------------
# Dataset
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SampleRequest:
    """One prompt: ``prompt_ids[:prefix_len]`` is the prefix shared by every request."""

    prompt_ids: list[int]
    output_len: int
    prefix_len: int = 0

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)


def length_bounds(length: int, range_ratio: float) -> tuple[int, int]:
    """Integer bounds of the closed interval [length*(1-r), length*(1+r)]."""
    # Rounding first keeps float noise (10 * 0.7 = 7.000000000000001) from pushing ceil() past
    # an exact integer bound.
    lo = math.ceil(round(length * (1.0 - range_ratio), 9))
    hi = math.floor(round(length * (1.0 + range_ratio), 9))
    return lo, max(lo, hi)


def token_pool(vocab_size: int, excluded_ids: Sequence[int] = ()) -> np.ndarray:
    """Ids a random prompt may use: the vocabulary minus special/added tokens, which a server
    may refuse or treat as control tokens (an EOS in the prompt, a chat-template marker)."""
    pool = np.setdiff1d(np.arange(vocab_size, dtype=np.int64), np.asarray(excluded_ids, int))
    if pool.size == 0:
        raise ValueError("no token ids left to sample from")
    return pool


def generate_random_dataset(
    num_prompts: int,
    input_len: int,
    output_len: int,
    *,
    pool: np.ndarray,
    range_ratio: float = 0.0,
    prefix_len: int = 0,
    seed: int = 0,
) -> list[SampleRequest]:
    """Random-token prompts of ``prefix_len`` shared tokens plus ``input_len`` (± range) own ones.

    Each request's draws are made one request at a time, so the first ``n`` prompts are the same
    whatever ``num_prompts`` is; warmup prompts can then be taken from the tail without changing
    the measured ones.
    """
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    if prefix_len < 0 or input_len < 0 or output_len < 1:
        raise ValueError("need prefix_len >= 0, input_len >= 0 and output_len >= 1")
    rng = np.random.default_rng(seed)
    prefix = rng.choice(pool, size=prefix_len).tolist()
    in_lo, in_hi = length_bounds(input_len, range_ratio)
    out_lo, out_hi = length_bounds(output_len, range_ratio)
    # An empty prompt is rejected by servers; with a prefix there is always something to send.
    in_lo = max(in_lo, 0 if prefix_len else 1)
    in_hi = max(in_hi, in_lo)
    out_lo = max(out_lo, 1)
    out_hi = max(out_hi, out_lo)
    samples = []
    for _ in range(num_prompts):
        n_in = int(rng.integers(in_lo, in_hi + 1))
        n_out = int(rng.integers(out_lo, out_hi + 1))
        own = rng.choice(pool, size=n_in).tolist()
        samples.append(SampleRequest(prefix + own, n_out, prefix_len))
    return samples


class Decoder(Protocol):
    def decode(self, token_ids: list[int]) -> str: ...


def chat_text(sample: SampleRequest, tokenizer: Decoder) -> str:
    """Prompt text for the chat endpoint.

    The prefix is decoded on its own so every request starts with byte-identical text: decoding
    the whole id list could render the prefix's last bytes differently per request (a UTF-8
    character split across the boundary), which would defeat the prefix cache being measured.
    """
    prefix = sample.prompt_ids[: sample.prefix_len]
    own = sample.prompt_ids[sample.prefix_len :]
    return (tokenizer.decode(prefix) if prefix else "") + tokenizer.decode(own)


def build_payload(
    sample: SampleRequest,
    endpoint: Endpoint,
    model: str,
    *,
    ignore_eos: bool = True,
    temperature: float = 0.0,
    prompt_text: str | None = None,
    extra_body: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Request body. ``prompt_text``, when given, is sent instead of the sample's ids; chat
    needs it since chat messages cannot carry token ids."""
    payload: dict[str, Any] = {
        "model": model,
        "temperature": temperature,
        "stream": True,
        # Without the usage chunk the output length would be a guess from the chunk count.
        "stream_options": {"include_usage": True},
    }
    if endpoint == "completions":
        payload["prompt"] = prompt_text if prompt_text is not None else list(sample.prompt_ids)
        payload["max_tokens"] = sample.output_len
    else:
        if prompt_text is None:
            raise ValueError("the chat endpoint needs prompt_text")
        payload["messages"] = [{"role": "user", "content": prompt_text}]
        payload["max_completion_tokens"] = sample.output_len
    if ignore_eos:
        # Fixed output lengths make runs comparable; otherwise a random prompt may stop early.
        payload["ignore_eos"] = True
    if extra_body:
        payload.update(extra_body)
    return payload


# --------------------------------------------------------------------------------------------
# Arrival schedule
# --------------------------------------------------------------------------------------------


def arrival_times(num_requests: int, request_rate: float, seed: int = 0) -> list[float]:
    """Send time of each request in seconds from the start: a Poisson process of rate
    ``request_rate`` (exponential gaps; first request at 0), or all at 0 for an infinite rate."""
    if num_requests <= 0:
        return []
    if math.isinf(request_rate):
        return [0.0] * num_requests
    if not request_rate > 0:
        raise ValueError(f"request_rate must be > 0, got {request_rate}")
    # A stream of its own, so the schedule neither reuses the dataset's random bits nor changes
    # when the dataset draws do.
    rng = np.random.default_rng([seed, 1])
    gaps = rng.exponential(1.0 / request_rate, size=num_requests - 1)
    return [0.0, *np.cumsum(gaps).tolist()]


# --------------------------------------------------------------------------------------------
# Server-sent events
# --------------------------------------------------------------------------------------------


def parse_sse_line(line: str) -> str | None:
    """The payload of a ``data:`` line; None for blank lines, comments and other fields."""
    line = line.rstrip("\r\n")
    if not line.startswith("data:"):
        return None
    payload = line[len("data:") :]
    return payload[1:] if payload.startswith(" ") else payload


class SSELineBuffer:
    """Splits a byte stream into SSE ``data:`` payloads across arbitrary chunk boundaries.

    Each ``data:`` line is taken as one event instead of joining lines up to a blank one as the
    SSE spec does: OpenAI-style servers send one JSON object per line, and some omit the blank
    separators, which would otherwise glue events together.
    """

    def __init__(self) -> None:
        self._pending = b""

    def feed(self, chunk: bytes) -> list[str]:
        # Split bytes, not text: a chunk may end in the middle of a multi-byte UTF-8 character.
        *lines, self._pending = (self._pending + chunk).split(b"\n")
        return self._payloads(lines)

    def flush(self) -> list[str]:
        """Payload of a last line the server sent without a newline."""
        rest, self._pending = self._pending, b""
        return self._payloads([rest])

    @staticmethod
    def _payloads(lines: list[bytes]) -> list[str]:
        out = []
        for raw in lines:
            payload = parse_sse_line(raw.decode("utf-8", errors="replace"))
            if payload is not None:
                out.append(payload)
        return out


def chunk_text(choice: dict[str, Any]) -> str:
    """Generated text of one streamed choice, for either endpoint."""
    if choice.get("text"):
        return str(choice["text"])
    delta = choice.get("delta") or {}
    # Reasoning models stream thinking tokens under their own key; they are output all the same.
    return "".join(
        str(delta.get(key) or "") for key in ("reasoning_content", "reasoning", "content")
    )


# --------------------------------------------------------------------------------------------
# Per-request bookkeeping
# --------------------------------------------------------------------------------------------


@dataclass
class RequestRecord:
    """Outcome of one request; times in seconds, ``start`` from the benchmark start."""

    success: bool = False
    error: str = ""
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float | None = None
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    start: float = 0.0


@dataclass
class StreamState:
    """Folds the SSE payloads of one response, each stamped with its arrival time."""

    start: float
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    content_chunks: int = 0
    completion_tokens: int | None = None
    prompt_tokens: int | None = None
    done: bool = False
    error: str | None = None
    _last: float | None = None

    def on_data(self, data: str, now: float) -> None:
        if data.strip() == "[DONE]":
            self.done = True
            return
        try:
            obj = json.loads(data)
        except json.JSONDecodeError:
            self.error = self.error or f"unparseable SSE data: {data[:200]!r}"
            return
        if not isinstance(obj, dict):
            return
        if obj.get("error"):
            # vLLM-style servers report a mid-stream failure as an error object and may still
            # close with [DONE], so [DONE] alone does not mean success.
            self.error = self.error or f"stream error: {json.dumps(obj['error'])[:300]}"
        usage = obj.get("usage")
        if isinstance(usage, dict):
            if usage.get("completion_tokens") is not None:
                self.completion_tokens = int(usage["completion_tokens"])
            if usage.get("prompt_tokens") is not None:
                self.prompt_tokens = int(usage["prompt_tokens"])
        text = "".join(chunk_text(c) for c in obj.get("choices") or [] if isinstance(c, dict))
        if not text:
            # Role-only deltas, empty keep-alive chunks and the usage chunk carry no token the
            # user sees, so they must not start the TTFT clock or split an ITL gap.
            return
        if self.ttft is None:
            self.ttft = now - self.start
        else:
            assert self._last is not None
            self.itl.append(now - self._last)
        self._last = now
        self.content_chunks += 1

    def finish(self, end: float, prompt_len: int, bench_start: float) -> RequestRecord:
        record = RequestRecord(
            prompt_len=self.prompt_tokens if self.prompt_tokens is not None else prompt_len,
            output_tokens=(
                self.completion_tokens
                if self.completion_tokens is not None
                else self.content_chunks
            ),
            ttft=self.ttft,
            e2e=end - self.start,
            itl=self.itl,
            start=self.start - bench_start,
        )
        if self.error:
            record.error = self.error
        elif not self.done:
            record.error = "stream ended without [DONE]"
        else:
            record.success = True
        return record


# --------------------------------------------------------------------------------------------
# Aggregation and report
# --------------------------------------------------------------------------------------------


@dataclass
class BenchmarkMetrics:
    successful_requests: int
    failed_requests: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float | None
    output_throughput: float | None
    total_token_throughput: float | None
    ttft_ms: LatencyStats
    tpot_ms: LatencyStats
    itl_ms: LatencyStats
    e2e_ms: LatencyStats
    errors: dict[str, int]


def latency_stats(
    values_s: Sequence[float], percentiles: Sequence[float] = PERCENTILES
) -> LatencyStats:
    """Mean and percentiles in milliseconds; None when there is nothing to summarise, so an
    empty sample is not reported as a perfect 0 ms."""
    keys = ["mean", *(f"p{p:g}" for p in percentiles)]
    if len(values_s) == 0:
        return dict.fromkeys(keys)
    ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    stats: LatencyStats = {"mean": float(ms.mean())}
    for p in percentiles:
        stats[f"p{p:g}"] = float(np.percentile(ms, p))
    return stats


def compute_metrics(
    records: Sequence[RequestRecord],
    duration_s: float,
    percentiles: Sequence[float] = PERCENTILES,
) -> BenchmarkMetrics:
    """Aggregates per-request records; only successful requests enter tokens and latencies."""
    ok = [r for r in records if r.success]
    failed = [r for r in records if not r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    # One token has no decode phase, so it has no time per output token.
    tpots = [
        (r.e2e - r.ttft) / (r.output_tokens - 1)
        for r in ok
        if r.ttft is not None and r.output_tokens > 1
    ]
    itls = [gap for r in ok for gap in r.itl]

    def rate(x: float) -> float | None:
        return x / duration_s if duration_s > 0 else None

    return BenchmarkMetrics(
        successful_requests=len(ok),
        failed_requests=len(failed),
        duration_s=duration_s,
        total_input_tokens=total_in,
        total_output_tokens=total_out,
        request_throughput=rate(len(ok)),
        output_throughput=rate(total_out),
        total_token_throughput=rate(total_in + total_out),
        ttft_ms=latency_stats(ttfts, percentiles),
        tpot_ms=latency_stats(tpots, percentiles),
        itl_ms=latency_stats(itls, percentiles),
        e2e_ms=latency_stats([r.e2e for r in ok], percentiles),
        errors=dict(Counter(r.error for r in failed).most_common()),
    )


def _fmt(value: float | int | None, digits: int = 2) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, int):
        return str(value)
    return f"{value:.{digits}f}"


def format_report(m: BenchmarkMetrics, max_errors: int = 10) -> str:
    width = 56

    def title(text: str, fill: str) -> str:
        return f"{f' {text} ':{fill}^{width}}\n"

    def row(label: str, value: float | int | None) -> str:
        return f"{label:<{width - 14}}{_fmt(value):>14}\n"

    out = [title("Serving Benchmark Result", "=")]
    out.append(row("Successful requests:", m.successful_requests))
    out.append(row("Failed requests:", m.failed_requests))
    out.append(row("Benchmark duration (s):", m.duration_s))
    out.append(row("Total input tokens:", m.total_input_tokens))
    out.append(row("Total generated tokens:", m.total_output_tokens))
    out.append(row("Request throughput (req/s):", m.request_throughput))
    out.append(row("Output token throughput (tok/s):", m.output_throughput))
    out.append(row("Total token throughput (tok/s):", m.total_token_throughput))
    for name, long_name, stats in (
        ("TTFT", "Time to First Token", m.ttft_ms),
        ("TPOT", "Time per Output Token (excl. 1st token)", m.tpot_ms),
        ("ITL", "Inter-token Latency", m.itl_ms),
        ("E2E", "End-to-end Latency", m.e2e_ms),
    ):
        out.append(title(long_name, "-"))
        for key, value in stats.items():
            label = "Mean" if key == "mean" else key.upper()
            out.append(row(f"{label} {name} (ms):", value))
    if m.errors:
        out.append(title("Errors", "-"))
        for text, count in list(m.errors.items())[:max_errors]:
            out.append(f"{count:>6} x {text[: width * 2]}\n")
        if len(m.errors) > max_errors:
            out.append(f"       ... {len(m.errors) - max_errors} more distinct errors\n")
    out.append("=" * width + "\n")
    return "".join(out)


def _json_safe(value: Any) -> Any:
    """Strict JSON has no Infinity/NaN (an infinite request rate), so those become strings."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


def result_document(
    args: dict[str, Any],
    metrics: BenchmarkMetrics,
    records: Sequence[RequestRecord],
    *,
    detailed: bool = False,
) -> dict[str, Any]:
    per_request = []
    for r in records:
        entry = asdict(r)
        if not detailed:
            # Per-token gaps dominate the file size; the ITL summary is in the metrics.
            entry.pop("itl")
        per_request.append(entry)
    args = {k: v for k, v in args.items() if k != "api_key"}
    return _json_safe({"args": args, "metrics": asdict(metrics), "requests": per_request})


# --------------------------------------------------------------------------------------------
# HTTP
# --------------------------------------------------------------------------------------------


async def send_request(
    session: aiohttp.ClientSession,
    url: str,
    payload: dict[str, Any],
    *,
    headers: dict[str, str],
    prompt_len: int,
    bench_start: float,
) -> RequestRecord:
    """One streaming request; every failure comes back as a record with its error text."""
    state = StreamState(start=time.perf_counter())
    try:
        async with session.post(url, json=payload, headers=headers) as resp:
            if resp.status != 200:
                body = (await resp.text(errors="replace")).strip()
                end = time.perf_counter()
                record = state.finish(end, prompt_len, bench_start)
                record.success, record.error = False, f"HTTP {resp.status}: {body[:300]}"
                return record
            lines = SSELineBuffer()
            async for chunk in resp.content.iter_any():
                # One timestamp per network read: events that arrive together arrived together.
                now = time.perf_counter()
                for data in lines.feed(chunk):
                    state.on_data(data, now)
            for data in lines.flush():
                state.on_data(data, time.perf_counter())
    except Exception as exc:
        # A benchmark must survive one bad request and count it, whatever went wrong.
        record = state.finish(time.perf_counter(), prompt_len, bench_start)
        record.success, record.error = False, f"{type(exc).__name__}: {exc}".rstrip(": ")
        return record
    return state.finish(time.perf_counter(), prompt_len, bench_start)


async def benchmark(
    url: str,
    payloads: Sequence[dict[str, Any]],
    prompt_lens: Sequence[int],
    *,
    headers: dict[str, str] | None = None,
    request_rate: float = math.inf,
    max_concurrency: int | None = None,
    warmup_payloads: Sequence[dict[str, Any]] = (),
    seed: int = 0,
    timeout_s: float = 6 * 3600,
) -> tuple[list[RequestRecord], list[RequestRecord], float]:
    """Runs the warmup, then the measured requests on the Poisson schedule.

    Returns (measured records, warmup records, measured duration in seconds).
    """
    headers = headers or {}
    semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async def limited(payload: dict[str, Any], prompt_len: int, t0: float) -> RequestRecord:
        if semaphore is None:
            return await send_request(
                session, url, payload, headers=headers, prompt_len=prompt_len, bench_start=t0
            )
        # Arrivals follow the schedule; the cap makes late ones queue here like clients would.
        async with semaphore:
            return await send_request(
                session, url, payload, headers=headers, prompt_len=prompt_len, bench_start=t0
            )

    # aiohttp's default connector allows 100 connections, which would cap concurrency silently.
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        warmup: list[RequestRecord] = []
        if warmup_payloads:
            logger.info("warming up with %d requests", len(warmup_payloads))
            t0 = time.perf_counter()
            warmup = list(await asyncio.gather(*(limited(p, 0, t0) for p in warmup_payloads)))
            failed = [r for r in warmup if not r.success]
            if failed:
                logger.warning(
                    "%d/%d warmup requests failed, first: %s",
                    len(failed),
                    len(warmup),
                    failed[0].error,
                )

        schedule = arrival_times(len(payloads), request_rate, seed)
        total, done = len(payloads), 0
        step = max(1, total // 10)

        def progress(_: asyncio.Task[RequestRecord]) -> None:
            nonlocal done
            done += 1
            if done % step == 0 or done == total:
                logger.info("%d/%d requests done", done, total)

        logger.info(
            "sending %d requests, rate %s req/s, max concurrency %s",
            total,
            request_rate,
            max_concurrency or "unlimited",
        )
        tasks = []
        t0 = time.perf_counter()
        for send_at, payload, prompt_len in zip(schedule, payloads, prompt_lens, strict=True):
            # Sleep to an absolute target so scheduling overhead does not accumulate as drift.
            delay = t0 + send_at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(limited(payload, prompt_len, t0))
            task.add_done_callback(progress)
            tasks.append(task)
        records = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - t0
    return records, warmup, duration


# --------------------------------------------------------------------------------------------
# Closed-loop users
# --------------------------------------------------------------------------------------------

# A user whose request failed waits this long before its next one, so that a dead server is not
# hit in a tight loop for the whole duration.
FAILURE_PAUSE_S = 0.5


def in_window(records: Sequence[RequestRecord], duration_s: float) -> list[RequestRecord]:
    """The requests that started at or after the window opened (``start`` 0) and finished by
    the time it closed: one cut by either edge ran under a load that was ramping or draining."""
    return [r for r in records if r.start >= 0 and r.start + r.e2e <= duration_s]


async def closed_loop(
    url: str,
    payloads: Sequence[dict[str, Any]],
    prompt_lens: Sequence[int],
    *,
    users: int,
    duration_s: float,
    warmup_s: float = 0.0,
    headers: dict[str, str] | None = None,
    timeout_s: float = 6 * 3600,
) -> list[RequestRecord]:
    """``users`` clients, each sending its next request as soon as its previous one ended, until
    ``warmup_s + duration_s`` seconds have passed; requests take the payloads in turn, cycling.

    Users join evenly spread over the warm-up: with equal requests, users that all started
    together would stay in lockstep, every prefill landing in the same step. Returns the record
    of every request, ``start`` counted from the end of the warm-up (see :func:`in_window`).
    """
    headers = headers or {}
    records: list[RequestRecord] = []
    turn = itertools.count()
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        t0 = time.perf_counter()
        window_start = t0 + warmup_s
        end = window_start + duration_s

        async def user(u: int) -> None:
            await asyncio.sleep(u * warmup_s / users)
            while time.perf_counter() < end:
                k = next(turn) % len(payloads)
                record = await send_request(
                    session,
                    url,
                    payloads[k],
                    headers=headers,
                    prompt_len=prompt_lens[k],
                    bench_start=window_start,
                )
                records.append(record)
                if not record.success:
                    await asyncio.sleep(FAILURE_PAUSE_S)

        logger.info(
            "%d users for %.0f s of warm-up and %.0f s measured", users, warmup_s, duration_s
        )
        await asyncio.gather(*(user(u) for u in range(users)))
    return records


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Online-serving benchmark for an OpenAI-compatible server.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", required=True, help="model name sent in each request")
    p.add_argument(
        "--spread-models",
        nargs="+",
        default=None,
        metavar="NAME",
        help="model names the requests take in turn instead of --model (LoRA adapters of it)",
    )
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer path: vocabulary for random ids, and text for --endpoint chat "
        "(default: --model when it is a local directory)",
    )
    p.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="sample ids from [0, vocab-size) (default: the tokenizer's size)",
    )
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--input-len", type=int, default=1024, help="own tokens per prompt")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument(
        "--range-ratio",
        type=float,
        default=0.0,
        help="lengths uniform in [len*(1-R), len*(1+R)]",
    )
    p.add_argument(
        "--prefix-len",
        type=int,
        default=0,
        help="random tokens shared by every prompt, before its own --input-len",
    )
    p.add_argument(
        "--prompt",
        default=None,
        help="send this text as every prompt instead of random ids (chat: the user message); "
        "--output-len tokens each",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="Poisson arrival rate in req/s; inf sends all at once",
    )
    p.add_argument("--max-concurrency", type=int, default=None, help="cap on in-flight requests")
    p.add_argument(
        "--warmup", type=int, default=0, help="requests sent first, excluded from results"
    )
    p.add_argument(
        "--users",
        type=int,
        default=None,
        help="closed loop instead of an arrival rate: this many users, each sending its next "
        "request when its previous one finished; requests cycle through the --num-prompts",
    )
    p.add_argument(
        "--duration", type=float, default=None, help="--users: seconds measured, after warm-up"
    )
    p.add_argument(
        "--warmup-duration",
        type=float,
        default=0.0,
        help="--users: seconds before the measured window, over which the users join",
    )
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument(
        "--no-ignore-eos",
        dest="ignore_eos",
        action="store_false",
        help="omit ignore_eos for servers that reject it (outputs may then end early)",
    )
    p.add_argument(
        "--extra-body", type=json.loads, default=None, help="JSON merged into each request"
    )
    p.add_argument("--timeout", type=float, default=6 * 3600, help="per-request seconds")
    p.add_argument("--result-json", type=Path, default=None)
    p.add_argument(
        "--save-detailed", action="store_true", help="include per-token ITL in --result-json"
    )
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)

    if args.num_prompts < 1:
        p.error("--num-prompts must be >= 1")
    if args.output_len < 1 or args.input_len < 0 or args.prefix_len < 0:
        p.error("need --output-len >= 1, --input-len >= 0, --prefix-len >= 0")
    if args.input_len + args.prefix_len < 1:
        p.error("prompts would be empty: raise --input-len or --prefix-len")
    if not 0.0 <= args.range_ratio < 1.0:
        p.error("--range-ratio must be in [0, 1)")
    if not args.request_rate > 0:
        p.error("--request-rate must be > 0 (inf for all at once)")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        p.error("--max-concurrency must be >= 1")
    if args.warmup < 0:
        p.error("--warmup must be >= 0")
    if args.extra_body is not None and not isinstance(args.extra_body, dict):
        p.error("--extra-body must be a JSON object")
    if args.users is not None:
        if args.users < 1:
            p.error("--users must be >= 1")
        if args.duration is None or not args.duration > 0:
            p.error("--users needs --duration > 0")
        if args.warmup_duration < 0:
            p.error("--warmup-duration must be >= 0")
        if not math.isinf(args.request_rate) or args.max_concurrency or args.warmup:
            p.error("--users sets the load: drop --request-rate, --max-concurrency, --warmup")
    elif args.duration is not None or args.warmup_duration:
        p.error("--duration and --warmup-duration need --users")
    if args.prompt is not None:
        if not args.prompt:
            p.error("--prompt must not be empty")
        if args.prefix_len or args.range_ratio:
            p.error("--prefix-len and --range-ratio shape random prompts, not --prompt")
        return args
    if args.tokenizer is None and Path(args.model).is_dir():
        args.tokenizer = args.model
    if args.endpoint == "chat" and args.tokenizer is None:
        p.error("--endpoint chat needs --tokenizer to turn random ids into text")
    if args.tokenizer is None and args.vocab_size is None:
        p.error("random ids need a vocabulary: pass --vocab-size or --tokenizer")
    return args


def _load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer  # only here: importing transformers takes seconds

    return AutoTokenizer.from_pretrained(path)


def _samples_and_texts(args: argparse.Namespace) -> tuple[list[SampleRequest], list[str | None]]:
    """The requests to send (measured ones first, then the warmup) and the text each sends in
    place of its ids, if any."""
    count = args.num_prompts + args.warmup
    if args.prompt is not None:
        # No ids: the prompt's length comes back in the server's usage.
        return [SampleRequest([], args.output_len)] * count, [args.prompt] * count
    tokenizer = _load_tokenizer(args.tokenizer) if args.tokenizer else None
    excluded: list[int] = []
    if tokenizer is not None:
        excluded = sorted(set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder))
    vocab_size = args.vocab_size if args.vocab_size is not None else len(tokenizer)
    pool = token_pool(vocab_size, excluded)

    samples = generate_random_dataset(
        count,
        args.input_len,
        args.output_len,
        pool=pool,
        range_ratio=args.range_ratio,
        prefix_len=args.prefix_len,
        seed=args.seed,
    )
    if args.endpoint == "chat":
        return samples, [chat_text(s, tokenizer) for s in samples]
    return samples, [None] * count


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )

    samples, texts = _samples_and_texts(args)
    models = args.spread_models or [args.model]
    payloads = [
        build_payload(
            s,
            args.endpoint,
            models[i % len(models)],
            ignore_eos=args.ignore_eos,
            temperature=args.temperature,
            prompt_text=text,
            extra_body=args.extra_body,
        )
        for i, (s, text) in enumerate(zip(samples, texts, strict=True))
    ]
    n = args.num_prompts
    prompt_lens = [s.prompt_len for s in samples[:n]]
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    url = args.base_url.rstrip("/") + ENDPOINT_PATHS[args.endpoint]

    sent: int | None = None
    if args.users is not None:
        every = asyncio.run(
            closed_loop(
                url,
                payloads[:n],
                prompt_lens,
                users=args.users,
                duration_s=args.duration,
                warmup_s=args.warmup_duration,
                headers=headers,
                timeout_s=args.timeout,
            )
        )
        records, duration, sent = in_window(every, args.duration), args.duration, len(every)
        logger.info("%d requests sent, %d inside the measured window", sent, len(records))
    else:
        records, _, duration = asyncio.run(
            benchmark(
                url,
                payloads[:n],
                prompt_lens,
                headers=headers,
                request_rate=args.request_rate,
                max_concurrency=args.max_concurrency,
                warmup_payloads=payloads[n:],
                seed=args.seed,
                timeout_s=args.timeout,
            )
        )
    metrics = compute_metrics(records, duration)
    sys.stdout.write(format_report(metrics))
    sys.stdout.flush()

    if args.result_json is not None:
        doc = result_document(vars(args), metrics, records, detailed=args.save_detailed)
        doc["args"]["url"] = url
        if sent is not None:
            doc["requests_sent"] = sent
        args.result_json.parent.mkdir(parents=True, exist_ok=True)
        args.result_json.write_text(json.dumps(doc, indent=2, allow_nan=False, default=str))
        logger.info("wrote %s", args.result_json)
    # Nonzero only when nothing worked: partial failures are results, a dead server is not.
    return 0 if metrics.successful_requests else 1


if __name__ == "__main__":
    sys.exit(main())
