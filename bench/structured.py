"""What structured outputs cost (issue 22): closed-loop chat users against a running
OpenAI-compatible server, the same prompts and output length in three modes, one after another:

- ``unconstrained``: no constraint, ``ignore_eos`` so that every answer is max_tokens long;
- ``cached_schema``: every request under one JSON schema, compiled once in the warm-up;
- ``new_schema``: every request under a schema the server has never seen (its compile included).

A grammar ends an answer when the JSON is complete, and ignore_eos cannot override that, so the
schema asks for at least ``--items`` records: far more than max_tokens can hold, every
constrained answer runs to max_tokens too, and TPOT compares like with like. The constraint is
vLLM's ``structured_outputs`` JSON with ``disable_any_whitespace``: under JSON's free whitespace a
model of random weights (and a small real one, greedy) writes newlines for ever, whose masks are
not the ones an answer needs. Each prompt starts with its own tag, so no mode gets prefix-cache
hits that another did not. Before measuring, one small answer is checked to be the JSON asked
for: a server that ignored the constraint would otherwise look free. Reports TPOT and TTFT
p50/p90 per mode and their ratios against issue 22's goals; against a kvfleet server, also where
each mode's mean TTFT goes (the engine's queue and prefill histograms, and the rest outside the
engine)::

    python bench/structured.py --base-url http://127.0.0.1:8000 --model NAME --users 32 \\
        --max-tokens 256 --warmup-duration 10 --duration 60 --result-json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import urllib.request
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any, overload

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parent))

from serve import (
    BenchmarkMetrics,
    RequestRecord,
    SampleRequest,
    build_payload,
    closed_loop,
    compute_metrics,
    in_window,
)

logger = logging.getLogger("kvfleet.bench.structured")

MODES = ("unconstrained", "cached_schema", "new_schema")
CHAT_PATH = "/v1/chat/completions"
PROMPT = (
    "Extract every record from the inventory below as JSON: id, label, tags, score and whether "
    "it is active. Inventory: bolts, nuts, washers, brackets, hinges, rivets, springs, gears."
)
# Issue 22's goals: constrained TPOT and new-schema TTFT against the unconstrained workload's.
TPOT_GOAL = 1.05
TTFT_NEW_GOAL = 1.2


def records_schema(tag: str, items: int, max_items: int | None = None) -> dict[str, Any]:
    """A typical extraction schema: an array of records of a few typed fields (integer, bounded
    string, enum array, number, boolean). ``tag`` goes into a property name and the enum, so each
    tag is a grammar of its own and of the same size."""
    record = {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 1000000},
            f"label_{tag}": {"type": "string", "maxLength": 24},
            "tags": {
                "type": "array",
                "items": {"enum": [f"{tag}-{k}" for k in ("red", "green", "blue", "spare")]},
                "maxItems": 3,
            },
            "score": {"type": "number", "minimum": 0, "maximum": 1},
            "active": {"type": "boolean"},
        },
        "required": ["id", f"label_{tag}", "tags", "score", "active"],
        "additionalProperties": False,
    }
    array: dict[str, Any] = {"type": "array", "items": record, "minItems": items}
    if max_items is not None:
        array["maxItems"] = max_items
    return {
        "type": "object",
        "properties": {"records": array},
        "required": ["records"],
        "additionalProperties": False,
    }


def constraint(schema: dict[str, Any]) -> dict[str, Any]:
    """The request field that puts ``schema`` on the answer, compact JSON."""
    return {"structured_outputs": {"json": schema, "disable_any_whitespace": True}}


class Requests(Sequence[dict[str, Any]]):
    """Request ``k`` of a mode, built when asked for: the new-schema mode needs a schema per
    request and cannot know beforehand how many requests the users will send."""

    def __init__(self, mode: str, model: str, max_tokens: int, items: int, round_: int = 0) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; choose from {', '.join(MODES)}")
        self.mode, self.model, self.max_tokens, self.items = mode, model, max_tokens, items
        # In the tags of prompts and new schemas: a later round meets nothing cached.
        self.round = round_
        self._cached = constraint(records_schema("cached", items))

    def __len__(self) -> int:
        # closed_loop takes request k % len: no request comes back round.
        return sys.maxsize

    @overload
    def __getitem__(self, k: int) -> dict[str, Any]: ...
    @overload
    def __getitem__(self, k: slice) -> Sequence[dict[str, Any]]: ...
    def __getitem__(self, k: int | slice) -> Any:
        if isinstance(k, slice):
            raise TypeError("requests are built one at a time")
        extra = None
        if self.mode == "cached_schema":
            extra = self._cached
        elif self.mode == "new_schema":
            extra = constraint(records_schema(f"r{self.round}n{k}", self.items))
        return build_payload(
            SampleRequest([], self.max_tokens),
            "chat",
            self.model,
            ignore_eos=self.mode == "unconstrained",
            prompt_text=f"[{self.mode} {self.round}.{k}] {PROMPT}",
            extra_body=extra,
        )


class _Zeros(Sequence[int]):
    """Prompt lengths for closed_loop: the usage chunk reports the real ones."""

    def __len__(self) -> int:
        return sys.maxsize

    def __getitem__(self, k: Any) -> Any:
        return 0


async def check_schema_followed(
    url: str, model: str, headers: dict[str, str], timeout_s: float
) -> None:
    """One answer under a one-record schema must be that JSON: random weights never write it
    by chance, so this proves the server applies the constraint."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_completion_tokens": 512,
        "temperature": 0,
        **constraint(records_schema("check", 1, 1)),
    }
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with (
        aiohttp.ClientSession(timeout=timeout) as session,
        session.post(url, json=body, headers=headers) as resp,
    ):
        text = await resp.text()
        if resp.status != 200:
            raise RuntimeError(f"a constrained request failed: HTTP {resp.status}: {text[:300]}")
    choice = json.loads(text)["choices"][0]
    content = choice["message"]["content"]
    try:
        records = json.loads(content)["records"]
        if len(records) != 1 or "label_check" not in records[0]:
            raise ValueError("not the schema's shape")
    except (ValueError, KeyError, TypeError) as e:
        raise RuntimeError(
            f"the server did not follow the schema ({e}; finish_reason "
            f"{choice['finish_reason']}): {content[:300]!r}"
        ) from None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def goals(metrics: dict[str, BenchmarkMetrics]) -> dict[str, float | None]:
    """Each constrained mode's p50 and p90 TPOT and TTFT over the unconstrained mode's."""
    base = metrics.get("unconstrained")
    out: dict[str, float | None] = {}
    if base is None:
        return out
    for mode in ("cached_schema", "new_schema"):
        if mode not in metrics:
            continue
        for stat in ("tpot", "ttft"):
            for p in ("p50", "p90"):
                own = getattr(metrics[mode], f"{stat}_ms")[p]
                out[f"{mode}_{stat}_{p}_ratio"] = ratio(own, getattr(base, f"{stat}_ms")[p])
    return out


def format_report(
    metrics: dict[str, BenchmarkMetrics], short: dict[str, int], max_tokens: int
) -> str:
    def fmt(x: float | None, digits: int = 1) -> str:
        return "n/a" if x is None else f"{x:.{digits}f}"

    lines = [
        "| mode | requests | failed | short | output tok/s | TPOT p50 | TPOT p90 | TTFT p50 | "
        "TTFT p90 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for mode, m in metrics.items():
        lines.append(
            f"| {mode} | {m.successful_requests} | {m.failed_requests} | {short[mode]} | "
            f"{fmt(m.output_throughput, 0)} | {fmt(m.tpot_ms['p50'], 2)} | "
            f"{fmt(m.tpot_ms['p90'], 2)} | {fmt(m.ttft_ms['p50'])} | {fmt(m.ttft_ms['p90'])} |"
        )
    lines.append(f"(ms; short: answers under {max_tokens} tokens, which end TPOT's like-for-like)")
    r = goals(metrics)
    checks = [
        ("cached_schema_tpot_p50_ratio", TPOT_GOAL, "TPOT cached schema / unconstrained"),
        ("new_schema_tpot_p50_ratio", TPOT_GOAL, "TPOT new schema / unconstrained"),
        ("new_schema_ttft_p50_ratio", TTFT_NEW_GOAL, "TTFT new schema / unconstrained"),
        ("cached_schema_ttft_p50_ratio", None, "TTFT cached schema / unconstrained"),
    ]
    for key, goal, label in checks:
        if key not in r:
            continue
        line = f"{label}, p50: {fmt(r[key], 3)}"
        if goal is not None and r[key] is not None:
            line += f" (goal <= {goal}: {'met' if r[key] <= goal else 'MISSED'})"
        lines.append(line)
    cached, base = metrics.get("cached_schema"), metrics.get("unconstrained")
    if cached and base and cached.ttft_ms["p50"] is not None and base.ttft_ms["p50"] is not None:
        added = cached.ttft_ms["p50"] - base.ttft_ms["p50"]
        lines.append(f"TTFT a cached schema adds, p50: {added:+.1f} ms (goal: nothing measurable)")
    return "\n".join(lines) + "\n"


# The engine's own latency histograms (engine/metrics.py): their means over a mode's turns split
# the TTFT the client sees into the wait to be scheduled, the prefill up to the first token,
# and the rest, outside the engine (HTTP, tokenization, compile, the delivery of the token).
ENGINE_PHASES = {
    "engine_ttft": "vllm:time_to_first_token_seconds",
    "queue": "vllm:request_queue_time_seconds",
    "prefill": "vllm:request_prefill_time_seconds",
}


def scrape_phases(base_url: str, headers: dict[str, str]) -> dict[str, tuple[float, float]]:
    """(sum of seconds, count) of each ENGINE_PHASES histogram, over its label sets; empty when
    the server has no such /metrics (another server, an old kvfleet)."""
    request = urllib.request.Request(base_url.rstrip("/") + "/metrics", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            text = resp.read().decode()
    except (OSError, ValueError):
        return {}
    wanted = {name: phase for phase, name in ENGINE_PHASES.items()}
    totals: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):
        phase = wanted.get(family.name)
        if phase is None:
            continue
        acc = totals.setdefault(phase, [0.0, 0.0])
        for sample in family.samples:
            if sample.name.endswith("_sum"):
                acc[0] += sample.value
            elif sample.name.endswith("_count"):
                acc[1] += sample.value
    return {phase: (acc[0], acc[1]) for phase, acc in totals.items()}


def phase_means(
    before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]
) -> dict[str, tuple[float, float]]:
    """(seconds, requests) each phase added between two scrapes."""
    return {
        phase: (after[phase][0] - before[phase][0], after[phase][1] - before[phase][1])
        for phase in after
        if phase in before
    }


def format_phases(
    phases: dict[str, dict[str, tuple[float, float]]], client: dict[str, tuple[float, float]]
) -> str:
    """Mean ms per request of each mode's engine phases next to the client's mean TTFT over the
    same turns (warm-up included, as the scrapes bracket it)."""
    if not any(phases.values()):
        return ""

    def mean(pair: tuple[float, float] | None) -> float | None:
        return pair[0] / pair[1] * 1e3 if pair and pair[1] else None

    def fmt(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.2f}"

    lines = [
        "| mode | client TTFT | engine TTFT | queue | prefill | outside the engine |",
        "|---|---|---|---|---|---|",
    ]
    for mode, own in phases.items():
        c, e = mean(client.get(mode)), mean(own.get("engine_ttft"))
        outside = c - e if c is not None and e is not None else None
        lines.append(
            f"| {mode} | {fmt(c)} | {fmt(e)} | {fmt(mean(own.get('queue')))} | "
            f"{fmt(mean(own.get('prefill')))} | {fmt(outside)} |"
        )
    lines.append("(mean ms per request over every turn, warm-up included)")
    return "\n".join(lines) + "\n"


async def run_mode(
    mode: str, round_: int, args: argparse.Namespace, url: str, headers: dict[str, str]
) -> tuple[list[RequestRecord], list[RequestRecord]]:
    """(the records of the measured window, every record) of one mode's turn."""
    every = await closed_loop(
        url,
        Requests(mode, args.model, args.max_tokens, args.items, round_),
        _Zeros(),
        users=args.users,
        duration_s=args.duration,
        warmup_s=args.warmup_duration,
        headers=headers,
        timeout_s=args.timeout,
    )
    window = in_window(every, args.duration)
    logger.info("%s: %d requests sent, %d in the window", mode, len(every), len(window))
    return window, every


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Structured outputs' cost: TPOT and TTFT under JSON schemas.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", required=True, help="model name sent in each request")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--users", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=256, help="every answer's length")
    p.add_argument(
        "--items",
        type=int,
        default=64,
        help="records the schema asks for: more than max-tokens hold",
    )
    p.add_argument("--warmup-duration", type=float, default=10.0, help="seconds per mode")
    p.add_argument(
        "--duration", type=float, default=60.0, help="measured seconds per mode and round"
    )
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated, run in this order")
    p.add_argument("--rounds", type=int, default=1, help="turns of every mode, interleaved")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request seconds")
    p.add_argument("--result-json", type=Path, default=None)
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for mode in args.modes:
        if mode not in MODES:
            p.error(f"unknown mode {mode!r}; choose from {', '.join(MODES)}")
    if len(set(args.modes)) != len(args.modes):
        p.error("--modes names a mode twice: use --rounds to repeat them")
    for name in ("users", "max_tokens", "items", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.duration <= 0 or args.warmup_duration < 0:
        p.error("--duration must be positive and --warmup-duration not negative")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    url = args.base_url.rstrip("/") + CHAT_PATH
    if any(m != "unconstrained" for m in args.modes):
        asyncio.run(check_schema_followed(url, args.model, headers, args.timeout))
    records: dict[str, list[RequestRecord]] = {m: [] for m in args.modes}
    sent = dict.fromkeys(args.modes, 0)
    phases: dict[str, dict[str, tuple[float, float]]] = {m: {} for m in args.modes}
    client: dict[str, tuple[float, float]] = dict.fromkeys(args.modes, (0.0, 0.0))
    # Modes take turns, round after round: a drift in the machine's speed (another job, clocks)
    # then falls on every mode alike instead of on whichever ran at the time.
    for round_ in range(args.rounds):
        for mode in args.modes:
            before = scrape_phases(args.base_url, headers)
            window, every = asyncio.run(run_mode(mode, round_, args, url, headers))
            added = phase_means(before, scrape_phases(args.base_url, headers))
            for phase, (secs, n) in added.items():
                prev = phases[mode].get(phase, (0.0, 0.0))
                phases[mode][phase] = (prev[0] + secs, prev[1] + n)
            ttfts = [r.ttft for r in every if r.success and r.ttft is not None]
            client[mode] = (client[mode][0] + sum(ttfts), client[mode][1] + len(ttfts))
            records[mode] += window
            sent[mode] += len(every)
    metrics = {m: compute_metrics(records[m], args.duration * args.rounds) for m in args.modes}
    short = {
        m: sum(1 for r in records[m] if r.success and r.output_tokens < args.max_tokens)
        for m in args.modes
    }
    sys.stdout.write(format_report(metrics, short, args.max_tokens))
    sys.stdout.write(format_phases(phases, client))
    sys.stdout.flush()
    if args.result_json is not None:
        doc = {
            "args": {k: v for k, v in vars(args).items() if k != "api_key"},
            "modes": {m: {**asdict(metrics[m]), "short": short[m], "sent": sent[m]}
                      for m in metrics},
            "ratios": goals(metrics),
            "engine_phases": phases,
            "client_ttft": client,
        }  # fmt: skip
        args.result_json.parent.mkdir(parents=True, exist_ok=True)
        args.result_json.write_text(json.dumps(doc, indent=2, default=str))
        logger.info("wrote %s", args.result_json)
    return 0 if all(m.successful_requests for m in metrics.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
