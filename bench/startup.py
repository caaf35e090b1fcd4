"""An engine's start, phase by phase: `kvfleet-engine serve` started --runs times in a row with
one compile cache folder (--fresh empties it first, so the first start is cold and the later
ones warm). Each start is timed from the process's launch to /ready answering 200, its phases
are read from kvfleet_engine_startup_seconds, and one streamed request right after ready gives
the first request's time to first token and time per output token (graphs still being captured
between steps); after --settle seconds idle (the rest of the graphs captured), a second request
gives the steady TPOT.

    python bench/dummy_tokenizer.py bench/models/Llama-3.1-8B /tmp/llama8b
    python bench/startup.py --model /tmp/llama8b --runs 3 --fresh \\
        --cache-dir /tmp/kvfleet-compile --result-json startup.json -- --load-format dummy \\
        --dtype bfloat16 --max-model-len 8192

Arguments after `--` go to `serve` as they are. `--importtime` adds one more start, run with
Python's import profiler (`-X importtime`, which slows imports and so is not one of the timed
starts): its heaviest imports, each with its own heaviest imports, are printed and kept in the
result; they say which packages a phase's imports (transformers' in "config") bring in.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import shutil
import sys
import time
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import device_name, free_port, git_commit, start_engine, stop, wait_ready
from prometheus_client.parser import text_string_to_metric_families

from kvfleet.engine.startup_timing import PHASES
from kvfleet.telemetry import metric_names

logger = logging.getLogger("bench.startup")

SERVED = "startup-bench"
# The prompt of each timed request, as token ids (ids 3.. skip the special tokens).
PROMPT = list(range(3, 3 + 64))


def phases(url: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name == metric_names.STARTUP_SECONDS:
            for s in family.samples:
                found[s.labels[metric_names.STARTUP_PHASE]] = s.value
    return found


def streamed(url: str, max_tokens: int) -> dict[str, float]:
    """One streamed completion of max_tokens tokens: seconds to the first token, and the mean
    seconds per output token after it."""
    body = {"model": SERVED, "prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0, "stream": True}  # fmt: skip
    req = urllib.request.Request(
        f"{url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    started = time.perf_counter()
    times: list[float] = []
    with urllib.request.urlopen(req, timeout=300) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            if chunk.get("choices") and chunk["choices"][0].get("text") is not None:
                times.append(time.perf_counter())
    if len(times) < 2:
        raise RuntimeError(f"the stream brought {len(times)} tokens, not {max_tokens}")
    return {
        "ttft_s": times[0] - started,
        "tpot_ms": 1000 * (times[-1] - times[0]) / (len(times) - 1),
    }


@dataclass
class Import:
    """One line of `-X importtime`: a module and the imports it made, in microseconds."""

    name: str
    self_us: int
    cumulative_us: int
    children: list[Import] = field(default_factory=list)


_IMPORT_LINE = re.compile(r"^import time:\s+(\d+) \|\s+(\d+) \|( +)(\S+)\s*$")


def import_tree(lines: Iterable[str]) -> list[Import]:
    """The outermost imports of `-X importtime` output, with their children; other lines are
    skipped. Python writes an import's line after those of the imports it made, each level
    two spaces deeper."""
    pending: dict[int, list[Import]] = {}
    top: list[Import] = []
    for line in lines:
        found = _IMPORT_LINE.match(line)
        if found is None:
            continue
        self_us, cumulative_us, indent, name = found.groups()
        depth = (len(indent) - 1) // 2
        node = Import(name, int(self_us), int(cumulative_us), pending.pop(depth + 1, []))
        (top if depth == 0 else pending.setdefault(depth, [])).append(node)
    return top


def heaviest_imports(lines: Iterable[str], count: int = 15, children: int = 3) -> list[str]:
    """The `count` outermost imports that took longest, each with its `children` heaviest
    imports, one line each."""
    out = []
    for node in sorted(import_tree(lines), key=lambda n: -n.cumulative_us)[:count]:
        inner = sorted(node.children, key=lambda n: -n.cumulative_us)[:children]
        within = ", ".join(f"{c.name} {c.cumulative_us / 1e6:.2f}s" for c in inner)
        out.append(
            f"{node.cumulative_us / 1e6:6.2f}s {node.name}" + (f" ({within})" if within else "")
        )
    return out


def profiled_start(args: argparse.Namespace, out_dir: Path) -> list[str]:
    """One more start under `-X importtime` (PYTHONPROFILEIMPORTTIME, which the grammar
    sandbox's workers inherit too); its heaviest imports."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = out_dir / "startup_server_importtime.log"
    log.unlink(missing_ok=True)
    extra = [*args.serve_args, "--compile-cache-dir", str(args.cache_dir)]
    env = {"PYTHONPROFILEIMPORTTIME": "1"}
    proc = start_engine(args.model, port, log, *extra, served_name=SERVED, env=env)
    try:
        wait_ready([url], "/ready", timeout_s=args.ready_timeout, procs=[proc])
    finally:
        stop([proc])
    with log.open(errors="replace") as f:
        return heaviest_imports(f)


def one_start(args: argparse.Namespace, run: int, out_dir: Path) -> dict[str, Any]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = out_dir / f"startup_server_{run}.log"
    extra = [*args.serve_args, "--compile-cache-dir", str(args.cache_dir)]
    launched = time.perf_counter()
    proc = start_engine(args.model, port, log, *extra, served_name=SERVED)
    try:
        wait_ready([url], "/ready", timeout_s=args.ready_timeout, procs=[proc])
        ready = time.perf_counter() - launched
        first = streamed(url, args.max_tokens)
        at_ready = phases(url)
        time.sleep(args.settle)
        steady = streamed(url, args.max_tokens)
        settled = phases(url)
    finally:
        stop([proc])
    return {
        "run": run,
        "ready_s": ready,
        "phases": at_ready,
        "graph_capture_after_ready_s": settled.get("graph_capture_after_ready", 0.0),
        "first_request": first,
        "settled_request": steady,
        "log": str(log),
    }


def table(results: list[dict[str, Any]]) -> str:
    shown = [p for p in PHASES if p != "graph_capture_after_ready"]
    head = ["run", "ready", *shown, "after_ready", "1st ttft", "1st tpot", "tpot"]
    rows = [" | ".join(head), " | ".join("---" for _ in head)]
    for r in results:
        cells = [str(r["run"]), f"{r['ready_s']:.2f}"]
        cells += [f"{r['phases'].get(p, 0.0):.2f}" for p in shown]
        cells += [
            f"{r['graph_capture_after_ready_s']:.2f}",
            f"{r['first_request']['ttft_s'] * 1000:.0f} ms",
            f"{r['first_request']['tpot_ms']:.2f} ms",
            f"{r['settled_request']['tpot_ms']:.2f} ms",
        ]
        rows.append(" | ".join(cells))
    return "\n".join(f"| {row} |" for row in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a model folder with a tokenizer")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--cache-dir", type=Path, required=True, help="--compile-cache-dir")
    parser.add_argument("--fresh", action="store_true", help="empty --cache-dir first")
    parser.add_argument("--settle", type=float, default=30.0, help="idle seconds after ready")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--ready-timeout", type=float, default=300.0)
    parser.add_argument("--out-dir", type=Path, default=Path("."))
    parser.add_argument("--result-json", type=Path)
    parser.add_argument(
        "--importtime", action="store_true", help="one more start, profiling its imports"
    )
    parser.add_argument("serve_args", nargs="*", help="after --: serve's own flags")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.fresh:
        shutil.rmtree(args.cache_dir, ignore_errors=True)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    results = []
    for run in range(1, args.runs + 1):
        results.append(one_start(args, run, args.out_dir))
        logger.info("start %d: ready in %.2f s", run, results[-1]["ready_s"])
    print(table(results))
    imports = profiled_start(args, args.out_dir) if args.importtime else []
    if imports:
        print("heaviest imports of a start under -X importtime (seconds as profiled):")
        print("\n".join(imports))
    if args.result_json:
        meta = {"device": device_name(), "commit": git_commit(), "model": args.model,
                "serve_args": args.serve_args, "fresh": args.fresh}  # fmt: skip
        found = {"meta": meta, "results": results, "heaviest_imports": imports}
        args.result_json.write_text(json.dumps(found, indent=2))


if __name__ == "__main__":
    main()
