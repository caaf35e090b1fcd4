"""One InferenceService on the CPU demo model, through its whole life on a kind cluster: Ready,
chat through the router, scale up under load, back down when idle, children gone on delete.

The tests run in file order and share the InferenceService of the module."""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

NAME = "e2e"
NAMESPACE = "default"
MANIFEST = Path(__file__).parent / "inferenceservice-e2e.yaml"
MODEL = "kvfleet-tiny-random-llama"
CHILD_KINDS = (
    "deployments,services,serviceaccounts,roles,rolebindings,configmaps,poddisruptionbudgets"
)


def kubectl(context: str, *args: str, timeout: float = 120) -> str:
    proc = subprocess.run(
        ["kubectl", "--context", context, "--namespace", NAMESPACE, *args],
        capture_output=True, text=True, timeout=timeout, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, f"kubectl {' '.join(args)}: {proc.stderr}"
    return proc.stdout


def wait_for(what: str, check: Callable[[], bool], timeout: float, interval: float = 3) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(interval)
    pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}")


def deployment_replicas(context: str) -> int:
    out = kubectl(context, "get", "deployment", f"{NAME}-engine", "-o", "jsonpath={.spec.replicas}")
    return int(out or 0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def chat(base: str, content: str, max_tokens: int = 16, timeout: float = 120) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens}  # fmt: skip
    req = urllib.request.Request(
        f"{base}/chat/completions", data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    with urllib.request.urlopen(req, timeout=timeout) as rsp:
        return json.load(rsp)


@pytest.fixture(scope="module")
def isvc(cluster: str) -> Iterator[str]:
    kubectl(cluster, "apply", "-f", str(MANIFEST))
    yield cluster
    subprocess.run(
        ["kubectl", "--context", cluster, "-n", NAMESPACE, "delete", "-f", str(MANIFEST),
         "--ignore-not-found", "--wait=false"],
        capture_output=True, timeout=60, check=False,
    )  # fmt: skip


@pytest.fixture(scope="module")
def router_url(isvc: str) -> Iterator[str]:
    port = free_port()
    kubectl(isvc, "wait", f"inferenceservice/{NAME}", "--for=condition=Ready", "--timeout=900s",
            timeout=960)  # fmt: skip
    pf = subprocess.Popen(
        ["kubectl", "--context", isvc, "-n", NAMESPACE, "port-forward", f"svc/{NAME}",
         f"{port}:80"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}/v1"

    def up() -> bool:
        with contextlib.suppress(OSError), urllib.request.urlopen(f"{base}/models", timeout=5):
            return True
        return False

    try:
        wait_for("the port-forward to the router", up, timeout=60, interval=1)
        yield base
    finally:
        pf.terminate()
        pf.wait(timeout=10)


def test_ready_with_status(isvc: str, router_url: str):
    status = json.loads(kubectl(isvc, "get", "inferenceservice", NAME, "-o", "json"))["status"]
    assert status["url"] == f"http://{NAME}.{NAMESPACE}.svc/v1"
    assert status["modelName"] == MODEL
    assert status["readyReplicas"] >= 1


def test_chat_through_the_router(router_url: str):
    out = chat(router_url, "Say hello")
    assert out["object"] == "chat.completion" and out["model"] == MODEL
    assert out["choices"][0]["message"]["role"] == "assistant"
    assert out["usage"]["completion_tokens"] >= 1


def test_streaming_chat_with_the_openai_sdk(router_url: str):
    from openai import OpenAI

    client = OpenAI(base_url=router_url, api_key="unused")
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Count"}], max_tokens=8, stream=True,
        user="e2e-session",
    )  # fmt: skip
    assert [c for c in stream if c.choices]


def test_load_scales_up_then_idle_scales_down(isvc: str, router_url: str):
    assert deployment_replicas(isvc) == 1
    stop = threading.Event()

    def worker(i: int) -> None:
        while not stop.is_set():
            with contextlib.suppress(OSError):
                chat(router_url, f"request {i} " * 50, max_tokens=128, timeout=300)

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(12)]
    for t in threads:
        t.start()
    try:
        wait_for("a second engine replica", lambda: deployment_replicas(isvc) >= 2, timeout=600)
    finally:
        stop.set()
    for t in threads:
        t.join(timeout=330)
    wait_for("the scale back to one replica", lambda: deployment_replicas(isvc) == 1, timeout=600)
    status = json.loads(kubectl(isvc, "get", "inferenceservice", NAME, "-o", "json"))["status"]
    assert status["lastScaleDecision"]["to"] == 1


def test_delete_removes_every_child(isvc: str):
    label = f"kvfleet.dev/inferenceservice={NAME}"
    assert kubectl(isvc, "get", CHILD_KINDS, "-l", label, "-o", "name").strip()
    kubectl(isvc, "delete", "inferenceservice", NAME, "--wait=true", timeout=300)

    def gone() -> bool:
        return not kubectl(isvc, "get", f"{CHILD_KINDS},pods", "-l", label, "-o", "name").strip()

    wait_for("the InferenceService's children to be garbage-collected", gone, timeout=300)
