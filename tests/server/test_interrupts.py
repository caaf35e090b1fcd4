"""Ctrl-C on `kvfleet-engine serve`: during the model's load the process stops at once, without
waiting for the load and without a traceback (exit 130); with requests in flight it drains,
saying how long it will wait, and a second Ctrl-C stops it at once."""

from __future__ import annotations

import asyncio
import json
import os
import queue
import signal
import subprocess
import threading
import time

import aiohttp

from kvfleet.engine import cli
from tests.support.logs import captured_logs
from tests.support.net import free_port
from tests.support.scripts import ROOT
from tests.support.servers import EngineProcess, sse_data_lines
from tests.support.slow_load import LOADING, SLOW_LOAD_ENV
from tests.support.tiny_model import tiny_model_path

MODEL = "tiny"
COMP = "/v1/completions"
# From the signal to the process's exit, on a busy 2-core machine; far below the load's and the
# drain's own lengths, which the process must not wait for.
EXIT_S = 10.0
SLOW_LOAD_S = 120
DRAIN_S = 120


class OutputLines:
    """A child process's output, read line by line on a thread as it comes."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self._lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, args=(proc,), daemon=True).start()

    def _read(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            self._lines.put(line.decode(errors="replace"))

    def wait_for(self, text: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while True:
            line = self._lines.get(timeout=max(deadline - time.monotonic(), 0.01))
            self.seen.append(line)
            if text in line:
                return line

    def rest(self, timeout: float = 5.0) -> str:
        """Everything written, once the process has exited and its output is read."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                self.seen.append(self._lines.get(timeout=0.2))
            except queue.Empty:
                break
        return "".join(self.seen)


def test_ctrl_c_during_the_load_stops_at_once_without_a_traceback() -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT),
           SLOW_LOAD_ENV: str(SLOW_LOAD_S)}  # fmt: skip
    server = EngineProcess(
        tiny_model_path(), free_port(), [], MODEL, env, main="tests.support.slow_load"
    )
    proc = subprocess.Popen(server.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    try:
        output = OutputLines(proc)
        output.wait_for(LOADING, 120)
        proc.send_signal(signal.SIGINT)
        sent = time.monotonic()
        code = proc.wait(SLOW_LOAD_S)
        elapsed = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = output.rest()
    assert code == 130, log[-3000:]
    assert elapsed < EXIT_S, log[-3000:]
    assert "SIGINT: interrupted while loading the model; exiting" in log
    assert "Traceback" not in log and "KeyboardInterrupt" not in log and "engine ready" not in log


def test_a_second_ctrl_c_stops_the_drain_at_once() -> None:
    server = EngineProcess(
        tiny_model_path(), free_port(), ["--shutdown-timeout", str(DRAIN_S)], MODEL
    )
    with server as url:
        assert server.proc is not None
        output = OutputLines(server.proc)

        async def stream(session: aiohttp.ClientSession, started: asyncio.Event) -> list[str]:
            body = {"prompt": "go", "max_tokens": 2000, "ignore_eos": True, "stream": True}
            return await sse_data_lines(session, url + COMP, body, started)

        async def main() -> tuple[str, float, list[list[str]]]:
            assert server.proc is not None
            async with aiohttp.ClientSession() as session:
                started = [asyncio.Event() for _ in range(4)]
                tasks = [asyncio.create_task(stream(session, e)) for e in started]
                await asyncio.gather(*(e.wait() for e in started))
                server.proc.send_signal(signal.SIGINT)
                draining = await asyncio.to_thread(output.wait_for, "draining:", 30)
                server.proc.send_signal(signal.SIGINT)
                sent = time.monotonic()
                return draining, sent, await asyncio.gather(*tasks)

        draining, sent, streams = asyncio.run(main())
        code = server.proc.wait(DRAIN_S)
        elapsed = time.monotonic() - sent
        log = output.rest()
    assert f"draining: waiting up to {DRAIN_S}s for 4 requests in flight" in draining
    assert "Ctrl-C again" in draining
    assert code == 130, log[-3000:]
    assert elapsed < EXIT_S, log[-3000:]
    for lines in streams:
        events = [json.loads(x[6:]) for x in lines if x != "data: [DONE]"]
        assert events[-1]["error"]["code"] == "draining", lines[-3:]
    assert "SIGINT again: stopping now" in log and "stopping now: aborting 4 requests" in log
    assert "Traceback" not in log


def test_ctrl_c_before_the_server_handles_it_is_one_line(monkeypatch, capsys) -> None:
    """While the engine is imported or the default model fetched: 130 and "interrupted"."""

    def interrupted(ns):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "engine_args_from", interrupted)
    with captured_logs():
        assert cli.main(["serve"]) == 130
    (line,) = capsys.readouterr().err.splitlines()
    assert line.endswith("WARNING kvfleet.engine: interrupted"), line
