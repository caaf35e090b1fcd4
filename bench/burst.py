"""Burst: N simultaneous streaming /v1/completions requests at the kvfleet server, then at the
naive baseline (``bench/hf_server.py``: HF ``generate``, one request at a time), each after one
warm-up request; requests/s and latency. Every response must carry exactly ``--max-tokens``
completion tokens (its usage), or the run fails. The defaults are issue 9's second workload::

    python bench/dummy_tokenizer.py bench/models/gpt2-large /tmp/gpt2-large
    python bench/burst.py --model /tmp/gpt2-large --dtype bfloat16 --result-json burst.json

Both servers are started here on ``--model``'s config with random weights, one after the other
(the engine takes most of the GPU's memory), unless ``--base-url`` / ``--baseline-url`` point at
running ones. Their logs go to ``--log-dir``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import shlex
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    TABLE_HEADER,
    Proc,
    Result,
    free_port,
    python_cmd,
    start_engine,
    start_process,
    stop,
    wait_ready,
    write_results,
)
from serve import SampleRequest, benchmark, build_payload, compute_metrics

logger = logging.getLogger("bench.burst")

PROMPT = "Tell me about efficient GPU utilization"


def burst(args: argparse.Namespace, name: str, base_url: str) -> tuple[Result, list[str]]:
    """One warm-up request, then ``--num-requests`` at once; the result and what went wrong."""
    payload = build_payload(
        SampleRequest([], args.max_tokens),
        "completions",
        args.served_model_name,
        prompt_text=args.prompt,
    )
    n = args.num_requests
    records, warmup, seconds = asyncio.run(
        benchmark(f"{base_url}/v1/completions", [payload] * n, [0] * n, warmup_payloads=[payload])
    )
    m = compute_metrics(records, seconds)
    problems = [f"{name}: {count} x {error}" for error, count in m.errors.items()]
    problems += [f"{name} warm-up: {r.error}" for r in warmup if not r.success]
    wrong = sorted({r.output_tokens for r in records if r.success} - {args.max_tokens})
    if wrong:
        problems.append(f"{name}: completions of {wrong} tokens, {args.max_tokens} asked for")
    result = Result(
        name,
        seconds,
        m.successful_requests,
        m.total_input_tokens,
        m.total_output_tokens,
        {"e2e_ms": m.e2e_ms, "ttft_ms": m.ttft_ms, "failed_requests": m.failed_requests},
    )
    logger.info("%s: %d requests in %.2f s", name, m.successful_requests, seconds)
    return result, problems


@contextlib.contextmanager
def running(start: Callable[[int], Proc], ready_path: str, timeout_s: float) -> Iterator[str]:
    """Starts a server on a free port, waits until it is ready, and stops it afterwards."""
    port = free_port()
    proc = start(port)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready([url], ready_path, timeout_s, procs=[proc])
        yield url
    finally:
        stop([proc])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", required=True, help="directory with config.json and a tokenizer")
    p.add_argument("--dtype", default="bfloat16", help="of both servers")
    p.add_argument("--served-model-name", default="model", help="sent as each request's model")
    p.add_argument("--num-requests", type=int, default=50)
    p.add_argument("--prompt", default=PROMPT)
    p.add_argument("--max-tokens", type=int, default=50, help="asked for with ignore_eos")
    p.add_argument("--base-url", help="a running kvfleet server, instead of starting one")
    p.add_argument("--baseline-url", help="a running bench/hf_server.py, instead of starting one")
    p.add_argument("--engine-args", default="",
                   help='more kvfleet serve flags: --engine-args="--max-num-seqs 64"')  # fmt: skip
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds per server")
    p.add_argument("--log-dir", help="where the servers' logs go (default: a new temp dir)")
    p.add_argument("--result-json")
    args = p.parse_args(argv)
    if args.num_requests < 1 or args.max_tokens < 1:
        p.error("need --num-requests >= 1 and --max-tokens >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="kvfleet-burst-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    logger.info("server logs in %s", log_dir)

    def kvfleet(port: int) -> Proc:
        flags = ["--load-format", "dummy", "--dtype", args.dtype, *shlex.split(args.engine_args)]
        return start_engine(args.model, port, log_dir / "kvfleet.log", *flags,
                            served_name=args.served_model_name)  # fmt: skip

    def hf(port: int) -> Proc:
        cmd = python_cmd(str(Path(__file__).with_name("hf_server.py")), "--model", args.model,
                         "--dtype", args.dtype, "--port", str(port))  # fmt: skip
        return start_process(cmd, log_dir / "hf_server.log")

    results, problems = [], []
    for name, url, start, ready in (
        ("kvfleet", args.base_url, kvfleet, "/ready"),
        ("hf-generate-sequential", args.baseline_url, hf, "/health"),
    ):
        with contextlib.ExitStack() as stack:
            if url is None:
                url = stack.enter_context(running(start, ready, args.startup_timeout))
            result, found = burst(args, name, url)
        results.append(result)
        problems += found

    sys.stdout.write(TABLE_HEADER + "\n" + "\n".join(r.row() for r in results) + "\n")
    kv, base = results
    if base.requests:
        sys.stdout.write(f"kvfleet / {base.name}: {kv.req_s / base.req_s:.1f}x req/s\n")
    sys.stdout.write("| run | e2e p50 ms | e2e p99 ms |\n|---|---|---|\n")
    for r in results:
        p50, p99 = (r.extra["e2e_ms"][k] for k in ("p50", "p99"))
        if p50 is not None:
            sys.stdout.write(f"| {r.name} | {p50:.0f} | {p99:.0f} |\n")
    write_results(args.result_json, {"args": vars(args)}, results)
    for problem in problems:
        logger.error("%s", problem)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
