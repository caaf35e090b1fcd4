"""The phases of an engine's start, each timed once: what a scale-up or a scale from zero waits
for, from the process's start to /ready. Logged on one line at ready and exported as
kvfleet_engine_startup_seconds{phase}."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator

logger = logging.getLogger(__name__)

# The phases in the order a start runs them. "process": from the process's start to the
# engine's construction (the interpreter, imports, argument parsing); "config": the device, the
# compile cache and the model's config; "tokenizer": the tokenizer, the end-of-sequence ids, the
# grammar compiler and the tensor-parallel workers; "weights": building
# the model and reading (or generating) its weights; "memory_profile": the forward pass at the
# largest batch that sizes the KV cache; "kv_cache": allocating it; "warm_up": the kernels'
# first launches at each decode width (Triton compiles, or loads from its cache); "graph_capture":
# the CUDA graphs captured before ready; "http": the server's start. "graph_capture_after_ready"
# is not part of the start: the graphs captured while serving, set once they are all captured.
PHASES = (
    "process",
    "config",
    "tokenizer",
    "weights",
    "memory_profile",
    "kv_cache",
    "warm_up",
    "graph_capture",
    "http",
    "graph_capture_after_ready",
)
AFTER_READY = "graph_capture_after_ready"


def process_age(stat: str, boot_seconds: float, ticks_per_second: int) -> float | None:
    """Seconds since the process started, from its /proc/<pid>/stat line (its 22nd field is the
    start in clock ticks after boot) and the seconds since boot now; None for a line it cannot
    read. The command name (field 2) is in parentheses and may hold spaces: fields are counted
    after its closing one."""
    _, paren, rest = stat.rpartition(")")
    fields = rest.split()
    if not paren or len(fields) < 20:
        return None
    try:
        started = int(fields[19]) / ticks_per_second
    except ValueError:
        return None
    return max(boot_seconds - started, 0.0)


def _own_process_age() -> float | None:
    """This process's age on Linux; None elsewhere (the "process" phase is then left out)."""
    try:
        with open("/proc/self/stat") as f:
            stat = f.read()
        boot = time.clock_gettime(time.CLOCK_BOOTTIME)
        ticks = os.sysconf("SC_CLK_TCK")
    except (OSError, AttributeError, ValueError):
        return None
    return process_age(stat, boot, ticks)


class StartupTimer:
    """Seconds per phase of one start. Made when the engine's construction begins, which closes
    the "process" phase; each later phase is timed by `phase(name)`."""

    def __init__(self, process_seconds: float | None = None) -> None:
        self.seconds: dict[str, float] = {}
        age = _own_process_age() if process_seconds is None else process_seconds
        if age is not None:
            self.seconds["process"] = age
        self._ready_logged = False

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the block as `name`; a phase timed twice adds up (the warm-up of two ranks'
        shares, say)."""
        if name not in PHASES:
            raise ValueError(f"unknown start-up phase {name!r}; the phases are {PHASES}")
        started = time.perf_counter()
        try:
            yield
        finally:
            self.record(name, time.perf_counter() - started)

    def record(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    @property
    def to_ready(self) -> float:
        """Seconds from the process's start (or the engine's construction) to ready."""
        return sum(s for name, s in self.seconds.items() if name != AFTER_READY)

    def log_ready(self) -> None:
        """One line at ready: each phase and the total, in the order they ran."""
        if self._ready_logged:
            return
        self._ready_logged = True
        parts = [
            f"{name} {self.seconds[name]:.2f}s"
            for name in PHASES
            if name in self.seconds and name != AFTER_READY
        ]
        logger.info("ready in %.2fs: %s", self.to_ready, ", ".join(parts))
