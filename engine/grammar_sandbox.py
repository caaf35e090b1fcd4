"""The grammar sandbox: worker processes that compile each constraint the engine has not seen
before, so that a crash of the native grammar compiler costs one request, not the engine.

`grammar_bounds` refuses what is known to overflow or blow up llguidance; this catches the next
crash nobody predicted. A worker compiles exactly what the engine would (`compile_matcher`, the
same tokenizer and limits) in a thread with a smaller stack than the engine's compile threads,
under an address-space limit and a deadline, and answers with the grammar's memory; only then
does the engine compile it. A worker that dies (SIGSEGV, an abort on a failed allocation) or
overruns the deadline is killed and replaced, and the request gets a 400.

Protocol on the worker's stdin/stdout: length-prefixed JSON messages. First the engine sends the
tokenizer; then, per constraint, the worker answers {"bytes": n} or {"error": message}.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import queue
import resource
import signal
import struct
import subprocess
import sys
import threading
import time
from typing import IO, Any

from kvfleet.engine.grammar import GrammarError, compile_matcher, grammar_tokenizer
from kvfleet.engine.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

# A worker's compile thread's stack; the engine's compile threads get COMPILE_STACK_BYTES, four
# times more, so that what a worker survived the engine survives with room to spare.
WORKER_STACK_BYTES = 4 << 20
COMPILE_STACK_BYTES = 16 << 20
# How much less CPU priority a worker has than the engine.
WORKER_NICENESS = 10
# A worker's address space: a constraint that needs more fails its compile, not the host.
WORKER_ADDRESS_SPACE_BYTES = 4 << 30
_HEADER = struct.Struct("!I")
# How a worker is started: this module, run by the engine's own interpreter.
WORKER_COMMAND = [sys.executable, "-m", "kvfleet.engine.grammar_sandbox"]


class SandboxCrash(GrammarError):
    """The compiler died or overran its deadline on this constraint."""


def _send(stream: IO[bytes], message: Any) -> None:
    data = json.dumps(message).encode()
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


def _receive(stream: IO[bytes]) -> Any:
    """The next message; EOFError when the other side has gone."""
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        raise EOFError
    (size,) = _HEADER.unpack(header)
    data = stream.read(size)
    if len(data) < size:
        raise EOFError
    return json.loads(data)


class _Worker:
    """One worker process; replaced whole when it dies or overruns."""

    def __init__(self, init: bytes) -> None:
        self.proc = subprocess.Popen(
            WORKER_COMMAND,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=None,  # its crash report goes to the engine's log
            start_new_session=True,  # a Ctrl-C in the engine's terminal is the engine's
        )
        stdin = self.proc.stdin
        assert stdin is not None and self.proc.stdout is not None

        def send_init() -> None:
            with contextlib.suppress(OSError):  # a worker that died: ask() reports it
                stdin.write(init)
                stdin.flush()

        # A large vocabulary's tokenizer is megabytes, which the pipe takes only as fast as the
        # worker, still importing, reads: the engine's start does not wait for that.
        self._init_sent = threading.Thread(
            target=send_init, name="grammar-sandbox-init", daemon=True
        )
        self._init_sent.start()
        self.ready = False

    def ask(self, params: StructuredOutputsParams, timeout: float) -> dict[str, Any]:
        """The worker's answer for one constraint; SandboxCrash when it dies or overruns."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        answer: list[Any] = []
        stdout = self.proc.stdout

        def read() -> None:
            with contextlib.suppress(EOFError, OSError, ValueError):
                if not self.ready:
                    _receive(stdout)  # the worker has its tokenizer
                    self.ready = True
                answer.append(_receive(stdout))

        reader = threading.Thread(target=read, name="grammar-sandbox-read", daemon=True)
        deadline = time.monotonic() + timeout
        self._init_sent.join(timeout)
        if not self._init_sent.is_alive():
            # One that died before this sees EOF at once.
            with contextlib.suppress(OSError):
                _send(self.proc.stdin, params.model_dump(mode="json", by_alias=True))
            reader.start()
            reader.join(max(deadline - time.monotonic(), 0.0))
            if answer:
                return answer[0]
        overran = self._init_sent.is_alive() or reader.is_alive()
        self.kill()
        code = self.proc.wait()
        if overran:
            raise SandboxCrash(
                f"the constraint took longer than {timeout:g} s to compile: simplify it",
                "structured_outputs",
            )
        how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        logger.warning("the grammar compiler crashed on a constraint (%s)", how)
        raise SandboxCrash(
            f"the grammar compiler crashed on this constraint ({how}): simplify it",
            "structured_outputs",
        )

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        for stream in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(OSError):
                if stream is not None:
                    stream.close()

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None


class GrammarSandbox:
    """A pool of worker processes; check() blocks for a free one."""

    def __init__(
        self, tokenizer_json: str, n_vocab: int, eos_token_ids: list[int], workers: int
    ) -> None:
        message = json.dumps({"tokenizer": tokenizer_json, "n_vocab": n_vocab,
                              "eos": eos_token_ids}).encode()  # fmt: skip
        self._init = _HEADER.pack(len(message)) + message
        self._idle: queue.SimpleQueue[_Worker] = queue.SimpleQueue()
        self._all: list[_Worker] = []
        self._lock = threading.Lock()
        self._closed = False
        self.crashes = 0  # constraints that killed or overran a worker
        for _ in range(workers):
            self._idle.put(self._spawn())

    def _spawn(self) -> _Worker:
        if self._closed:
            raise GrammarError("the engine is shutting down", "structured_outputs")
        worker = _Worker(self._init)
        with self._lock:
            self._all = [w for w in self._all if w.alive] + [worker]
        return worker

    def check(self, params: StructuredOutputsParams, timeout: float) -> int:
        """The bytes the constraint's compiled grammar holds, as a worker measured them;
        GrammarError as compile_matcher gives it, or SandboxCrash."""
        worker = self._idle.get()
        if not worker.alive:  # gone while idle (killed from outside): not this request's doing
            worker = self._spawn()
        try:
            answer = worker.ask(params, timeout)
        except SandboxCrash:
            with self._lock:
                self.crashes += 1
            worker = self._spawn()
            raise
        finally:
            if not self._closed:
                self._idle.put(worker)
        if "error" in answer:
            raise GrammarError(answer["error"], "structured_outputs")
        return int(answer["bytes"])

    def close(self) -> None:
        self._closed = True
        with self._lock:
            workers, self._all = self._all, []
        for worker in workers:
            worker.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                worker.proc.wait(timeout=5)


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]  # fmt: skip


def _find_mallinfo2() -> Any:
    """glibc's mallinfo2, or None where the C library has none."""
    try:
        mallinfo2 = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return None
    mallinfo2.restype = _Mallinfo2
    return mallinfo2


_MALLINFO2 = _find_mallinfo2()


def _allocated_bytes() -> int:
    """Bytes the C heap holds (glibc's mallinfo2): what a compiled grammar costs, measured
    around its compile. 0 where the C library has no mallinfo2."""
    if _MALLINFO2 is None:
        return 0
    info = _MALLINFO2()
    return int(info.uordblks + info.hblkhd)


def _serve(stdin: IO[bytes], stdout: IO[bytes]) -> None:
    """The worker: read the tokenizer, then compile each constraint and answer."""
    import llguidance

    from kvfleet.engine.grammar import _LIMITS

    init = _receive(stdin)
    tokenizer = grammar_tokenizer(init["tokenizer"], init["n_vocab"], init["eos"])
    eos = frozenset(init["eos"])
    limits = llguidance.LLParserLimits(**_LIMITS)
    _send(stdout, {"ready": True})
    threading.stack_size(WORKER_STACK_BYTES)
    while True:
        try:
            message = _receive(stdin)
        except EOFError:
            return  # the engine has gone
        answer: dict[str, Any] = {}

        def compile_one(message: Any = message, answer: dict[str, Any] = answer) -> None:
            before = _allocated_bytes()
            try:
                params = StructuredOutputsParams.model_validate(message)
                matcher = compile_matcher(params, tokenizer, limits, eos)
            except GrammarError as e:
                answer["error"] = str(e)
                return
            except Exception as e:  # whatever else the library raises fails this constraint
                answer["error"] = f"invalid constraint: {e or type(e).__name__}"
                return
            answer["bytes"] = max(_allocated_bytes() - before, 0)
            del matcher

        thread = threading.Thread(target=compile_one)
        thread.start()
        thread.join()
        _send(stdout, answer)


def main() -> None:
    # The engine kills a worker it no longer wants; a terminal's Ctrl-C is not for it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # A check of a new constraint is background work: where cores are few, the engine's steps
    # (every running request's next token) come first.
    os.nice(WORKER_NICENESS)
    resource.setrlimit(resource.RLIMIT_AS, (WORKER_ADDRESS_SPACE_BYTES, WORKER_ADDRESS_SPACE_BYTES))
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    # Nothing but answers on stdout: a stray print would corrupt the stream.
    sys.stdout = sys.stderr
    with contextlib.suppress(BrokenPipeError):
        _serve(stdin, stdout)


if __name__ == "__main__":
    main()
