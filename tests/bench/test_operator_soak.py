"""bench/operator_soak.py: a short soak of the operator as its own process under the whole
fault mix, and the parts the soak is made of: the fault mix
(bench/api_faults.py), the controllers it emulates (bench/cluster_sim.py), what converged means,
the request bounds, the verdict, and the emulator's features for long runs
(tests/support/kmock.py)."""

from __future__ import annotations

import asyncio
import copy
import importlib
import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from kvfleet.operator.api import PLURALS
from kvfleet.operator.resources import Owner, build_children
from kvfleet.operator.spec import parse_spec
from tests.support.kmock import (
    DEPLOYMENTS,
    ISVCS,
    NS,
    PODS,
    APIServer,
    api,
    eventually,
    url,
)
from tests.support.scripts import ROOT, load_bench_script
from tests.support.servers import serving

soak = load_bench_script("operator_soak")
# As the soak imports them (bench/ on the path): one module each, whose constants a test may
# change for the soak too.
faults = importlib.import_module("api_faults")
sim = importlib.import_module("cluster_sim")

OPERATOR = {"User-Agent": "kvfleet-operator/test"}


# -- the soak ----------------------------------------------------------------------------------


def test_a_short_soak_survives_the_default_fault_mix(tmp_path: Path) -> None:
    """About 25 s: 4 services, 15 s of faults at a 2 s autoscaling interval (the default seed
    draws several episodes in them), an edit every 4 s on average."""
    out = tmp_path / "soak.json"
    rc = soak.main(
        ["--services", "4", "--duration", "15", "--autoscale-interval", "2", "--mean-gap", "2",
         "--edit-every", "4", "--out", str(out), "--log-dir", str(tmp_path)]
    )  # fmt: skip
    summary = json.loads(out.read_text())
    assert summary["failures"] == [], summary["failures"]
    assert rc == 0
    assert summary["exit_status"] is None and summary["stop"] == {"status": 0, "killed": False}
    assert summary["not_converged"] == {} and summary["converge_s"] is not None
    health = summary["health"]
    assert health["checks"] >= 5 and health["failures"] == 0
    faults_seen = summary["faults"]
    assert sum(faults_seen["episodes"].values()) >= 2
    assert set(faults_seen["episodes"]) <= set(summary["fault_kinds"])
    assert sum(faults_seen["injected"].values()) > 0 and summary["edits"]
    requests = summary["requests"]
    assert requests["total"] > 0 and set(requests["by_kind"]) == set(soak.REQUEST_KINDS)
    assert 0 < requests["most_for_a_service"] <= requests["service_bound"]
    assert requests["most_for_a_collection"] <= requests["collection_bound"]
    assert summary["windows"][0]["phase"] == "startup"
    assert {"faults", "converge"} <= {w["phase"] for w in summary["windows"]}
    assert all(w["rss_mb"] > 0 for w in summary["windows"])
    assert {"operator.log", "requests.log"} <= {p.name for p in tmp_path.iterdir()}


def test_the_mix_has_every_kind_unless_told_otherwise() -> None:
    assert soak.parse_args([]).faults == list(faults.KINDS)
    assert soak.parse_args(["--faults", "slow,gone"]).faults == ["slow", "gone"]
    assert soak.parse_args(["--faults", ""]).faults == []
    with pytest.raises(SystemExit):
        soak.parse_args(["--faults", "gone,flood"])


def test_the_bounds_come_from_the_design() -> None:
    # The demo's reconcile: the service, 9 children read and written, the optional download
    # and adapters ConfigMaps read, the pod list, the status, an Event.
    assert soak.reconcile_requests() == 1 + 2 * 9 + 2 + 3
    # Per minute: 6 autoscaling steps of at most 4 requests, 8 reconciles (the backoff's
    # delays drawn down to half), 3 retries of each of 10 writes failing for the first time.
    assert soak.service_bound(10.0) == 6 * 4 + 8 * 24 + 3 * 10
    assert soak.service_bound(2.0) == 30 * 4 + 8 * 24 + 3 * 10
    # A user's change: 3 reconciles more.
    assert soak.change_allowance() == 3 * 24
    # Six retries of a list and a watch, and six probe lists sent up to 3 times each.
    assert soak.collection_bound() == 6 * 2 + 6 * 3


def test_a_bound_holds_over_any_minute_not_over_each_window() -> None:
    steady = [{"t": 10.0 * i, "s": 10.0, "per_service": {"a": 30}} for i in range(1, 9)]
    most, over = soak.over_bound(steady, "per_service", 150)
    assert most == 180
    assert over[0] == {"t": 60.0, "name": "a", "requests": 180, "changes": 0}
    # Two bursts 70 s apart never share a minute.
    bursts = [{"t": 10.0, "s": 10.0, "per_service": {"b": 100}},
              {"t": 80.0, "s": 10.0, "per_service": {"b": 100}}]  # fmt: skip
    assert soak.over_bound(bursts, "per_service", 150) == (100, [])
    # A change to a service in the minute raises its bound, not another's.
    changes = [{"t": 35.0, "service": "a"}]
    both = [{"t": 10.0 * i, "s": 10.0, "per_service": {"a": 30, "c": 30}} for i in range(1, 11)]
    _, over = soak.over_bound(both, "per_service", 150, 40, changes)
    assert {(o["name"], o["t"]) for o in over} == {("c", 10.0 * i) for i in range(6, 11)} | {
        ("a", 100.0)  # the minute of the windows ending at 50 to 100 s began after the change
    }


CLEAN: dict[str, Any] = {
    "exit_status": None,
    "exited_after_s": None,
    "health": {"checks": 10, "failures": 0, "first_failures": []},
    "requests": {
        "span_s": 60.0,
        "service_bound": 238,
        "per_change": 69,
        "services_over_bound": 0,
        "first_services_over": [],
        "collection_bound": 30,
        "collections_over_bound": 0,
        "first_collections_over": [],
    },
    "not_converged": {},
    "simulation_errors": [],
}
OVER = [{"t": 70.0, "name": "svc-03", "requests": 300, "changes": 0}]


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"exit_status": 1, "exited_after_s": 31.0}, "exited with status 1 after 31.0 s"),
        ({"health": None}, "/healthz was not probed"),
        ({"health": {"checks": 10, "failures": 2, "first_failures": ["x"]}}, "failed 2 of 10"),
        ({"requests": {**CLEAN["requests"], "services_over_bound": 3,
                       "first_services_over": OVER}},
         "3 times a service had more requests than its bound of 238 (and 69 per change to it) "
         "in 60 s, e.g. svc-03: 300 by 70 s, 0 changes"),
        ({"requests": {**CLEAN["requests"], "collections_over_bound": 1,
                       "first_collections_over": [{"t": 9, "name": "pods", "requests": 900}]}},
         "a collection had more lists and watches than its bound of 30"),
        ({"not_converged": {"svc-01": "Ready is False"}}, "1 services did not converge"),
        ({"simulation_errors": ["boom"]}, "the cluster simulation failed"),
    ],
)  # fmt: skip
def test_each_kind_of_trouble_fails_the_soak(change: dict[str, Any], reason: str) -> None:
    assert soak.failures(CLEAN) == []
    (failure,) = soak.failures({**CLEAN, **change})
    assert reason in failure


# -- what converged means ----------------------------------------------------------------------


def converged(name: str = "svc-00") -> dict[tuple[str, str], dict[str, Any]]:
    """The objects of a service as the operator leaves them when it has converged."""
    isvc = soak.inference_service(name)
    isvc["metadata"] |= {"uid": "u1", "generation": 2}
    isvc["status"] = {
        "observedGeneration": 2,
        "desiredReplicas": 2,
        "conditions": [
            {"type": "Ready", "status": "True"},
            {"type": "Degraded", "status": "False"},
        ],
    }
    owner = Owner(name=name, namespace=NS, uid="u1")
    objects = {(ISVCS, name): isvc}
    for child in build_children(owner, parse_spec(name, isvc["spec"]), soak.CONFIG, 2):
        key = (f"{child['apiVersion']}/{PLURALS[child['kind']]}", child["metadata"]["name"])
        objects[key] = copy.deepcopy(child)
    return objects


def engine_image(objects: dict[tuple[str, str], dict[str, Any]]) -> dict[str, Any]:
    (container,) = objects[DEPLOYMENTS, "svc-00-engine"]["spec"]["template"]["spec"]["containers"]
    return container


@pytest.mark.parametrize(
    ("damage", "said"),
    [
        (lambda o: o.pop((ISVCS, "svc-00")), "does not exist"),
        (lambda o: o[ISVCS, "svc-00"]["status"].update(observedGeneration=1),
         "status observed generation 1, not 2"),
        (lambda o: o.pop((DEPLOYMENTS, "svc-00-engine")),
         "Deployment/svc-00-engine does not exist"),
        (lambda o: o["v1/services", "svc-00"]["metadata"]["ownerReferences"][0].update(uid="u0"),
         "Service/svc-00 is not controlled by it"),
        (lambda o: o[DEPLOYMENTS, "svc-00-engine"]["spec"].update(replicas=1),
         "Deployment/svc-00-engine differs from its spec"),
        (lambda o: engine_image(o).update(image="evil:1"), "svc-00-engine differs from its spec"),
        (lambda o: o["v1/services", "svc-00"]["spec"]["selector"].update(app="evil"),
         "Service/svc-00 keeps spec.selector"),
        (lambda o: o.update({("v1/configmaps", "svc-00-model-download"): {}}),
         "ConfigMap/svc-00-model-download is no longer asked for but exists"),
        (lambda o: o[ISVCS, "svc-00"]["status"]["conditions"][1].update(status="True"),
         "Degraded is True"),
        (lambda o: o[ISVCS, "svc-00"]["status"]["conditions"][0].update(status="False"),
         "Ready is False"),
        (lambda o: o[ISVCS, "svc-00"]["status"].update(
            autoscaling={"failure": {"reason": "APIError", "message": "m"}}),
         "autoscaling failure APIError"),
    ],
)  # fmt: skip
def test_divergence_names_what_is_not_converged(damage: Any, said: str) -> None:
    objects = converged()
    assert soak.divergence(objects, "svc-00") is None
    damage(objects)
    assert said in (soak.divergence(objects, "svc-00") or "")


# -- the fault mix -----------------------------------------------------------------------------


def mix_of(*episodes: Any) -> Any:
    mix = faults.FaultMix(1, [], 60.0, collections=soak.WATCHED, services=["svc-01"])
    mix.episodes = list(episodes)
    return mix


async def answer(k: APIServer, method: str, path: str, **kwargs: Any) -> tuple[Any, bytes]:
    """The status (or the client's error) and body of a request; as the operator's unless
    headers say otherwise."""
    kwargs.setdefault("headers", OPERATOR)
    try:
        async with k.request(method, path, **kwargs) as resp:
            return resp.status, await resp.read()
    except aiohttp.ClientError as e:
        return type(e).__name__, b""


def test_the_mix_is_drawn_from_its_seed() -> None:
    def timeline(seed: int, kinds: list[str]) -> list[str]:
        mix = faults.FaultMix(seed, kinds, 300.0, collections=soak.WATCHED, services=["a", "b"])
        assert all(0 < e.start <= e.end <= 300.0 for e in mix.episodes)
        return [e.describe() for e in mix.episodes]

    assert timeline(7, list(faults.KINDS)) == timeline(7, list(faults.KINDS))
    assert timeline(7, list(faults.KINDS)) != timeline(8, list(faults.KINDS))
    only = {line.split()[1] for line in timeline(7, ["slow", "reset"])}
    assert only == {"slow", "reset"}
    assert timeline(7, []) == []
    with pytest.raises(ValueError, match="unknown fault kinds"):
        faults.FaultMix(7, ["flood"], 60.0, collections=(), services=())


@pytest.mark.asyncio
async def test_gone_answers_410_to_the_next_lists_and_watches_of_its_collection(cluster):
    mix = mix_of(faults.Episode("gone", 0.0, 60.0, "pods", times=2))
    cluster.faults.append(mix)
    mix.start()
    try:
        assert (await answer(cluster, "get", url(DEPLOYMENTS)))[0] == 200
        assert (await answer(cluster, "get", url(PODS), headers={}))[0] == 200  # not the operator
        assert (await answer(cluster, "get", url(PODS)))[0] == 410
        assert (await answer(cluster, "get", url(PODS) + "?watch=true"))[0] == 410
        assert (await answer(cluster, "get", url(PODS)))[0] == 200  # two answers given
        assert mix.injected == {"gone": 2}
    finally:
        mix.stop()


@pytest.mark.asyncio
async def test_ended_answers_watches_of_its_collection_with_a_stream_that_ends_at_once(cluster):
    mix = mix_of(faults.Episode("ended", 0.0, 60.0, "deployments"))
    cluster.faults.append(mix)
    mix.start()
    try:
        watch = url(DEPLOYMENTS) + "?watch=true"
        assert await asyncio.wait_for(answer(cluster, "get", watch), 5) == (200, b"")
        status, body = await answer(cluster, "get", url(DEPLOYMENTS))  # a list is served
        assert status == 200 and json.loads(body)["items"] == []
    finally:
        mix.stop()


@pytest.mark.asyncio
@pytest.mark.parametrize(("kind", "status"), [("conflict", 409), ("error", 500)])
async def test_write_faults_answer_every_write_to_one_services_objects(cluster, kind, status):
    for name in ("svc-01", "svc-02"):
        await api(cluster, "post", url(ISVCS), soak.inference_service(name))
    mix = mix_of(faults.Episode(kind, 0.0, 60.0, "svc-01"))
    cluster.faults.append(mix)
    mix.start()
    try:
        patch = {"status": {"desiredReplicas": 2}}
        for path in (url(ISVCS, "svc-01", "status"), url(DEPLOYMENTS, "svc-01-engine")):
            assert (await answer(cluster, "patch", path, json=patch))[0] == status
        assert (await answer(cluster, "get", url(ISVCS, "svc-01")))[0] == 200
        assert (await answer(cluster, "patch", url(ISVCS, "svc-02", "status"), json=patch))[
            0
        ] == 200
        yours = await answer(
            cluster, "patch", url(ISVCS, "svc-01", "status"), json=patch, headers={}
        )
        assert yours[0] == 200
        assert mix.injected == {kind: 2}
    finally:
        mix.stop()


@pytest.mark.asyncio
async def test_slow_holds_requests_and_reset_closes_their_connections(cluster, monkeypatch):
    monkeypatch.setattr(faults, "SLOW_SHARE", 1.0)
    monkeypatch.setattr(faults, "SLOW_S", (0.5, 0.5))
    monkeypatch.setattr(faults, "RESET_SHARE", 1.0)
    mix = mix_of(faults.Episode("slow", 0.0, 60.0))
    cluster.faults.append(mix)
    mix.start()
    try:
        loop = asyncio.get_running_loop()
        start = loop.time()
        assert (await answer(cluster, "get", url(PODS)))[0] == 200
        assert loop.time() - start >= 0.5
        mix.episodes = [faults.Episode("reset", 0.0, 60.0)]
        assert (await answer(cluster, "get", url(PODS)))[0] in (
            "ServerDisconnectedError",
            "ClientOSError",
        )
        assert (await answer(cluster, "get", url(PODS), headers={}))[0] == 200
        # aiohttp sends a request again once when a connection it reused was closed.
        assert mix.injected["slow"] == 1 and mix.injected["reset"] >= 1
    finally:
        mix.stop()


@pytest.mark.asyncio
async def test_an_episode_that_starts_cuts_the_open_watches_of_its_collection(cluster):
    mix = mix_of(faults.Episode("gone", 0.3, 60.0, "pods", times=1))
    cluster.faults.append(mix)
    watch = "?watch=true"
    async with (
        cluster.request("get", url(PODS) + watch, headers=OPERATOR) as pods,
        cluster.request("get", url(DEPLOYMENTS) + watch, headers=OPERATOR) as deployments,
    ):
        mix.start()
        try:
            with pytest.raises(aiohttp.ClientPayloadError):
                await asyncio.wait_for(pods.content.read(), 5)
            assert mix.injected == {"gone_cut": 1}
            with pytest.raises(TimeoutError):  # another collection's watch goes on
                await asyncio.wait_for(deployments.content.read(), 0.5)
        finally:
            mix.stop()


# -- the emulated controllers ------------------------------------------------------------------


@pytest.mark.asyncio
async def test_the_simulation_runs_deployments_and_collects_the_garbage(cluster):
    k = cluster
    isvc = await api(k, "post", url(ISVCS), soak.inference_service("svc-00"))
    owner = Owner(name="svc-00", namespace=NS, uid=isvc["metadata"]["uid"])
    spec = parse_spec("svc-00", isvc["spec"])
    children = build_children(owner, spec, soak.CONFIG, 2)
    (engine,) = [c for c in children if c["metadata"]["name"] == "svc-00-engine" and
                 c["kind"] == "Deployment"]  # fmt: skip
    await api(k, "post", url(DEPLOYMENTS), engine)
    async with sim.simulated(k) as cluster_sim:
        cluster_sim.load["svc-00"] = 6.0

        def ready() -> list[dict[str, Any]]:
            """two Ready engine pods and the Deployment's status saying so"""
            pods = [p for p in k.every(PODS) if p.get("status", {}).get("podIP")]
            status = k.live(DEPLOYMENTS, NS, "svc-00-engine").get("status") or {}
            return pods if len(pods) == 2 and status.get("readyReplicas") == 2 else []

        pods = await eventually(ready)
        (container,) = pods[0]["spec"]["containers"]
        (port,) = [p["containerPort"] for p in container["ports"] if p["name"] == "http"]
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"http://127.0.0.1:{port}/metrics") as resp,
        ):
            text = await resp.text()
        # The service's 6 requests in flight, shared by its 2 engines.
        assert 'vllm:num_requests_running{model_name="smollm2-135m-instruct"} 3.0' in text

        await api(k, "delete", url(ISVCS, "svc-00"))
        await eventually(lambda: not k.every(PODS) and not k.every(DEPLOYMENTS))
        assert cluster_sim.errors == []


# -- the emulator in long runs -----------------------------------------------------------------


class Hold:
    """Holds the requests for one path until released."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.release = asyncio.Event()

    async def answer(self, request: Any) -> None:
        if request.url.path == self.path:
            await self.release.wait()


@pytest.mark.asyncio
async def test_requests_leave_kmocks_log_once_answered_unless_they_wait(cluster):
    k = cluster
    k.served = []
    hold = Hold(url(PODS, "held"))
    k.faults.append(hold)
    held = asyncio.create_task(answer(k, "get", url(PODS, "held")))
    await eventually(lambda: len(list(k)) == 1)
    for _ in range(5):
        assert (await answer(k, "get", url(PODS)))[0] == 200
    # The held request waits in the log; the last one answered leaves with the next request.
    assert [r.url.path for r in list(k)] == [url(PODS, "held"), url(PODS)]
    assert len(k.served) == 4
    hold.release.set()
    assert (await held)[0] == 404  # still found its reaction: there is no such pod
    assert [r.url.path for r in k.forget_served()] == [url(PODS, "held"), url(PODS)]
    assert list(k) == []


@pytest.mark.asyncio
async def test_a_watch_that_allows_bookmarks_gets_one_after_a_quiet_spell(cluster):
    k = cluster
    k.bookmark_every = 0.2
    await api(k, "post", url(PODS), {"apiVersion": "v1", "kind": "Pod",
                                     "metadata": {"name": "p", "namespace": NS}})  # fmt: skip
    async with k.request("get", url(PODS) + "?watch=true&allowWatchBookmarks=true") as watch:
        added = json.loads(await asyncio.wait_for(watch.content.readline(), 5))
        assert (added["type"], added["object"]["metadata"]["name"]) == ("ADDED", "p")
        bookmark = json.loads(await asyncio.wait_for(watch.content.readline(), 5))
        assert bookmark["type"] == "BOOKMARK" and bookmark["object"]["metadata"]["resourceVersion"]
    async with k.request("get", url(PODS) + "?watch=true") as watch:
        assert json.loads(await asyncio.wait_for(watch.content.readline(), 5))["type"] == "ADDED"
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(watch.content.readline(), 0.6)


# -- the probe ---------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_the_probe_takes_a_path_and_reports_when_stopped_early() -> None:
    async def healthz(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    async with serving(app) as address:
        probe = await asyncio.create_subprocess_exec(
            sys.executable, str(ROOT / "bench" / "health_probe.py"), "--duration", "60",
            "--interval", "0.1", "--path", "/healthz", f"http://{address}",
            stdout=subprocess.PIPE,
        )  # fmt: skip
        await asyncio.sleep(1.5)
        probe.send_signal(signal.SIGTERM)
        out, _ = await asyncio.wait_for(probe.communicate(), 10)
    assert probe.returncode == 0
    (seen,) = json.loads(out).values()
    assert len(seen["latencies_ms"]) >= 3 and seen["failures"] == []
