"""The engine image on its own, as docs/operations.md's "Run the engine image" runs it: every
CPU `docker run` of the section, verbatim (tests/support/documented_runs.py says what a test
substitutes), answers as the section says, and so do its client commands:

- the default model: /ready, and the curl question answered with Paris;
- a mounted HF model directory and a mounted GGUF file, served under the name given;
- the API key from an env file (401 without it, the documented curl with it, never in the
  container's arguments), a read-only root, uid 1000, no capabilities, the compose file's health
  check run in the container, and the cache volume holding the default model after the container
  is gone;
- --help and a command other than serve through --entrypoint.

The GPU image's commands are checked without a GPU in tests/test_engine_image_docs.py, its image by
test_gpu_image.py (make image-gpu-test)."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from kvfleet.engine.default_model import DEFAULT_MODEL_NAME
from tests.support.containers import ENGINE_IMAGE, wait_healthy
from tests.support.documented_runs import (
    DOC_CPU_IMAGE,
    GENERATE,
    SECTION,
    SERVERS,
    Served,
    as_run_here,
    block_with,
    blocks_with,
    shell,
    with_port,
)
from tests.support.net import http_call

COMPOSE = Path(__file__).resolve().parents[2] / "examples" / "docker-compose.engine.yaml"


def served_names(url: str, api_key: str | None = None) -> list[str]:
    status, _, body = http_call(f"{url}/v1/models", api_key=api_key)
    assert status == 200, body
    return [m["id"] for m in json.loads(body)["data"]]


def test_every_cpu_command_of_the_section_is_run_here():
    run_here = {block_with(*needles) for needles in [*SERVERS.values(), GENERATE]}
    assert set(blocks_with("docker run", DOC_CPU_IMAGE)) == run_here


def test_the_default_model_and_the_documented_queries(documented: dict[str, Served]):
    engine = documented["default model"]
    wait_healthy(engine.box, f"{engine.url}/health")
    assert served_names(engine.url) == [DEFAULT_MODEL_NAME]
    queries = block_with("curl -s localhost:8000/ready")
    run = shell(with_port(queries, engine.port), engine.workdir, {})
    assert run.returncode == 0, run.stderr
    # The two bodies one after the other (curl adds no newline).
    decoder = json.JSONDecoder()
    ready, end = decoder.raw_decode(run.stdout)
    answer, _ = decoder.raw_decode(run.stdout, end)
    assert ready == {"status": "ready"}
    assert "Paris" in answer["choices"][0]["message"]["content"]


@pytest.mark.parametrize("name", ["model directory", "gguf file"])
def test_a_mounted_model(documented: dict[str, Served], name: str):
    engine = documented[name]
    wait_healthy(engine.box, f"{engine.url}/health", timeout=120)
    assert served_names(engine.url) == ["my-model"]
    body = {"model": "my-model", "prompt": "Hello", "max_tokens": 4, "temperature": 0}
    status, _, reply = http_call(f"{engine.url}/v1/completions", body)
    assert status == 200, reply
    assert json.loads(reply)["usage"]["completion_tokens"] >= 1


def test_the_key_from_an_env_file_a_read_only_root_and_the_cache_volume(
    docker: str, documented: dict[str, Served], cache_volume: str
):
    engine = documented["key, cache, read-only"]
    wait_healthy(engine.box, f"{engine.url}/health")
    env_file = (engine.workdir / "engine.env").read_text()
    (key,) = re.findall(r"^KVFLEET_API_KEY=(.+)$", env_file, re.M)
    status, _, body = http_call(f"{engine.url}/v1/models")
    assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key", body
    query = block_with("Authorization: Bearer", "engine.env")
    run = shell(with_port(query, engine.port), engine.workdir, {})
    assert run.returncode == 0 and [m["id"] for m in json.loads(run.stdout)["data"]] == [
        DEFAULT_MODEL_NAME
    ], run.stdout + run.stderr
    inspect = subprocess.run([docker, "inspect", engine.box.id], capture_output=True, text=True,
                             timeout=30, check=True)  # fmt: skip
    (config,) = json.loads(inspect.stdout)
    assert key not in json.dumps([config["Args"], config["Config"]["Cmd"]])
    assert config["HostConfig"]["ReadonlyRootfs"] and config["Config"]["User"] == "1000:1000"
    assert config["HostConfig"]["CapDrop"] == ["ALL"]
    # The compose file's health check, as docker runs it: in the container, without the key.
    (service,) = yaml.safe_load(COMPOSE.read_text())["services"].values()
    kind, *probe = service["healthcheck"]["test"]
    assert kind == "CMD"
    checked = subprocess.run([docker, "exec", engine.box.id, *probe], capture_output=True,
                             text=True, timeout=60)  # fmt: skip
    assert checked.returncode == 0, checked.stderr
    # docker stop: the engine drains and exits; --rm removes the container, not the volume.
    subprocess.run([docker, "stop", engine.box.id], capture_output=True, timeout=60, check=True)
    kept = subprocess.run(
        [docker, "run", "--rm", "--entrypoint", "ls", "-v", f"{cache_volume}:/tmp", ENGINE_IMAGE,
         f"/tmp/kvfleet/{DEFAULT_MODEL_NAME}"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert kept.returncode == 0 and ".gguf" in kept.stdout, kept.stdout + kept.stderr


def test_help_and_another_command_through_the_entrypoint(
    docker: str, models: dict[str, str], tmp_path: Path
):
    (help_command,) = re.findall(rf"`(docker run --rm {DOC_CPU_IMAGE} --help)`", SECTION)
    run = shell(help_command.replace(DOC_CPU_IMAGE, ENGINE_IMAGE), tmp_path, {}, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("usage: kvfleet-engine serve [MODEL]"), run.stdout
    assert "--served-model-name" in run.stdout and "--api-key-file" in run.stdout
    run = shell(as_run_here(block_with(*GENERATE)), tmp_path, models)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.startswith("prompt: 'The capital of France is'"), run.stdout
