"""The OpenAI API under fuzzed hostile requests, against a live engine server and a router in
front of it: whatever arrives, no 5xx, no trace in a body, error bodies in OpenAI's shape, the
engine healthy and serving after every case, and every KV block back at the end. Each kind of
heavy case (bench/hostile.py: rule chains, $ref chains, JSON nested deep inside strings, huge
repetition counts, megabytes of tool-call arguments) is also run on its own, so that each has its
own test in CI whatever the mix draws.

The example budget is small for CI and fixed (derandomized); `make fuzz` runs a long, random one
(KVFLEET_FUZZ_EXAMPLES)."""

from __future__ import annotations

import http.client
import json
import os
import time
import urllib.request

import pytest
from hypothesis import HealthCheck, given, settings

from kvfleet.engine.config import EngineArgs
from kvfleet.engine.server.app import ServerSettings
from kvfleet.router.proxy import Router, RouterSettings, build_runner
from tests.support.scripts import load_bench_script
from tests.support.servers import engine_server, runner_in_thread

hostile = load_bench_script("hostile")

EXAMPLES = int(os.environ.get("KVFLEET_FUZZ_EXAMPLES", "100"))
LONG_RUN = "KVFLEET_FUZZ_EXAMPLES" in os.environ
# Examples of each heavy kind, through each door: a few variants each in CI.
HEAVY_EXAMPLES = max(3, EXAMPLES // 100)


@pytest.fixture(scope="module")
def fleet(model_dirs):
    args = EngineArgs(model=str(model_dirs["llama"]), dtype="float32", max_model_len=256)
    settings = ServerSettings(
        host="127.0.0.1",
        port=0,
        served_model_name=[hostile.MODEL],
        api_key=hostile.API_KEY,
        max_waiting_requests=64,
        # Room for the heavy cases' tool-call arguments of 1 and 3 MB; their 6 MB ones meet it.
        max_request_body_bytes=4 << 20,
    )
    with engine_server(args, settings) as engine:
        router = Router(RouterSettings(hold_timeout=5.0), None)
        router.set_endpoints([engine.url.removeprefix("http://")])
        with runner_in_thread(build_runner(router)) as front:
            yield {"engine": engine, "router": front}


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _serves(url: str) -> bool:
    body = {"model": hostile.MODEL, "prompt": "Hello", "max_tokens": 3}
    req = urllib.request.Request(
        url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {hostile.API_KEY}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        return resp.status == 200 and len(json.loads(resp.read())["choices"]) == 1


def _wait_idle(engine, timeout: float = 20.0) -> None:
    core = engine.srv.engine.core
    deadline = time.monotonic() + timeout
    while engine.srv.engine.num_unfinished or core.kv_cache_manager.usage:
        assert time.monotonic() < deadline, (
            f"not idle: {engine.srv.engine.num_unfinished} requests, "
            f"KV usage {core.kv_cache_manager.usage}"
        )
        time.sleep(0.05)


def _survived(fleet, via: str, case) -> int:
    """Sends the case through the door `via`; fails unless the answer keeps the rules and the
    engine is healthy after it. The answer's status."""
    target = fleet["engine"] if via == "engine" else fleet["router"]
    host, port = target.url.removeprefix("http://").rsplit(":", 1)
    try:
        reply = hostile.send(host, int(port), case)
    except (OSError, http.client.HTTPException) as e:
        raise AssertionError(f"no reply ({e!r}) to {case.describe()}") from None
    problems = hostile.check(reply)
    status, body = _get(fleet["engine"].url + "/health")
    if status != 200:
        problems.append(f"engine unhealthy after the case: {body!r}")
    assert not problems, f"{problems} for {case.describe()}"
    return reply.status


def _still_serves(fleet, via: str) -> None:
    target = fleet["engine"] if via == "engine" else fleet["router"]
    _wait_idle(fleet["engine"])
    assert _serves(target.url)
    assert _get(target.url + "/health")[0] == 200


def _fuzz_settings(examples: int):
    return settings(
        max_examples=examples,
        deadline=None,
        derandomize=not LONG_RUN,
        database=None,
        suppress_health_check=list(HealthCheck),
    )


@pytest.mark.parametrize("via", ["engine", "router"])
def test_hostile_requests_never_hurt_the_server(fleet, via):
    seen = {"cases": 0, "heavy": 0, "served": 0}

    @_fuzz_settings(EXAMPLES)
    @given(hostile.hostile_case())
    def case_is_survived(case) -> None:
        seen["cases"] += 1
        seen["heavy"] += case.note in hostile.HEAVY_KINDS
        seen["served"] += _survived(fleet, via, case) == 200

    case_is_survived()
    assert seen["cases"] >= min(EXAMPLES, 50)
    # The fuzzer keeps its teeth only if a fair share of its cases get past validation into
    # the engine (generation, streaming, logprobs) rather than all being refused at the door;
    # the heavy cases are built to be refused, so the share is of the others.
    assert seen["served"] >= (seen["cases"] - seen["heavy"]) // 20, seen
    _still_serves(fleet, via)


@pytest.mark.parametrize("kind", sorted(hostile.HEAVY_KINDS))
@pytest.mark.parametrize("via", ["engine", "router"])
def test_heavy_constraints_and_messages_never_hurt_the_server(fleet, via, kind):
    @_fuzz_settings(HEAVY_EXAMPLES)
    @given(hostile.heavy_case([kind]))
    def case_is_survived(case) -> None:
        _survived(fleet, via, case)

    case_is_survived()
    _still_serves(fleet, via)
