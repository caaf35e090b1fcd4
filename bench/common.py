"""Pieces every benchmark shares: random token-id workloads, timing, result records, HF
baseline models, and servers run as child processes."""

from __future__ import annotations

import json
import logging
import os
import platform
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

logger = logging.getLogger("bench")


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    def head(self, n: int) -> Workload:
        return Workload(self.prompts[:n], self.output_lens[:n])


def random_workload(
    num_prompts: int,
    input_len: tuple[int, int],
    output_len: tuple[int, int],
    vocab_size: int,
    seed: int,
    prefix_len: int = 0,
) -> Workload:
    """Uniform lengths in the given inclusive ranges; ids avoid the first 10 (specials)."""
    rng = np.random.default_rng(seed)
    prefix = rng.integers(10, vocab_size, prefix_len).tolist()
    in_lens = rng.integers(input_len[0], input_len[1] + 1, num_prompts)
    out_lens = rng.integers(output_len[0], output_len[1] + 1, num_prompts)
    prompts = [prefix + rng.integers(10, vocab_size, int(n)).tolist() for n in in_lens]
    return Workload(prompts, [int(n) for n in out_lens])


def device_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"CPU ({platform.processor() or platform.machine()})"


def git_commit() -> str:
    """The commit of the code that runs: KVFLEET_COMMIT when set (a copy made with `git
    archive` has no history), else the checkout's HEAD, and "unknown" when the benchmarks do not
    sit at the top of a checkout (a copy unpacked inside another repository would otherwise
    report that repository's HEAD)."""
    if os.environ.get("KVFLEET_COMMIT"):
        return os.environ["KVFLEET_COMMIT"]
    root = Path(__file__).resolve().parent.parent

    def git(*args: str) -> str:
        out = subprocess.run(["git", *args], capture_output=True, text=True, check=True, cwd=root)
        return out.stdout.strip()

    try:
        if Path(git("rev-parse", "--show-toplevel")).resolve() != root:
            return "unknown"
        return git("rev-parse", "--short", "HEAD")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class Timer:
    def __enter__(self) -> Timer:
        sync()
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        sync()
        self.seconds = time.perf_counter() - self.start


@dataclass
class Result:
    name: str
    seconds: float
    requests: int
    prompt_tokens: int
    output_tokens: int
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def req_s(self) -> float:
        return self.requests / self.seconds

    def row(self) -> str:
        return (
            f"| {self.name} | {self.requests} | {self.seconds:.2f} | {self.req_s:.2f} | "
            f"{self.output_tok_s:,.0f} | "
            f"{(self.prompt_tokens + self.output_tokens) / self.seconds:,.0f} |"
        )


TABLE_HEADER = (
    "| run | requests | seconds | req/s | output tok/s | total tok/s |\n|---|---|---|---|---|---|"
)


def write_results(path: str | None, meta: dict[str, Any], results: list[Result]) -> None:
    record = {
        "date": time.strftime("%Y-%m-%d"),
        "device": device_name(),
        "commit": git_commit(),
        **meta,
        "results": [
            {**asdict(r), "output_tok_s": r.output_tok_s, "req_s": r.req_s} for r in results
        ],
    }
    text = json.dumps(record, indent=2)
    if path:
        Path(path).write_text(text + "\n")
    logger.info("%s", text)


def hf_model(model: str | Path, dtype: str) -> Any:
    """HF transformers' model of ``model``'s config.json with its own random initialisation,
    built on the GPU when there is one (``dtype`` "auto": bfloat16)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model)
    torch_dtype = getattr(torch, dtype) if dtype != "auto" else torch.bfloat16
    # Built in place on the device: initialising billions of weights on the CPU takes minutes.
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        built = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    return built.eval()


# --------------------------------------------------------------------------------------------
# Servers as child processes
# --------------------------------------------------------------------------------------------

Proc = subprocess.Popen[bytes]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def python_cmd(*args: str) -> list[str]:
    return [sys.executable, *args]


def start_process(cmd: Sequence[str], log: Path, env: Mapping[str, str] | None = None) -> Proc:
    """``cmd`` with its output to ``log``; ``env``: variables set for it on top of this
    process's."""
    with log.open("ab") as out:
        return subprocess.Popen(
            list(cmd), stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )


def engine_cmd(model: str | Path, port: int, *extra: str, served_name: str) -> list[str]:
    """``kvfleet-engine serve`` on 127.0.0.1:``port``."""
    return python_cmd("-m", "kvfleet.engine.cli", "serve", "--model", str(model), "--host",
                      "127.0.0.1", "--port", str(port), "--served-model-name", served_name,
                      *extra)  # fmt: skip


def start_engine(
    model: str | Path,
    port: int,
    log: Path,
    *extra: str,
    served_name: str,
    env: Mapping[str, str] | None = None,
) -> Proc:
    """``kvfleet-engine serve`` on 127.0.0.1:``port``, output to ``log``."""
    return start_process(engine_cmd(model, port, *extra, served_name=served_name), log, env)


def router_cmd(endpoints: Sequence[str], port: int, *extra: str) -> list[str]:
    """``kvfleet-router`` on 127.0.0.1:``port`` in front of ``endpoints`` (host:port): its
    module's main, which the console script calls (the GPU machines put kvfleet on the path
    only, without the scripts)."""
    return python_cmd("-m", "kvfleet.router.main", "--host", "127.0.0.1", "--port", str(port),
                      "--endpoints", ",".join(endpoints), *extra)  # fmt: skip


def start_router(endpoints: Sequence[str], port: int, log: Path, *extra: str) -> Proc:
    """``kvfleet-router`` on 127.0.0.1:``port``, output to ``log``."""
    return start_process(router_cmd(endpoints, port, *extra), log)


def wait_ready(
    urls: Sequence[str], path: str, timeout_s: float = 120.0, procs: Sequence[Proc] = ()
) -> None:
    """Polls ``url + path`` until each answers 200; fails at once when one of ``procs`` (the
    servers being waited for) has exited, rather than at the timeout."""
    deadline = time.monotonic() + timeout_s
    for url in urls:
        while True:
            try:
                with urllib.request.urlopen(f"{url}{path}", timeout=2) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            dead = [p.args for p in procs if p.poll() is not None]
            if dead:
                raise RuntimeError(f"server exited before it was ready: {dead[0]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url}{path} not ready after {timeout_s}s")
            time.sleep(0.2)


def exited(procs: Sequence[Proc]) -> list[str]:
    """Each of ``procs`` that has exited, said with its command and exit status."""
    return [f"{' '.join(map(str, p.args[:5]))} exited with status {p.returncode}"
            for p in procs if p.poll() is not None]  # fmt: skip


@contextmanager
def watched(procs: Sequence[Proc]) -> Iterator[None]:
    """Fails naming the process that exited, if one of ``procs`` did, when the body fails or
    ends: a benchmark whose server died must say so, not report connection errors or numbers
    measured against nothing."""
    try:
        yield
    except Exception as e:
        if dead := exited(procs):
            raise RuntimeError(f"{dead[0]} while the benchmark ran") from e
        raise
    if dead := exited(procs):
        raise RuntimeError(f"{dead[0]} while the benchmark ran")


def stop(procs: Sequence[Proc]) -> list[Proc]:
    """SIGTERM, then SIGKILL after 15 s; the processes that needed the SIGKILL."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    killed = []
    for p in procs:
        try:
            p.wait(15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            killed.append(p)
    return killed
