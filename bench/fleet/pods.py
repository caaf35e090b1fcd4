"""The pod runner: the kubelet, the ReplicaSet controller and the EndpointSlice controller of the
emulated cluster, for the engine Deployment the operator applies.

For each replica it creates a Pod (labels and spec from the template) and starts a real
``kvfleet-engine`` process with the container's own arguments, on a loopback address of its own
(127.0.0.N, the pod IP) and the container port, so the operator's scraper and the router reach
``http://<podIP>:<port>`` as in a cluster; one GPU each (CUDA_VISIBLE_DEVICES) when GPUs are
given, a pod waiting (Pending) while none is free. A pod turns Ready, in its status and in the
engine Service's EndpointSlice, once the readiness probe's path answers 200 and the kubelet would
have seen it: at the first tick of the startup probe's period (from the process's start) after
the engine came up, the readiness probe running at once after it, as the kubelet triggers it.
On scale-down pods go
in the ReplicaSet's order (not ready first, then the lowest pod-deletion-cost, then the newest):
terminating in the slice, the preStop sleep, SIGTERM, the engine's drain, SIGKILL only past the
grace period.

An engine with LoRA adapters starts as in a pod: the container's own shell command, which reads
the adapters ConfigMap, the runner writing the ConfigMap's files into a folder of the pod's as
kubelet mounts them (once, at start: the operator's load calls bring later edits), and a
``kvfleet-engine`` on the PATH that runs the engine's module.

Every step is timed (``events``), so a run can split scale-up latency into the operator's
decision and the engine's start.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import math
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from fleet.cluster import DEPLOYMENTS, PODS, SLICES, Emulator, call, resource_url

from kvfleet.operator.adapters import ADAPTERS_DIR, adapters_config_name

logger = logging.getLogger("kvfleet.bench.fleet.pods")

DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
KUBELET_FINALIZER = "bench.kvfleet.dev/kubelet"
SERVICE_NAME_LABEL = "kubernetes.io/service-name"
POLL_S = 0.1


@dataclass
class Event:
    t: float  # time.monotonic()
    what: str  # replicas, created, started, ready, terminating, sigterm, exited, killed, crashed
    pod: str = ""
    detail: str = ""


@dataclass
class Pod:
    name: str
    ip: str
    port: int
    created: float
    spec: dict[str, Any]
    ready_path: str
    # The startup probe's period: the kubelet sees the engine up at its next tick (0: no startup
    # probe, the readiness probe's first success counts at once).
    startup_period: float = 0.0
    gpu: str | None = None
    proc: subprocess.Popen[bytes] | None = None
    started: float | None = None
    up: float | None = None  # the readiness path first answered 200
    ready: float | None = None  # the kubelet's Ready
    terminating: float | None = None
    exited: float | None = None
    # The engine's last counters, read just before SIGTERM: they outlive the process.
    final_metrics: dict[str, float] = field(default_factory=dict)
    # The Ready condition as last written, and when it last changed (as the kubelet reports
    # it: the operator learns engine start times from creationTimestamp to this).
    ready_flag: str | None = None
    ready_since: str | None = None

    @property
    def url(self) -> str:
        return f"http://{self.ip}:{self.port}"


def container_port(container: dict[str, Any]) -> int:
    for port in container.get("ports") or []:
        if port.get("name") == "http":
            return int(port["containerPort"])
    raise ValueError(f"container {container.get('name')} has no port named http")


def prestop_sleep(container: dict[str, Any]) -> float:
    """The seconds of a ``sleep N`` preStop hook (the operator's), else 0."""
    command = ((container.get("lifecycle") or {}).get("preStop") or {}).get("exec", {})
    argv = command.get("command") or []
    return float(argv[1]) if len(argv) == 2 and argv[0] == "sleep" else 0.0


def engine_command(
    container: dict[str, Any], ip: str, adapters_dir: Path | None = None
) -> list[str]:
    """The container's command line as a local process listening on the pod IP. The image's
    ``kvfleet-engine`` entry point is run as its module, so that this works where kvfleet is on
    the path without installed scripts (the GPU machines). A shell command (an engine with
    adapters) runs as it is, its ConfigMap folder at ``adapters_dir``; its ``kvfleet-engine``
    must be on the PATH (``engine_shim``)."""
    command = container.get("command") or []
    args = list(container.get("args") or [])
    if "--host" not in args:
        raise ValueError("the engine's args name no --host")
    args[args.index("--host") + 1] = ip
    if command == ["kvfleet-engine"]:
        return [sys.executable, "-m", "kvfleet.engine.cli", *args]
    if command[:2] == ["/bin/sh", "-c"] and len(command) == 4 and adapters_dir is not None:
        return [
            *command[:2],
            command[2].replace(ADAPTERS_DIR, str(adapters_dir)),
            command[3],
            *args,
        ]
    raise ValueError(f"not an engine container: command {command}")


def engine_shim(folder: Path) -> Path:
    """A folder holding a ``kvfleet-engine`` that runs the engine's module, for the PATH."""
    folder.mkdir(parents=True, exist_ok=True)
    shim = folder / "kvfleet-engine"
    shim.write_text(f'#!/bin/sh\nexec {sys.executable} -m kvfleet.engine.cli "$@"\n')
    shim.chmod(0o755)
    return folder


def kubelet_sees(started: float, up: float, period: float) -> float:
    """When the kubelet's startup probe, ticking every ``period`` seconds from the container's
    start, first finds an engine that came up at ``up``; ``up`` itself with no period."""
    if period <= 0:
        return up
    return started + math.ceil((up - started) / period - 1e-9) * period


def _port_free(ip: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((ip, port))
        except OSError:
            return False
    return True


def deletion_order(pods: Iterable[tuple[Pod, dict[str, Any]]]) -> list[Pod]:
    """The ReplicaSet controller's order of deletion: not ready first, then the lowest
    pod-deletion-cost, then the newest."""

    def key(item: tuple[Pod, dict[str, Any]]) -> tuple[bool, int, float]:
        pod, obj = item
        annotations = (obj.get("metadata") or {}).get("annotations") or {}
        return (pod.ready is not None, int(annotations.get(DELETION_COST, "0")), -pod.created)

    return [pod for pod, _ in sorted(pods, key=key)]


async def register_router(
    k: Emulator, namespace: str, deployment: dict[str, Any], port: int
) -> str:
    """A Ready Pod of the router Deployment for the router process the harness runs on
    127.0.0.1:``port``, as the kubelet would report it: the operator finds its routers among the
    service's pods and scrapes their held requests there, the signal that scales from zero. The
    pod's name."""
    template = deployment["spec"]["template"]
    spec = dict(template["spec"])
    spec["containers"] = [
        {**c, "ports": [{"name": "http", "containerPort": port, "protocol": "TCP"}]}
        if c["name"] == "router"
        else c
        for c in spec["containers"]
    ]
    name = f"{deployment['metadata']['name']}-{uuid.uuid4().hex[:10]}"
    body = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace,
                     "labels": dict((template.get("metadata") or {}).get("labels") or {})},
        "spec": spec,
    }  # fmt: skip
    await call(k, "post", resource_url(PODS, namespace), body)
    since = {"lastTransitionTime": datetime.datetime.now(datetime.UTC).isoformat()}
    status = {
        "phase": "Running",
        "podIP": "127.0.0.1",
        "podIPs": [{"ip": "127.0.0.1"}],
        "hostIP": "127.0.0.1",
        "conditions": [
            {"type": "PodScheduled", "status": "True"},
            {"type": "ContainersReady", "status": "True", **since},
            {"type": "Ready", "status": "True", **since},
        ],
    }
    url = resource_url(PODS, namespace, name) + "/status"
    await call(k, "patch", url, {"status": status}, merge=True)
    return name


class PodRunner:
    def __init__(
        self,
        k: Emulator,
        namespace: str,
        service: str,
        log_dir: Path,
        gpus: Sequence[str] = (),
        first_ip: int = 10,
    ) -> None:
        self.k = k
        self.namespace = namespace
        self.deployment = f"{service}-engine"
        self.adapters_config = adapters_config_name(service)
        self.log_dir = log_dir
        self.gpus = list(gpus)
        self.free_gpus = list(gpus)
        self.pods: dict[str, Pod] = {}
        self.events: list[Event] = []
        self.failures: list[str] = []  # engines that exited on their own
        self.desired: int | None = None
        self._next_ip = first_ip
        self._first_ip = first_ip
        self._tasks: set[asyncio.Task[None]] = set()
        self._session: aiohttp.ClientSession | None = None
        self._slice_created = False
        self._status: dict[str, Any] = {}

    # -- the loop ----------------------------------------------------------------------------

    async def run(self) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5))
        try:
            while True:
                await self._step()
                await asyncio.sleep(POLL_S)
        finally:
            await self._shutdown()

    async def _step(self) -> None:
        deployment = self.k.live(DEPLOYMENTS, self.namespace, self.deployment)
        if deployment is None:
            return
        replicas = int(deployment["spec"].get("replicas", 1))
        if replicas != self.desired:
            self._event("replicas", detail=f"{self.desired} -> {replicas}")
            self.desired = replicas
        template = deployment["spec"]["template"]
        live = [p for p in self.pods.values() if p.terminating is None]
        for _ in range(replicas - len(live)):
            await self._create(template)
        if len(live) > replicas:
            objs = [(p, self.k.live(PODS, self.namespace, p.name) or {}) for p in live]
            for pod in deletion_order(objs)[: len(live) - replicas]:
                pod.terminating = time.monotonic()
                self._spawn(self._terminate(pod))
        for pod in self.pods.values():
            if pod.proc is None and pod.terminating is None:
                self._start(pod)
            elif pod.proc is not None and pod.terminating is None and pod.proc.poll() is not None:
                self._crashed(pod)
        await self._write_deployment_status(deployment)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _event(self, what: str, pod: str = "", detail: str = "") -> None:
        self.events.append(Event(time.monotonic(), what, pod, detail))
        logger.info("%s %s %s", what, pod, detail)

    def _ip(self, port: int) -> str:
        """The next loopback address no pod of this runner has and where ``port`` is free: another
        fleet on the same machine (a second harness run) may serve on the same addresses."""
        used = {p.ip for p in self.pods.values()}
        for _ in range(254 - self._first_ip + 1):
            ip = f"127.0.0.{self._next_ip}"
            self._next_ip = self._next_ip + 1 if self._next_ip < 254 else self._first_ip
            if ip not in used and _port_free(ip, port):
                return ip
        raise RuntimeError(f"no loopback address with port {port} free")

    # -- pods --------------------------------------------------------------------------------

    async def _create(self, template: dict[str, Any]) -> None:
        (container,) = [c for c in template["spec"]["containers"] if c["name"] == "engine"]
        probe = (container.get("readinessProbe") or {}).get("httpGet") or {}
        name = f"{self.deployment}-{uuid.uuid4().hex[:10]}"
        meta = template.get("metadata") or {}
        body = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": self.namespace,
                         "labels": dict(meta.get("labels") or {}),
                         "annotations": dict(meta.get("annotations") or {}),
                         # Held until the engine has exited, as the kubelet holds a pod: a
                         # deleted pod stays listed, with its deletionTimestamp, meanwhile.
                         "finalizers": [KUBELET_FINALIZER]},
            "spec": template["spec"],
            "status": {"phase": "Pending"},
        }  # fmt: skip
        await call(self.k, "post", resource_url(PODS, self.namespace), body)
        port = container_port(container)
        startup_period = float((container.get("startupProbe") or {}).get("periodSeconds", 0))
        pod = Pod(name, self._ip(port), port, time.monotonic(), template["spec"],
                  probe.get("path", "/health"), startup_period)  # fmt: skip
        self.pods[name] = pod
        self._event("created", name, pod.ip)

    def _start(self, pod: Pod) -> None:
        if self.gpus:
            if not self.free_gpus:
                return  # Pending: no GPU free
            pod.gpu = self.free_gpus.pop(0)
        (container,) = [c for c in pod.spec["containers"] if c["name"] == "engine"]
        env = dict(os.environ)
        env.update({e["name"]: e["value"] for e in container.get("env") or [] if "value" in e})
        if pod.gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = pod.gpu
        adapters_dir = self._mount_adapters(pod)
        if adapters_dir is not None:
            env["PATH"] = f"{engine_shim(self.log_dir / 'bin')}:{env.get('PATH', '/usr/bin:/bin')}"
        log = (self.log_dir / f"{pod.name}.log").open("ab")
        with log:
            pod.proc = subprocess.Popen(
                engine_command(container, pod.ip, adapters_dir),
                stdout=log, stderr=subprocess.STDOUT, env=env,
            )  # fmt: skip
        pod.started = time.monotonic()
        self._event("started", pod.name, f"pid {pod.proc.pid} gpu {pod.gpu}")
        self._spawn(self._probe(pod))

    def _mount_adapters(self, pod: Pod) -> Path | None:
        """The adapters ConfigMap's files in a folder of the pod's, as kubelet mounts them;
        None when the service has none."""
        config = self.k.live("v1/configmaps", self.namespace, self.adapters_config)
        if config is None:
            return None
        folder = self.log_dir / pod.name / "adapters"
        folder.mkdir(parents=True, exist_ok=True)
        for name, text in (config.get("data") or {}).items():
            (folder / name).write_text(text)
        return folder

    async def _probe(self, pod: Pod) -> None:
        await self._pod_status(pod)
        assert self._session is not None and pod.proc is not None
        while pod.terminating is None and pod.proc.poll() is None:
            with contextlib.suppress(aiohttp.ClientError, TimeoutError, OSError):
                async with self._session.get(pod.url + pod.ready_path) as resp:
                    if resp.status == 200:
                        pod.up = time.monotonic()
                        await asyncio.sleep(
                            kubelet_sees(pod.started or pod.up, pod.up, pod.startup_period) - pod.up
                        )
                        if pod.terminating is not None or pod.proc.poll() is not None:
                            return
                        pod.ready = time.monotonic()
                        self._event("ready", pod.name, f"{pod.ready - pod.created:.1f}s, "
                                    f"up {pod.up - pod.created:.1f}s")  # fmt: skip
                        await self._pod_status(pod)
                        await self._write_slice()
                        return
            await asyncio.sleep(0.2)

    def _crashed(self, pod: Pod) -> None:
        assert pod.proc is not None
        message = (
            f"engine {pod.name} exited with {pod.proc.returncode}; "
            f"see {self.log_dir / (pod.name + '.log')}"
        )
        self.failures.append(message)
        self._event("crashed", pod.name, message)
        pod.exited = pod.terminating = time.monotonic()
        self._release(pod)
        self._spawn(self._delete(pod))

    async def _terminate(self, pod: Pod) -> None:
        self._event("terminating", pod.name)
        await call(self.k, "delete", resource_url(PODS, self.namespace, pod.name))
        await self._pod_status(pod)
        await self._write_slice()
        (container,) = [c for c in pod.spec["containers"] if c["name"] == "engine"]
        grace = float(pod.spec.get("terminationGracePeriodSeconds", 30))
        if pod.proc is not None and pod.proc.poll() is None:
            sleep = prestop_sleep(container)
            await asyncio.sleep(sleep)
            pod.final_metrics = await self.scrape(pod)
            pod.proc.send_signal(signal.SIGTERM)
            self._event("sigterm", pod.name)
            try:
                await asyncio.wait_for(asyncio.to_thread(pod.proc.wait), grace - sleep)
            except TimeoutError:
                pod.proc.kill()
                await asyncio.to_thread(pod.proc.wait)
                self.failures.append(f"engine {pod.name} did not drain within {grace:g}s")
                self._event("killed", pod.name)
        pod.exited = time.monotonic()
        self._event("exited", pod.name, f"rc {pod.proc.returncode if pod.proc else None}")
        self._release(pod)
        await self._delete(pod)

    def _release(self, pod: Pod) -> None:
        if pod.gpu is not None:
            self.free_gpus.append(pod.gpu)

    async def _delete(self, pod: Pod) -> None:
        url = resource_url(PODS, self.namespace, pod.name)
        obj = self.k.live(PODS, self.namespace, pod.name)
        with contextlib.suppress(RuntimeError):  # gone already
            if obj is not None and not obj["metadata"].get("deletionTimestamp"):
                await call(self.k, "delete", url)  # a crashed engine's pod
            await call(self.k, "patch", url, {"metadata": {"finalizers": []}}, merge=True)
        await self._write_slice()

    # -- what the API shows ------------------------------------------------------------------

    async def _pod_status(self, pod: Pod) -> None:
        ready = pod.ready is not None and pod.terminating is None
        flag = "True" if ready else "False"
        if flag != pod.ready_flag:
            pod.ready_flag = flag
            pod.ready_since = datetime.datetime.now(datetime.UTC).isoformat()
        since = {"lastTransitionTime": pod.ready_since}
        status = {
            "phase": "Running" if pod.proc is not None else "Pending",
            "podIP": pod.ip if pod.proc is not None else None,
            "podIPs": [{"ip": pod.ip}] if pod.proc is not None else None,
            "hostIP": "127.0.0.1",
            "conditions": [
                {"type": "PodScheduled", "status": "True" if pod.proc else "False"},
                {"type": "ContainersReady", "status": flag, **since},
                {"type": "Ready", "status": flag, **since},
            ],
        }
        url = resource_url(PODS, self.namespace, pod.name) + "/status"
        with contextlib.suppress(RuntimeError):  # a pod deleted meanwhile
            await call(self.k, "patch", url, {"status": status}, merge=True)

    async def _write_slice(self) -> None:
        """The engine Service's one EndpointSlice: every pod with an IP, with the conditions
        the EndpointSlice controller gives it."""
        service = self.deployment
        endpoints = [
            {
                "addresses": [p.ip],
                "conditions": {
                    "ready": p.ready is not None and p.terminating is None,
                    "serving": p.ready is not None,
                    "terminating": p.terminating is not None,
                },
                "targetRef": {"kind": "Pod", "name": p.name, "namespace": self.namespace},
            }
            for p in self.pods.values()
            if p.proc is not None and p.exited is None
        ]
        ports = {p.port for p in self.pods.values()} or {0}
        body = {
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {"name": f"{service}-fleet", "namespace": self.namespace,
                         "labels": {SERVICE_NAME_LABEL: service}},
            "addressType": "IPv4",
            "endpoints": endpoints,
            "ports": [{"name": "http", "port": min(ports), "protocol": "TCP"}],
        }  # fmt: skip
        if self._slice_created:
            url = resource_url(SLICES, self.namespace, f"{service}-fleet")
            await call(self.k, "patch", url, body, merge=True)
        else:
            await call(self.k, "post", resource_url(SLICES, self.namespace), body)
            self._slice_created = True

    async def _write_deployment_status(self, deployment: dict[str, Any]) -> None:
        live = [p for p in self.pods.values() if p.terminating is None]
        ready = sum(p.ready is not None for p in live)
        status = {
            "observedGeneration": deployment["metadata"].get("generation", 1),
            "replicas": len(live),
            "updatedReplicas": len(live),
            "readyReplicas": ready,
            "availableReplicas": ready,
            "unavailableReplicas": len(live) - ready,
        }
        if status != self._status:
            url = resource_url(DEPLOYMENTS, self.namespace, self.deployment) + "/status"
            await call(self.k, "patch", url, {"status": status}, merge=True)
            self._status = status

    # -- for the harness ---------------------------------------------------------------------

    def ready_urls(self) -> list[str]:
        return sorted(
            p.url for p in self.pods.values() if p.ready is not None and p.terminating is None
        )

    def running(self) -> int:
        """Engine processes alive: the GPUs (or CPU slots) in use."""
        return sum(p.started is not None and p.exited is None for p in self.pods.values())

    async def scrape(self, pod: Pod) -> dict[str, float]:
        """The engine's counters and gauges, summed over label sets; {} when it cannot answer."""
        assert self._session is not None
        out: dict[str, float] = {}
        with contextlib.suppress(aiohttp.ClientError, TimeoutError, OSError):
            async with self._session.get(pod.url + "/metrics") as resp:
                for line in (await resp.text()).splitlines():
                    if line.startswith("#") or " " not in line:
                        continue
                    sample, _, value = line.rpartition(" ")
                    name = sample.partition("{")[0]
                    out[name] = out.get(name, 0.0) + float(value)
        return out

    async def totals(self, names: Sequence[str]) -> dict[str, float]:
        """Each named counter summed over every engine this runner started: the live ones as
        they answer now, the gone ones as they answered before SIGTERM."""
        sums = dict.fromkeys(names, 0.0)
        for pod in list(self.pods.values()):
            if pod.started is None:
                continue
            done = pod.final_metrics or pod.exited is not None
            values = pod.final_metrics if done else await self.scrape(pod)
            for n in names:
                sums[n] += values.get(n, 0.0)
        return sums

    async def wait_ready(self, count: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while len(self.ready_urls()) < count:
            if self.failures:
                raise RuntimeError(self.failures[0])
            if time.monotonic() > deadline:
                raise TimeoutError(f"{count} engine(s) not ready within {timeout:g}s")
            await asyncio.sleep(POLL_S)

    async def _shutdown(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        procs = [p.proc for p in self.pods.values() if p.proc and p.proc.poll() is None]
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                await asyncio.wait_for(asyncio.to_thread(proc.wait), 15)
            except TimeoutError:
                proc.kill()
        if self._session is not None:
            await self._session.close()
