"""GET /health (or --path) of each server in turn, at a fixed interval for a fixed time, as a
kubelet probes a pod: a new connection each time, a timeout. Prints one JSON object: for each
URL, the latency of every answer in ms and every failure (no answer in time, or not 200).

    python bench/health_probe.py --duration 600 http://127.0.0.1:8000 http://127.0.0.1:8001

Its own process (bench/soak.py starts it) so that the client's own work (a GIL held while it
builds a hostile body) is not counted as the server's latency. Standard library only: it
starts in a blink. SIGTERM ends it early, with what it saw printed as at the end.
"""

from __future__ import annotations

import argparse
import http.client
import json
import signal
import sys
import time
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit


def probe(url: str, timeout: float, path: str = "/health") -> tuple[float, str | None]:
    """(seconds taken, None if the answer was 200 else what went wrong)."""
    parts = urlsplit(url)
    start = time.perf_counter()
    conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=timeout)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        resp.read()
        error = None if resp.status == 200 else f"status {resp.status}"
    except (OSError, http.client.HTTPException) as e:
        error = repr(e)
    finally:
        conn.close()
    return time.perf_counter() - start, error


class Stopped(Exception):
    """SIGTERM arrived."""


def _stop(*_: Any) -> None:
    raise Stopped


def run(
    urls: Sequence[str], duration: float, interval: float, timeout: float, path: str = "/health"
) -> dict[str, Any]:
    out: dict[str, Any] = {u: {"latencies_ms": [], "failures": []} for u in urls}
    start = time.monotonic()
    next_round = start
    try:
        while next_round < start + duration:
            for url in urls:
                seconds, error = probe(url, timeout, path)
                if error is None:
                    out[url]["latencies_ms"].append(round(seconds * 1000, 2))
                else:
                    out[url]["failures"].append(
                        {"at_s": round(time.monotonic() - start, 1), "error": error}
                    )
            next_round += interval
            time.sleep(max(0.0, next_round - time.monotonic()))
    except Stopped:
        pass  # the probe under way, if any, is not counted
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("urls", nargs="+", help="base URLs")
    p.add_argument("--duration", type=float, required=True, help="seconds of probing")
    p.add_argument("--interval", type=float, default=0.25, help="seconds between rounds")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds an answer may take")
    p.add_argument("--path", default="/health", help="the path probed (default: %(default)s)")
    ns = p.parse_args(argv)
    signal.signal(signal.SIGTERM, _stop)
    seen = run(ns.urls, ns.duration, ns.interval, ns.timeout, ns.path)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # printed whole, whatever comes now
    json.dump(seen, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
