"""How late the API server's event loop wakes up while the engine thread, in the same process,
holds the GIL for part of every step: a model of the two threads, not the server itself.

A thread runs pure Python for `busy` ms and then releases the GIL for the rest of a `period` ms
step (as the engine thread does while it waits for the GPU's tokens); the event loop sleeps in
select() and measures how late each wake-up is. A request's TTFT has at least two such wake-ups
(its arrival and its first output). With the busy times `profile_step.py` measured on an H100
(free: 1.8 of 7.3 ms; JSON-constrained: 4.4 of 7.3 ms) it estimates what the GIL alone adds to
a constrained request's TTFT.

    python bench/gil_contention.py --busy 1.8 4.4 --period 7.3
    python bench/gil_contention.py --busy 1.8 4.4 --period 7.3 --switch-interval 0.5
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import threading
import time


def _engine(busy_s: float, idle_s: float, stop: threading.Event) -> None:
    while not stop.is_set():
        end = time.perf_counter() + busy_s
        while time.perf_counter() < end:
            pass  # Python bytecode: the GIL is held but for forced switches
        time.sleep(idle_s)  # as Event.synchronize() does, without the GIL


async def _wakeups(count: int, sleep_s: float) -> list[float]:
    late = []
    for _ in range(count):
        start = time.perf_counter()
        await asyncio.sleep(sleep_s)
        late.append(time.perf_counter() - start - sleep_s)
    return sorted(late)


def measure(busy_ms: float, period_ms: float, wakeups: int) -> tuple[float, float, float]:
    """Mean, p50 and p90 lateness of an event-loop wake-up, in ms, with the engine thread busy
    `busy_ms` of every `period_ms` (0: no engine thread)."""
    stop = threading.Event()
    thread = None
    if busy_ms > 0:
        idle_s = max(period_ms - busy_ms, 0) / 1e3
        thread = threading.Thread(target=_engine, args=(busy_ms / 1e3, idle_s, stop))
        thread.start()
    try:
        late = asyncio.run(_wakeups(wakeups, 0.002))
    finally:
        stop.set()
        if thread is not None:
            thread.join()
    q = [late[int(len(late) * f)] * 1e3 for f in (0.5, 0.9)]
    return statistics.fmean(late) * 1e3, q[0], q[1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--busy", type=float, nargs="+", default=[1.8, 4.4], metavar="MS",
                   help="the engine thread's Python time a step, one run each")  # fmt: skip
    p.add_argument("--period", type=float, default=7.3, metavar="MS", help="a step's time")
    p.add_argument("--wakeups", type=int, default=300)
    p.add_argument("--switch-interval", type=float, default=None, metavar="MS",
                   help="sys.setswitchinterval for the run (Python's default: 5 ms)")  # fmt: skip
    args = p.parse_args(argv)
    if any(b < 0 or b > args.period for b in args.busy):
        p.error("--busy: each value must lie between 0 and --period")
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval / 1e3)
    interval = sys.getswitchinterval() * 1e3
    print(f"switch interval {interval:g} ms, step {args.period:g} ms")
    print("| engine busy a step (ms) | wake-up late, mean | p50 | p90 |")
    print("|---|---|---|---|")
    for busy in [0.0, *args.busy]:
        mean, p50, p90 = measure(busy, args.period, args.wakeups)
        print(f"| {busy:g} | {mean:.2f} | {p50:.2f} | {p90:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
