"""Liveness under long steps (issue 35): /health tells a step that is busy (within the bound its
tokens earn) from one that is stuck, and learns a slow machine's rate. Steps are made slow in a
controlled way (slow_steps)."""

from __future__ import annotations

import json
import random
import re
import threading
import time

import pytest

from kvfleet.engine.config import EngineArgs
from kvfleet.engine.server.app import ServerSettings
from tests.support.net import http_call
from tests.support.servers import engine_server
from tests.support.slow_steps import slow_steps

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
