"""Liveness and shutdown under long steps (issue 35): /health tells a step that is busy (within
the bound its tokens earn) from one that is stuck, and learns a slow machine's rate; SIGTERM
during a long step interrupts it and exits 0 within the deadline, and a stuck step is left behind
with exit status 1, never a SIGABRT. Steps are made slow in a controlled way (slow_steps)."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import threading
import time
from pathlib import Path

import pytest

from kvfleet.engine.config import EngineArgs
from kvfleet.engine.server.app import EXIT_ENGINE_STUCK, ServerSettings
from tests.support.net import free_port, http_call
from tests.support.scripts import ROOT
from tests.support.servers import EngineProcess, engine_server
from tests.support.slow_steps import SLOW_ENV, slow_steps
from tests.support.tiny_model import build_tiny_model

MODEL = "tiny"
COMP = "/v1/completions"
STALL = 1.0
SECONDS_PER_TOKEN = 0.001
PROMPT_LEN = 300
BOUND = STALL + PROMPT_LEN * SECONDS_PER_TOKEN  # 1.3 s
# Only a step of the long prompt is slow: short ones (the server's own, a decode) are not.
MIN_TOKENS = 256
SLOW_LAYER_S = 1.5  # the tiny model's two layers: a 3 s step


def _prompt(seed: int) -> list[int]:
    rng = random.Random(seed)  # its own prompt each time: no prefix-cache hit shortens it
    return [rng.randrange(3, 500) for _ in range(PROMPT_LEN)]


def _health(url: str) -> tuple[int, dict]:
    status, _, raw = http_call(url + "/health", method="GET")
    return status, json.loads(raw)


def _complete_in_thread(url: str, prompt: list[int], result: dict) -> threading.Thread:
    def run() -> None:
        result["status"] = http_call(url + COMP, {"prompt": prompt, "max_tokens": 1})[0]

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def _probe_during(url: str, prompt: list[int]) -> list[tuple[int, dict]]:
    """/health every 0.1 s while a completion of `prompt` runs."""
    result: dict = {}
    request = _complete_in_thread(url, prompt, result)
    seen = []
    while request.is_alive():
        seen.append(_health(url))
        time.sleep(0.1)
    request.join()
    assert result["status"] == 200
    return seen


@pytest.fixture(scope="module")
def server(model_dirs):
    settings = ServerSettings(
        host="127.0.0.1",
        port=0,
        served_model_name=[MODEL],
        health_stall_timeout=STALL,
        health_seconds_per_token=SECONDS_PER_TOKEN,
    )
    with engine_server(EngineArgs(model=str(model_dirs["llama"]), dtype="float32"), settings) as s:
        yield s


def test_health_tells_a_long_step_from_a_stuck_one(server):
    """A 3 s step of 300 tokens: busy, and /health says so, within its 1.3 s bound; 503 and why
    past it; 200 once it ends. It taught the engine this machine's rate (0.01 s a token), so the
    next step as long is busy all along."""
    with slow_steps("layer", SLOW_LAYER_S, MIN_TOKENS):
        first = _probe_during(server.url, _prompt(1))
        second = _probe_during(server.url, _prompt(2))

    busy = re.compile(rf"a step of {PROMPT_LEN} tokens has run ([\d.]+) s of its ([\d.]+) s bound")
    stuck = re.compile(
        rf"engine loop is stuck: a step of {PROMPT_LEN} tokens has run [\d.]+ s, past its bound "
        rf"of {BOUND:.1f} s"
    )
    verdicts = [
        "busy" if status == 200 and busy.fullmatch(body.get("engine", "")) else
        "stuck" if status == 503 and stuck.fullmatch(body.get("reason", "")) else
        body.get("engine")
        for status, body in first
    ]  # fmt: skip
    assert "busy" in verdicts and "stuck" in verdicts, first
    assert verdicts.index("busy") < verdicts.index("stuck")
    assert "busy" not in verdicts[verdicts.index("stuck") :], first
    assert _health(server.url) == (200, {"status": "ok", "engine": "idle"})

    assert all(status == 200 for status, _ in second), second
    running = [busy.fullmatch(body["engine"]) for _, body in second]
    ran = [(float(m[1]), float(m[2])) for m in running if m]
    assert max(t for t, _ in ran) > BOUND  # past the bound the default allowance gives
    assert all(bound > 2 * SLOW_LAYER_S for _, bound in ran)


# -- SIGTERM during a long step ------------------------------------------------------------

DEEP_LAYERS = 8
DEEP_LAYER_S = 2.0  # a 16 s step, longer than the deadline and any wait for it
DEADLINE = 1.0
# After the deadline: a second for the aborted requests' handlers, the engine's close, and the
# interpreter's exit (seconds on a busy 2-core machine).
EXIT_S = 7.0


@pytest.fixture(scope="module")
def deep_model(tmp_path_factory) -> Path:
    return build_tiny_model(
        tmp_path_factory.mktemp("deep") / "llama", "llama", num_layers=DEEP_LAYERS
    )


def _sigterm_during_long_step(
    model: Path, slow: str, extra: list[str]
) -> tuple[int | None, float, str, int]:
    """Serve `model` with its long steps slowed (SLOW_ENV `slow`), send a long prompt, SIGTERM
    while its step runs; (exit status, seconds from the signal to the exit, the process's log,
    the request's HTTP status)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT), SLOW_ENV: slow}
    server = EngineProcess(
        model, free_port(), ["--shutdown-timeout", str(DEADLINE), *extra], MODEL, env,
        main="tests.support.slow_steps",
    )  # fmt: skip
    with server as url:
        assert server.proc is not None and server.proc.stdout is not None
        result: dict = {}
        request = _complete_in_thread(url, _prompt(3), result)
        time.sleep(1.0)  # the step has begun: the engine thread takes the request at once
        server.proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        code = server.proc.wait(60)
        elapsed = time.monotonic() - sent
        request.join(10)
        return code, elapsed, server.proc.stdout.read().decode(), result.get("status", 0)


def test_sigterm_during_a_long_step_interrupts_it_and_exits_0(deep_model):
    """The deadline aborts the request; the step ends at its next layer, not its last; the
    process exits 0 without the SIGABRT that a thread left inside torch at the interpreter's
    exit gave ("terminate called without an active exception")."""
    code, elapsed, log, status = _sigterm_during_long_step(
        deep_model, f"layer:{DEEP_LAYER_S}:{MIN_TOKENS}", []
    )
    assert code == 0, log[-3000:]
    assert elapsed < DEADLINE + DEEP_LAYER_S + EXIT_S, log[-3000:]
    assert status == 503
    assert "the step in progress was interrupted" in log
    assert "terminate called" not in log and "Traceback" not in log


def test_sigterm_with_a_stuck_step_leaves_it_past_its_bound_and_exits_1(model_dirs):
    """A step stuck in one piece that no interruption reaches: the process waits for it only
    until its bound, then exits with status 1 without finalizing, which would abort it."""
    code, elapsed, log, status = _sigterm_during_long_step(
        model_dirs["llama"],
        f"step:60:{MIN_TOKENS}",
        ["--health-stall-timeout", str(STALL), "--health-seconds-per-token",
         str(SECONDS_PER_TOKEN)],
    )  # fmt: skip
    assert code == EXIT_ENGINE_STUCK == 1, log[-3000:]
    assert elapsed < DEADLINE + BOUND + EXIT_S, log[-3000:]
    assert status == 503
    assert f"the engine loop did not stop: engine loop is stuck: a step of {PROMPT_LEN}" in log
    assert "terminate called" not in log and "Traceback" not in log
