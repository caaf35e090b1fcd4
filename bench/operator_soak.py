"""Operator soak: the operator as its own process (``kvfleet-operator run``) against kmock's
Kubernetes API emulator (tests/support/kmock.py), with N InferenceServices (the CPU demo of
examples/), a seeded random mix of API faults (bench/api_faults.py) and users' changes to the
services for a fixed time; then the faults stop and every service must converge.

    python bench/operator_soak.py --duration 600 --out operator-soak.json   # make operator-soak

The operator runs as in production: cluster-wide, standalone, with its default backoffs and
timeouts and the 10 s autoscaling interval (--autoscale-interval changes it), through a
kubeconfig that points it at the emulator. The emulator sends a watch a bookmark after
BOOKMARK_S without an event, as a real API server does (--no-bookmarks: none, as kmock itself);
its watches replay every object as ADDED when they start (kmock keeps no history to resume
from), so every watch the operator opens again is a relist. What kmock does not run is emulated
around it (bench/cluster_sim.py): Deployments get Ready pods whose /metrics fake engines answer
(each service's load drawn anew every LOAD_EVERY_S), and a deleted InferenceService's children
are garbage collected. Users edit a service every --edit-every seconds on average: an
autoscaling bound, an engine setting (a new pod template), a key added to the router Service's
selector, or a delete and re-create.

Sampled meanwhile: the operator's API requests per WINDOW_S, by kind (watch, list, get, write,
event), by service and by collection; its process's RSS and CPU; /healthz every HEALTH_EVERY_S
within the chart's probe timeout (bench/health_probe.py, a process of its own); whether the
process exited. Every request of the operator's goes to requests.log in --log-dir, a line each,
and its own output to operator.log.

Exits 1 unless: the process never exited, /healthz answered 200 every time, no service and no
collection had more requests in any BOUND_SPAN_S than its bound (``service_bound``,
``collection_bound``), and every service converged (``divergence``) within --converge-timeout
of the faults' end. --faults leaves kinds out of the mix.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import json
import logging
import math
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import psutil

# bench/ for its modules, and the repository root for the emulator the tests use too.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import kmock
from api_faults import KINDS, FaultMix
from cluster_sim import ClusterSim, controller_uid, resource_key, send, simulated
from common import free_port, stop

from kvfleet.operator.api import PLURAL, PLURALS
from kvfleet.operator.config import OperatorConfig
from kvfleet.operator.drift import excess, in_sync
from kvfleet.operator.kube import BACKOFFS_S
from kvfleet.operator.reconciler import CHILD_RESOURCES
from kvfleet.operator.resources import (
    Owner,
    build_children,
    optional_children,
)
from kvfleet.operator.spec import engine_deployment_replicas, parse_spec
from tests.support.kmock import (
    DEMO,
    ISVCS,
    NS,
    APIServer,
    api,
    condition,
    emulated_cluster,
    from_operator,
    url,
    write_kubeconfig,
)

logger = logging.getLogger("kvfleet.bench.operator_soak")

WINDOW_S = 10.0
HEALTH_EVERY_S = 2.0
HEALTH_TIMEOUT_S = 5.0  # the chart's livenessProbe timeoutSeconds
EDIT_EVERY_S = 20.0
LOAD_EVERY_S = 60.0
# A real API server sends a watch a bookmark about every minute (kopf gives up on a watch after
# 70 s without an event, and kmock's watches replay every object when opened again).
BOOKMARK_S = 50.0
LOADS = (0.0, 1.0, 2.0, 4.0, 8.0, 12.0)  # requests in flight a service may be given
# The collections the operator watches (kopf lists and watches each).
WATCHED = (PLURAL, *(plural for _, _, plural in CHILD_RESOURCES))
CONFIG = OperatorConfig(
    engine_image="registry/engine:1",
    engine_cpu_image="registry/engine-cpu:1",
    router_image="registry/operator:1",
)
RUN = "import sys; from kvfleet.operator.main import main; sys.exit(main())"


def service_names(count: int) -> list[str]:
    return [f"svc-{i:02d}" for i in range(count)]


SERVICE_NAME = re.compile(r"svc-\d+")
SELECTOR = "kvfleet.dev/inferenceservice="


def service_of(request: kmock.Request) -> str | None:
    """The service a request is for (its own object, a child, its pods, an Event about it);
    None for what is shared (kopf's lists and watches of whole collections, the probe's)."""
    name = request.name or ""
    selector = request.params.get("labelSelector", "")
    if not name and selector.startswith(SELECTOR):
        name = selector.removeprefix(SELECTOR)
    if not name and isinstance(request.data, dict):
        name = (request.data.get("involvedObject") or {}).get("name") or ""
    return match.group() if (match := SERVICE_NAME.match(name)) else None


def inference_service(name: str) -> dict[str, Any]:
    body = copy.deepcopy(DEMO)
    body["metadata"] = {"name": name, "namespace": NS}
    return body


REQUEST_KINDS = ("watch", "list", "get", "write", "event")


def request_kind(request: kmock.Request) -> str:
    if request.method.value != "GET":
        plural = request.resource.plural if request.resource is not None else None
        return "event" if plural == "events" else "write"
    if request.action == kmock.action.WATCH:
        return "watch"
    if request.action == kmock.action.LIST:
        return "list"
    return "get"


# --------------------------------------------------------------------------------------------
# Convergence
# --------------------------------------------------------------------------------------------


def live_objects(k: APIServer) -> dict[tuple[str, str], dict[str, Any]]:
    """The emulator's objects in NS by ("group/version/plural", name), read once."""
    return {
        (resource_key(res), name): obj.raw
        for (res, ns, name), obj in list(k.objects.items())
        if ns == NS and not obj.deleted
    }


def divergence(
    objects: dict[tuple[str, str], dict[str, Any]], name: str, config: OperatorConfig = CONFIG
) -> str | None:
    """How service ``name`` differs from converged (``objects``: live_objects), None when it
    has converged: its status observed its current generation, says Ready and not Degraded,
    and no autoscaling failure; every child its spec asks for exists, is controlled by it and
    matches what the operator applies (drift.in_sync), with nothing added where the operator
    owns the whole value (drift.excess); a child it no longer asks for is gone."""
    isvc = objects.get((ISVCS, name))
    if isvc is None:
        return "does not exist"
    meta, status = isvc["metadata"], isvc.get("status") or {}
    observed, generation = status.get("observedGeneration"), meta.get("generation")
    if observed != generation:
        return f"status observed generation {observed}, not {generation}"
    spec = parse_spec(name, isvc.get("spec"))
    owner = Owner(name=name, namespace=NS, uid=meta["uid"])
    deployment_replicas = engine_deployment_replicas(spec, status.get("desiredReplicas"))
    desired = build_children(owner, spec, config, deployment_replicas)
    for want in desired:
        kind, child = want["kind"], want["metadata"]["name"]
        live = objects.get((f"{want['apiVersion']}/{PLURALS[kind]}", child))
        if live is None:
            return f"{kind}/{child} does not exist"
        if controller_uid(live) != meta["uid"]:
            return f"{kind}/{child} is not controlled by it"
        if not in_sync(want, live):
            return f"{kind}/{child} differs from its spec"
        if (extra := excess(want, live)) is not None:
            return f"{kind}/{child} keeps {', '.join(extra.paths)}"
    wanted = {(c["kind"], c["metadata"]["name"]) for c in desired}
    for ref in optional_children(owner):
        exists = (f"{ref.api_version}/{ref.plural}", ref.name) in objects
        if (ref.kind, ref.name) not in wanted and exists:
            return f"{ref.kind}/{ref.name} is no longer asked for but exists"
    for ctype, want_status in (("Ready", "True"), ("Degraded", "False")):
        cond = condition(isvc, ctype)
        if cond.get("status") != want_status:
            return f"{ctype} is {cond.get('status')} ({cond.get('reason')}: {cond.get('message')})"
    if failure := (status.get("autoscaling") or {}).get("failure"):
        return f"autoscaling failure {failure.get('reason')}: {failure.get('message')}"
    return None


# --------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------


class Operator:
    """``kvfleet-operator run`` as a child process (its module's main, as bench/fleet runs it),
    with the address of its /healthz and its CPU and memory use."""

    def __init__(self, kubeconfig: Path, log: Path, autoscale_interval: float) -> None:
        self.address = f"127.0.0.1:{free_port()}"
        env = {k: v for k, v in os.environ.items() if k != "KUBERNETES_SERVICE_HOST"}
        env["KUBECONFIG"] = str(kubeconfig)
        cmd = [sys.executable, "-c", RUN, "run", f"--health-address={self.address}",
               f"--metrics-address=127.0.0.1:{free_port()}",
               f"--autoscale-interval={autoscale_interval:g}",
               f"--engine-image={CONFIG.engine_image}",
               f"--engine-cpu-image={CONFIG.engine_cpu_image}",
               f"--router-image={CONFIG.router_image}"]  # fmt: skip
        with log.open("ab") as out:
            self.proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
        self._ps = psutil.Process(self.proc.pid)

    def usage(self) -> tuple[float, float]:
        """RSS in MiB, and CPU seconds used so far."""
        with self._ps.oneshot():
            times = self._ps.cpu_times()
            return self._ps.memory_info().rss / 2**20, times.user + times.system


class Windows:
    """The operator's requests by kind and by service, its RSS and CPU, and the faults given,
    per window; each request also goes to ``log``, a line each, under its window's end."""

    def __init__(self, k: APIServer, op: Operator, mix: FaultMix, log: Path) -> None:
        self.k, self.op, self.mix, self.log = k, op, mix, log
        # Taken out of kmock's log as they are answered: it walks the log for each request,
        # and a long one would make the emulator, not the operator, the bottleneck.
        k.served = []
        self.rows: list[dict[str, Any]] = []
        self.phase = "startup"
        self.t0 = self._start = time.monotonic()
        self._injected = Counter(mix.injected)
        self._cpu = op.usage()[1]

    async def run(self) -> None:
        while self.op.proc.poll() is None:
            await asyncio.sleep(WINDOW_S)
            self.take()

    def take(self) -> None:
        """The window since the last one, named for the phase it started in."""
        now = time.monotonic()
        requests = (self.k.served or []) + self.k.forget_served()
        self.k.served = []
        ours = [r for r in requests if from_operator(r)]
        counts = Counter(request_kind(r) for r in ours)
        per_service = Counter(s for r in ours if (s := service_of(r)) is not None)
        # The rest, by collection: kopf's lists and watches, the probe's list, discovery.
        per_collection = Counter(
            (r.resource.plural if r.resource is not None else None) or r.url.path
            for r in ours
            if service_of(r) is None
        )
        with self.log.open("a") as out:
            out.write(f"-- {now - self.t0:.1f}s\n")
            out.writelines(f"{r.method.value} {r.url.path_qs}\n" for r in ours)
        try:
            rss, cpu = self.op.usage()
        except psutil.NoSuchProcess:
            rss, cpu = 0.0, self._cpu
        seconds = now - self._start
        self.rows.append({
            "t": round(now - self.t0, 1),
            "s": round(seconds, 1),
            "phase": self.phase,
            "requests": sum(counts.values()),
            **{kind: counts[kind] for kind in REQUEST_KINDS},
            "per_service": dict(per_service),
            "per_collection": dict(per_collection),
            "rss_mb": round(rss, 1),
            "cpu_pct": round(100 * (cpu - self._cpu) / seconds, 1),
            "faults": dict(self.mix.injected - self._injected),
        })  # fmt: skip
        self._start, self._cpu, self._injected = now, cpu, Counter(self.mix.injected)

    def next_phase(self, phase: str) -> None:
        self.take()
        self.phase = phase


def start_health_probe(op: Operator, duration: float) -> subprocess.Popen[str]:
    """bench/health_probe.py on the operator's /healthz, every HEALTH_EVERY_S for ``duration``:
    its own process, so that the emulator's load in this one never counts as the operator's
    latency."""
    cmd = [sys.executable, str(Path(__file__).with_name("health_probe.py")),
           "--duration", str(duration), "--interval", str(HEALTH_EVERY_S),
           "--timeout", str(HEALTH_TIMEOUT_S), "--path", "/healthz",
           f"http://{op.address}"]  # fmt: skip
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)


def health_of(probe: subprocess.Popen[str], started_at: float) -> dict[str, Any] | None:
    """What the probe saw, once it has ended (SIGTERM ends it early), its failures' times
    counted from the operator's start (the probe's ``started_at``); None if it ended before it
    could say (a SIGTERM before its handler was in place)."""
    out, _ = probe.communicate()
    if probe.returncode != 0:
        logger.error("bench/health_probe.py exited with status %s", probe.returncode)
        return None
    (seen,) = json.loads(out).values()
    ms = seen["latencies_ms"]
    return {
        "checks": len(ms) + len(seen["failures"]),
        "failures": len(seen["failures"]),
        "p50_ms": sorted(ms)[len(ms) // 2] if ms else 0.0,
        "p99_ms": p99(ms),
        "max_ms": max(ms, default=0.0),
        "first_failures": [
            {**f, "at_s": round(started_at + f["at_s"], 1)} for f in seen["failures"][:5]
        ],
    }


async def edit_services(
    k: APIServer,
    names: Sequence[str],
    mix: FaultMix,
    rng: random.Random,
    every: float,
    until: float,
    edits: list[dict[str, Any]],
    t0: float,
) -> None:
    """What the services' users do, every ``every`` seconds on average until ``until``: change
    an autoscaling bound, an engine setting (a new pod template), a child by hand (a key added
    to the router Service's selector, which the operator removes), or delete a service and
    create it again a few seconds later."""
    while (wait := rng.expovariate(1 / every)) < until - time.monotonic():
        await asyncio.sleep(wait)
        # Half the time, if there is one, a service whose writes fail: a user does not wait.
        failing = [e.target for e in mix.active() if e.kind in ("conflict", "error")]
        name = rng.choice(failing if failing and rng.random() < 0.5 else list(names))
        what = rng.choice(("bounds", "engine", "drift", "recreate"))
        edits.append({"t": round(time.monotonic() - t0, 1), "what": what, "service": name})
        at = url(ISVCS, name)
        if what == "bounds":
            low = rng.randint(1, 2)
            bounds = {"minReplicas": low, "maxReplicas": rng.randint(low + 1, 4)}
            done = await send(k, "patch", at, {"spec": {"autoscaling": bounds}})
        elif what == "engine":
            engine = {"maxNumSeqs": rng.choice((8, 16, 32))}
            done = await send(k, "patch", at, {"spec": {"engine": engine}})
        elif what == "drift":
            selector = {"app": "evil"}
            done = await send(
                k, "patch", url("v1/services", name), {"spec": {"selector": selector}}
            )
        else:
            done = await send(k, "delete", at)
            await asyncio.sleep(rng.uniform(2, 8))
            await api(k, "post", url(ISVCS), inference_service(name))
        if done is None:
            edits[-1]["not_there_yet"] = True


async def move_load(sim: ClusterSim, names: Sequence[str], rng: random.Random) -> None:
    """Each service's requests in flight, drawn anew every LOAD_EVERY_S, one service at a time
    (their changes spread over the period, as independent services' would be)."""
    while True:
        for name in names:
            await asyncio.sleep(LOAD_EVERY_S / len(names))
            sim.load[name] = rng.choice(LOADS)


async def converge(
    k: APIServer, op: Operator, names: Sequence[str], timeout: float
) -> tuple[float, dict[str, str]]:
    """Seconds until every service converged (or the timeout, or the operator's exit), and
    how those that did not differ."""
    start = time.monotonic()
    while True:
        objects = live_objects(k)
        diverged = {n: why for n in names if (why := divergence(objects, n)) is not None}
        waited = time.monotonic() - start
        if not diverged or waited > timeout or op.proc.poll() is not None:
            return round(waited, 1), diverged
        await asyncio.sleep(1.0)


@contextlib.asynccontextmanager
async def running(*coros: Any) -> AsyncIterator[list[asyncio.Task[Any]]]:
    """The coroutines as tasks for the duration of the block."""
    tasks = [asyncio.create_task(c) for c in coros]
    try:
        yield tasks
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def under_faults(
    ns: argparse.Namespace,
    k: APIServer,
    op: Operator,
    mix: FaultMix,
    windows: Windows,
    rng: random.Random,
    result: dict[str, Any],
) -> None:
    """The faults and the edits for ns.duration, then convergence without them."""
    names = service_names(ns.services)
    # Probed until the services converged (then stopped), or the timeout.
    probe = start_health_probe(op, ns.duration + ns.converge_timeout)
    result["faults_at_s"] = round(time.monotonic() - windows.t0, 1)
    try:
        windows.next_phase("faults")
        until = time.monotonic() + ns.duration
        mix.start()
        edits = edit_services(k, names, mix, rng, ns.edit_every, until, result["edits"], windows.t0)
        async with running(edits) as (editor,):
            while time.monotonic() < until and op.proc.poll() is None:
                await asyncio.sleep(0.5)
            mix.stop()
            if op.proc.poll() is None:
                # The last edit finishes: a service deleted must be created again to converge.
                await asyncio.wait([editor])
                editor.result()  # the soak's own failure, if it failed
        windows.next_phase("converge")
        if op.proc.poll() is None:
            result["converge_s"], result["not_converged"] = await converge(
                k, op, names, ns.converge_timeout
            )
        windows.take()
    finally:
        probe.terminate()
        result["health"] = await asyncio.to_thread(health_of, probe, result["faults_at_s"])


async def soak(ns: argparse.Namespace, work: Path) -> dict[str, Any]:
    names = service_names(ns.services)
    rng = random.Random(ns.seed)
    mix = FaultMix(ns.seed, ns.faults, ns.duration, collections=WATCHED, services=names,
                   mean_gap=ns.mean_gap)  # fmt: skip
    result: dict[str, Any] = {"mix": mix, "edits": [], "health": None, "converge_s": None}
    async with emulated_cluster() as k, simulated(k) as sim:
        k.faults.append(mix)
        k.bookmark_every = None if ns.no_bookmarks else BOOKMARK_S
        kubeconfig = write_kubeconfig(work / "kubeconfig", str(k.url).rstrip("/"))
        for name in names:
            await api(k, "post", url(ISVCS), inference_service(name))
        op = Operator(kubeconfig, work / "operator.log", ns.autoscale_interval)
        windows = Windows(k, op, mix, work / "requests.log")
        result["windows"] = windows.rows
        try:
            async with running(windows.run(), move_load(sim, names, rng)):
                result["startup_s"], result["not_converged"] = await converge(
                    k, op, names, ns.startup_timeout
                )
                if not result["not_converged"]:
                    await under_faults(ns, k, op, mix, windows, rng, result)
        finally:
            result["exit_status"] = op.proc.poll()
            result["exited_after_s"] = (
                None if result["exit_status"] is None else round(time.monotonic() - windows.t0, 1)
            )
            killed = stop([op.proc])
            result["stop"] = {"status": op.proc.returncode, "killed": bool(killed)}
        result["simulation_errors"] = sim.errors[:10]
    return result


# --------------------------------------------------------------------------------------------
# The summary
# --------------------------------------------------------------------------------------------


# The bounds on the operator's requests (docs/operations.md, "The operator soak"), over any
# BOUND_SPAN_S. Per service: its autoscaling steps (at most AUTOSCALE_STEP_REQUESTS each, the
# documented bound of a step, failing or not), RECONCILES_PER_SPAN reconciles of at most
# reconcile_requests() each (a failing reconcile is retried after 1, 2, 4, 8, 16, 32 s, each
# drawn down to half: 8 tries in a minute), and the retries within the request of each write
# that fails for the first time (kube.BACKOFFS_S); and per change a user made to the service
# in the span, CHANGE_RECONCILES more (a change cuts the backoff short, and costs up to 3: the
# change, then its Deployment's and its pods' new status). Per watched collection (kopf's lists
# and watches, the liveness probe's list): a watch that keeps failing is retried with a backoff
# doubling from 1 s (a list and a watch each time), and the probe lists InferenceServices at
# most every 10 s, sending its list at most PROBE_ATTEMPTS times (the client's retries that fit
# in its 3 s).
BOUND_SPAN_S = 60.0
AUTOSCALE_STEP_REQUESTS = 4
RECONCILES_PER_SPAN = 8
CHANGE_RECONCILES = 3
WATCH_RETRIES_PER_SPAN = 6
PROBE_LISTS_PER_SPAN = 6
PROBE_ATTEMPTS = 3


def demo_children() -> tuple[int, int]:
    """How many children a soak's service has, and how many optional ones it does not."""
    owner = Owner(name="svc", namespace=NS, uid="u")
    children = build_children(owner, parse_spec("svc", DEMO["spec"]), CONFIG)
    return len(children), len(optional_children(owner))


def reconcile_requests() -> int:
    """The most requests of one reconcile of a soak's service: it reads the service, reads and
    writes each child, reads each optional child, lists the pods, writes the status and posts
    an Event."""
    children, optional = demo_children()
    return 1 + 2 * children + optional + 3


def service_bound(interval: float) -> int:
    """The most requests for one service in any BOUND_SPAN_S in which no user changed it."""
    steps = math.ceil(BOUND_SPAN_S / interval)
    first_failures = len(BACKOFFS_S) * (demo_children()[0] + 1)  # the children, the status
    return (
        steps * AUTOSCALE_STEP_REQUESTS
        + RECONCILES_PER_SPAN * reconcile_requests()
        + first_failures
    )


def change_allowance() -> int:
    """The requests a user's change to a service adds to its bound."""
    return CHANGE_RECONCILES * reconcile_requests()


def collection_bound() -> int:
    """The most lists and watches of one collection in any BOUND_SPAN_S."""
    return 2 * WATCH_RETRIES_PER_SPAN + PROBE_LISTS_PER_SPAN * PROBE_ATTEMPTS


def over_bound(
    windows: Sequence[dict[str, Any]],
    key: str,
    bound: int,
    allowance: int = 0,
    changes: Sequence[dict[str, Any]] = (),
) -> tuple[int, list[dict[str, Any]]]:
    """The most requests any one name of ``windows[i][key]`` had in a BOUND_SPAN_S (the
    windows ending within it), and each time one had more than ``bound``, plus ``allowance``
    for each of ``changes`` made to it ({"t", "service"}) while those windows ran."""
    most, over = 0, []
    for i, last in enumerate(windows):
        span = [w for w in windows[: i + 1] if last["t"] - w["t"] < BOUND_SPAN_S]
        start = span[0]["t"] - span[0].get("s", 0.0)
        sums: Counter[str] = Counter()
        for w in span:
            sums.update(w[key])
        for name, count in sums.items():
            most = max(most, count)
            changed = sum(
                1 for c in changes if c["service"] == name and start < c["t"] <= last["t"]
            )
            if count > bound + allowance * changed:
                over.append({"t": last["t"], "name": name, "requests": count, "changes": changed})
    return most, over


def p99(values: list[float]) -> float:
    """The nearest-rank 99th percentile; 0 of nothing."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[max(0, -(-99 * len(ordered) // 100) - 1)]


def summarize(ns: argparse.Namespace, result: dict[str, Any]) -> dict[str, Any]:
    mix: FaultMix = result["mix"]
    windows: list[dict[str, Any]] = result["windows"]
    running = [w for w in windows if w["phase"] != "startup"]
    by_kind: Counter[str] = Counter()
    for w in running:
        by_kind.update({kind: w[kind] for kind in REQUEST_KINDS})
    seconds = sum(w["s"] for w in running)
    total = sum(by_kind.values())
    per_service, per_collection = service_bound(ns.autoscale_interval), collection_bound()
    most_service, services_over = over_bound(
        windows, "per_service", per_service, change_allowance(), result["edits"]
    )
    most_collection, collections_over = over_bound(windows, "per_collection", per_collection)
    summary: dict[str, Any] = {
        "services": ns.services,
        "duration_s": ns.duration,
        "seed": ns.seed,
        "fault_kinds": list(ns.faults),
        "bookmarks": not ns.no_bookmarks,
        "autoscale_interval_s": ns.autoscale_interval,
        "startup_s": result.get("startup_s"),
        "faults_at_s": result.get("faults_at_s"),
        "converge_s": result["converge_s"],
        "not_converged": result["not_converged"],
        "exit_status": result["exit_status"],
        "exited_after_s": result["exited_after_s"],
        "stop": result["stop"],
        "health": result["health"],
        "requests": {
            "total": total,
            "by_kind": dict(by_kind),
            "per_s": round(total / seconds, 2) if seconds else 0.0,
            "per_service_per_s": round(total / seconds / ns.services, 3) if seconds else 0.0,
            "peak_per_s": max(
                (round(w["requests"] / w["s"], 1) for w in running if w["s"] >= 1), default=0.0
            ),
            "span_s": BOUND_SPAN_S,
            "service_bound": per_service,
            "per_change": change_allowance(),
            "most_for_a_service": most_service,
            "services_over_bound": len(services_over),
            "first_services_over": services_over[:10],
            "collection_bound": per_collection,
            "most_for_a_collection": most_collection,
            "collections_over_bound": len(collections_over),
            "first_collections_over": collections_over[:10],
        },
        "rss_mb": {
            "first": windows[0]["rss_mb"] if windows else None,
            "max": max((w["rss_mb"] for w in windows), default=None),
            "last": windows[-1]["rss_mb"] if windows else None,
        },
        "cpu_pct": {
            "mean": round(sum(w["cpu_pct"] * w["s"] for w in running) / seconds, 1)
            if seconds
            else 0.0,
            "max": max((w["cpu_pct"] for w in running), default=0.0),
        },
        "faults": {
            "episodes": dict(Counter(e.kind for e in mix.episodes)),
            "injected": dict(mix.injected),
            # Seconds since the operator started, as the windows' ends.
            "timeline": [e.describe(result.get("faults_at_s") or 0.0) for e in mix.episodes],
        },
        "edits": result["edits"],
        "simulation_errors": result["simulation_errors"],
        "windows": windows,
    }
    summary["failures"] = failures(summary)
    return summary


def failures(summary: dict[str, Any]) -> list[str]:
    """Why the run failed; nothing when it passed."""
    out = []
    if summary["exit_status"] is not None:
        out.append(f"the operator exited with status {summary['exit_status']} "
                   f"after {summary['exited_after_s']} s")  # fmt: skip
    health = summary["health"]
    if health is None or not health["checks"]:
        out.append("/healthz was not probed")
    elif health["failures"]:
        out.append(f"/healthz failed {health['failures']} of {health['checks']} times: "
                   f"{health['first_failures'][:2]}")  # fmt: skip
    r = summary["requests"]
    if over := r["services_over_bound"]:
        first = r["first_services_over"][0]
        out.append(f"{over} times a service had more requests than its bound of "
                   f"{r['service_bound']} (and {r['per_change']} per change to it) in "
                   f"{r['span_s']:g} s, e.g. {first['name']}: {first['requests']} by "
                   f"{first['t']:g} s, {first['changes']} changes")  # fmt: skip
    if over := r["collections_over_bound"]:
        first = r["first_collections_over"][0]
        out.append(f"{over} times a collection had more lists and watches than its bound of "
                   f"{r['collection_bound']} in {r['span_s']:g} s, e.g. {first['name']}: "
                   f"{first['requests']} by {first['t']:g} s")  # fmt: skip
    if diverged := summary["not_converged"]:
        name, why = next(iter(diverged.items()))
        out.append(f"{len(diverged)} services did not converge, e.g. {name}: {why}")
    if summary["simulation_errors"]:
        out.append(f"the cluster simulation failed: {summary['simulation_errors'][:2]}")
    return out


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=600.0, help="seconds of faults")
    p.add_argument("--services", type=int, default=20)
    p.add_argument("--seed", type=int, default=36)
    p.add_argument("--faults", default=",".join(KINDS),
                   help="the fault kinds in the mix, comma-separated; '' for none "
                   "(default: all, %(default)s)")  # fmt: skip
    p.add_argument("--mean-gap", type=float, default=8.0,
                   help="mean seconds between the starts of fault episodes")  # fmt: skip
    p.add_argument("--edit-every", type=float, default=EDIT_EVERY_S,
                   help="mean seconds between the soak's edits to the services")  # fmt: skip
    p.add_argument("--autoscale-interval", type=float, default=10.0,
                   help="the operator's --autoscale-interval (its default: 10)")  # fmt: skip
    p.add_argument("--startup-timeout", type=float, default=180.0,
                   help="seconds for the services to converge before the faults")  # fmt: skip
    p.add_argument("--converge-timeout", type=float, default=330.0,
                   help="seconds for the services to converge after the faults")  # fmt: skip
    p.add_argument("--no-bookmarks", action="store_true",
                   help="no watch bookmarks from the emulator (as kmock itself)")  # fmt: skip
    p.add_argument("--out", type=Path, help="write the summary JSON here")
    p.add_argument("--log-dir", type=Path, help="the operator's log (default: a temp dir)")
    ns = p.parse_args(argv)
    ns.faults = [kind for kind in ns.faults.split(",") if kind]
    if unknown := set(ns.faults) - set(KINDS):
        p.error(f"unknown fault kinds {sorted(unknown)}; known: {','.join(KINDS)}")
    return ns


def main(argv: Sequence[str] | None = None) -> int:
    ns = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)  # the emulator's every request
    log_dir = ns.log_dir or Path(tempfile.mkdtemp(prefix="kvfleet-operator-soak-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    summary = summarize(ns, asyncio.run(soak(ns, log_dir)))
    summary["log_dir"] = str(log_dir)
    text = json.dumps(summary, indent=2)
    if ns.out:
        ns.out.write_text(text + "\n")
    else:
        print(text)
    r, h = summary["requests"], summary["health"] or {"checks": 0, "failures": 0, "p99_ms": 0}
    injected = ", ".join(f"{k} {v}" for k, v in summary["faults"]["injected"].items())
    print(f"operator soak: {ns.services} services, {ns.duration:g} s of faults "
          f"({injected or 'none'}), {len(summary['edits'])} edits\n"
          f"  requests: {r['per_s']}/s ({r['per_service_per_s']}/s per service, peak "
          f"{r['peak_per_s']}/s); in {r['span_s']:g} s at most {r['most_for_a_service']} for "
          f"a service (bound {r['service_bound']}), {r['most_for_a_collection']} for a "
          f"collection (bound {r['collection_bound']}); {r['by_kind']}\n"
          f"  process: exit status {summary['exit_status']}, RSS MiB {summary['rss_mb']}, "
          f"CPU % {summary['cpu_pct']}; /healthz {h['checks'] - h['failures']} of "
          f"{h['checks']} ok, p99 {h['p99_ms']} ms\n"
          f"  converged: at start in {summary['startup_s']} s, after the faults in "
          f"{summary['converge_s']} s; not converged: {len(summary['not_converged'])}")  # fmt: skip
    for reason in summary["failures"]:
        logger.error("operator soak failed: %s", reason)
    return 1 if summary["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
