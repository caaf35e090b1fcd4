"""Tensor-parallel worker processes: ranks 1..N-1 of one engine, one GPU each. Rank 0 is the
engine process itself: it schedules and sends every step's plan down a pipe to each worker, and
all ranks run that plan through their shard of the model, kept in lock step by the collectives
inside it. A worker holds no scheduler state, so a step costs it one small message."""

from __future__ import annotations

import atexit
import contextlib
import logging
import multiprocessing as mp
import os
import pickle
import signal
import socket
import threading
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess

import torch.distributed as dist
from tqdm import tqdm

from kvfleet.engine.config import EngineArgs, ModelConfig
from kvfleet.engine.distributed import init_tensor_parallel, rank_device
from kvfleet.engine.model_runner import ModelRunner, StepPlan
from kvfleet.protocol.unused_packages import keep_out_unused_packages

logger = logging.getLogger(__name__)

_HELLO = b"up"
_LOADED = b"loaded"
_FAILED = b"failed: "
_STOP = b""
# How long a freshly spawned worker may take to import torch and say it is up.
_START_TIMEOUT_S = 300.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker_main(
    rank: int, world_size: int, port: int, args_json: str, conn: Connection, log_level: int
) -> None:
    # Ctrl-C reaches the whole process group; the engine process decides when workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(
        level=log_level, format=f"%(asctime)s %(levelname)s rank{rank} %(name)s: %(message)s"
    )
    # tqdm's default lock is a multiprocessing semaphore, which os._exit below never unlinks
    # (the resource tracker then warns of a leak at the engine's exit); a worker's progress
    # bars, all disabled, need no lock across processes.
    tqdm.set_lock(threading.RLock())
    conn.send_bytes(_HELLO)
    # A process of the engine's, as spawned: its model config would import them as rank 0's would.
    keep_out_unused_packages()
    args = EngineArgs.model_validate_json(args_json)
    device = rank_device(args.resolved_device(), rank)
    init_tensor_parallel(rank, world_size, port, device)
    try:
        model_config = ModelConfig.from_args(args, device)
        runner = ModelRunner(args, model_config, device, on_loaded=lambda: conn.send_bytes(_LOADED))
    except BaseException as e:
        # Rank 0 reads this while it waits for the weights, before any collective that this
        # rank would never join; after that point it can only see the process exit.
        with contextlib.suppress(OSError):
            conn.send_bytes(_FAILED + f"{type(e).__name__}: {e}".encode())
        raise
    while True:
        try:
            msg = conn.recv_bytes()
        except EOFError:
            # The engine process is gone; collectives with it can never complete.
            logger.error("the engine process went away; worker exiting")
            return
        if msg == _STOP:
            break
        runner.forward(pickle.loads(msg))
    # The CUDA graphs first: NCCL's teardown waits until no graph holds its communicator.
    runner.release()
    dist.destroy_process_group()
    # A spawned worker would otherwise exit through interpreter finalization, where c10d's
    # static objects are destroyed with their threads still joinable (std::terminate, SIGABRT,
    # now and then under load); everything that matters is torn down by now.
    logging.shutdown()
    os._exit(0)


class TensorParallelWorkers:
    """Starts ranks 1..N-1, joins the process group as rank 0, and feeds the workers."""

    def __init__(self, args: EngineArgs) -> None:
        world = args.tensor_parallel_size
        port = _free_port()
        ctx = mp.get_context("spawn")
        self._procs: list[BaseProcess] = []
        self._conns: list[Connection] = []
        self._stopping = False
        for rank in range(1, world):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_worker_main,
                args=(rank, world, port, args.model_dump_json(), child, logging.root.level),
                name=f"kvfleet-tp{rank}",
                daemon=True,
            )
            proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)
        atexit.register(self.shutdown)
        try:
            self._await_hello()
            init_tensor_parallel(0, world, port, rank_device(args.resolved_device(), 0))
        except BaseException:
            self.shutdown()
            raise
        logger.info("tensor parallel: %d ranks (rank 0 here, workers %s)", world,
                    [p.pid for p in self._procs])  # fmt: skip

    def _receive_each(self, timeout_s: float | None = None) -> Iterator[tuple[int, bytes, str]]:
        """Each worker's next message (empty if it exited or stayed silent past the timeout),
        with its rank and what its process says."""
        for rank, (proc, conn) in enumerate(zip(self._procs, self._conns, strict=True), 1):
            ready = wait([conn, proc.sentinel], timeout=timeout_s)
            msg = conn.recv_bytes() if conn in ready else b""
            yield rank, msg, f"exit code {proc.exitcode}"

    def _await_hello(self) -> None:
        for rank, msg, status in self._receive_each(_START_TIMEOUT_S):
            if msg != _HELLO:
                raise RuntimeError(
                    f"tensor-parallel worker rank {rank} did not start ({status}); see its log "
                    "lines above"
                )

    def wait_loaded(self) -> None:
        """Rank 0, its own weights loaded: every worker must have loaded its shard before the
        first collective, or say why not."""
        for rank, msg, status in self._receive_each():
            if msg != _LOADED:
                why = msg.removeprefix(_FAILED).decode() or status
                raise RuntimeError(f"tensor-parallel worker rank {rank} failed to load: {why}")

    def send(self, plan: StepPlan) -> None:
        data = pickle.dumps(plan, protocol=pickle.HIGHEST_PROTOCOL)
        for rank, conn in enumerate(self._conns, 1):
            try:
                conn.send_bytes(data)
            except OSError as e:
                raise RuntimeError(f"tensor-parallel worker rank {rank} is gone") from e

    def failure(self) -> str | None:
        """Why the group cannot work any more, or None while every worker runs."""
        for rank, proc in enumerate(self._procs, 1):
            if proc.exitcode is not None:
                return f"tensor-parallel worker rank {rank} exited with code {proc.exitcode}"
        return None

    def watch(self, on_failure: Callable[[str], None]) -> None:
        """Call `on_failure` from a thread as soon as a worker dies: rank 0 may then be stuck
        in a collective that will never complete, so it cannot notice by itself."""

        def run() -> None:
            wait([p.sentinel for p in self._procs])
            reason = self.failure()
            if reason is not None and not self._stopping:
                logger.error("%s", reason)
                on_failure(reason)

        threading.Thread(target=run, name="kvfleet-tp-watch", daemon=True).start()

    @staticmethod
    def _destroy_process_group(timeout_s: float) -> None:
        teardown = threading.Thread(target=dist.destroy_process_group, daemon=True)
        teardown.start()
        teardown.join(timeout_s)
        if teardown.is_alive():
            logger.warning("the process group did not tear down in %.0f s", timeout_s)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        if self._stopping:
            return
        self._stopping = True
        healthy = self.failure() is None
        for conn in self._conns:
            with contextlib.suppress(OSError):  # already gone
                conn.send_bytes(_STOP)
        # NCCL's teardown waits for every rank, so rank 0 tears down while the workers do (they
        # do on _STOP), not after they exit. With a rank dead it would wait forever: the
        # process's exit frees the communicator instead. Gloo's teardown is local, but rank 0
        # hosts the group's TCP store: closed under a worker still tearing down, it aborts that
        # worker (std::terminate), so with gloo the workers go first.
        gloo = dist.is_initialized() and dist.get_backend() == "gloo"
        if dist.is_initialized() and healthy and not gloo:
            self._destroy_process_group(timeout_s)
        for proc in self._procs:
            proc.join(timeout_s)
            if proc.is_alive():
                logger.warning("tensor-parallel worker %s did not stop; killing it", proc.name)
                proc.kill()
                proc.join()
        if gloo:
            self._destroy_process_group(timeout_s)
        for conn in self._conns:
            conn.close()
