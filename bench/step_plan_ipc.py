"""What tensor parallelism adds to each step on the host: rank 0 pickles the step plan and
writes it down a pipe to every worker. Measured here with a real worker process: pickling, and
the round trip of send -> worker receive + unpickle -> one-byte reply (the engine does not wait
for a reply; half the round trip is the latency a worker sees).

    python bench/step_plan_ipc.py
"""

from __future__ import annotations

import multiprocessing as mp
import pickle
import sys
import time
from multiprocessing.connection import Connection

import numpy as np

from kvfleet.engine.model_runner import StepPlan

REPEATS = 500


def _worker(conn: Connection) -> None:
    while msg := conn.recv_bytes():
        pickle.loads(msg)
        conn.send_bytes(b"k")


def decode_plan(num_seqs: int, new_blocks: int, context: int = 700) -> StepPlan:
    """A decode step under async scheduling: one token per sequence, each the previous step's
    token still on the device; `new_blocks` of them just crossed a block."""
    return StepPlan(
        rows=np.arange(num_seqs, dtype=np.int64),
        num_new=np.ones(num_seqs, dtype=np.int64),
        computed=np.full(num_seqs, context, dtype=np.int64),
        input_ids=np.arange(num_seqs, dtype=np.int64),
        table_writes=[(i, context // 16, [1000 + i]) for i in range(new_blocks)],
        sampling=np.arange(num_seqs, dtype=np.int64),
        pending_ids=np.arange(num_seqs, dtype=np.int64),
        pending_src=np.arange(num_seqs, dtype=np.int64),
        num_prev_sampled=num_seqs,
    )


def main() -> int:
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_worker, args=(child,))
    proc.start()
    print("| sequences | new blocks | bytes | pickle us | round trip us |")
    print("|---|---|---|---|---|")
    try:
        for num_seqs, new_blocks in [(1, 0), (32, 2), (256, 16), (256, 256)]:
            plan = decode_plan(num_seqs, new_blocks)
            start = time.perf_counter()
            for _ in range(REPEATS):
                data = pickle.dumps(plan, protocol=pickle.HIGHEST_PROTOCOL)
            pickle_s = (time.perf_counter() - start) / REPEATS
            for _ in range(50):  # warm-up
                conn.send_bytes(data)
                conn.recv_bytes()
            start = time.perf_counter()
            for _ in range(REPEATS):
                conn.send_bytes(pickle.dumps(plan, protocol=pickle.HIGHEST_PROTOCOL))
                conn.recv_bytes()
            trip_s = (time.perf_counter() - start) / REPEATS
            print(f"| {num_seqs} | {new_blocks} | {len(data)} | {pickle_s * 1e6:.1f} "
                  f"| {trip_s * 1e6:.1f} |")  # fmt: skip
    finally:
        conn.send_bytes(b"")
        proc.join()
    return 0


if __name__ == "__main__":
    sys.exit(main())
