"""Issue 36: a relist that changes nothing reconciles nothing.

kopf ends a watch that saw no event for its inactivity timeout (70 s) and watches again; without
bookmarks a real API server then answers an expired resourceVersion with 410 and kopf lists
again, and the emulator replays every object on a new watch. Each object of such a relist comes
to the handlers once more; only the ones whose resourceVersion moved, or that are gone, may cost
a reconcile.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
from collections.abc import AsyncIterator

import pytest

from kvfleet.operator.main import build_registry, build_settings
from tests.support.kmock import (
    CONFIG,
    DEMO,
    DEPLOYMENTS,
    ISVCS,
    NS,
    APIServer,
    by_operator,
    child_names,
    children_of,
    condition,
    create,
    emulated_cluster,
    eventually,
    kube_for,
    run_operator,
    settled,
    url,
)

pytestmark = pytest.mark.asyncio

SERVICES = 5
SERVICE_ACCOUNTS = "v1/serviceaccounts"
# How long a relist's events may pause before the objects it did not bring count as deleted.
RELIST_SETTLE = 1.0


@contextlib.asynccontextmanager
async def operator(k: APIServer, inactivity: float | None = None) -> AsyncIterator[None]:
    """The operator without autoscaling steps (an hour apart), so that every request it makes
    while the services are settled comes from a reconcile; `inactivity` shortens kopf's 70 s."""
    settings = build_settings()
    if inactivity is not None:
        settings.watching.inactivity_timeout = inactivity
    registry = build_registry(
        settings,
        CONFIG,
        debounce=0.02,
        backoff=0.2,
        autoscale_interval=3600,
        kube=kube_for(k),
        relist_settle=RELIST_SETTLE,
    )
    async with run_operator(registry, settings):
        yield


def reconciling(k: APIServer, since: int) -> list[str]:
    """The operator's own requests (not kopf's lists, watches and Events) since `since`."""
    return [
        f"{r.method.value} {r.url.path}"
        for r in by_operator(k, since)
        if r.headers.get("User-Agent", "").startswith("kvfleet-operator/")
    ]


def reconciled(k: APIServer, since: int) -> set[str]:
    prefix = f"GET {url(ISVCS)}/"
    return {r.removeprefix(prefix) for r in reconciling(k, since) if r.startswith(prefix)}


def watched(k: APIServer, since: int = 0) -> set[str]:
    return {r.url.path for r in by_operator(k, since) if r.params.get("watch") == "true"}


async def relist(k: APIServer, settle: float = RELIST_SETTLE) -> int:
    """End every watch and wait until each collection is watched anew (the emulator replays
    every object to a new watch) and the relist has settled; the mark of the request before."""
    before = watched(k)
    mark = len(k)
    k.end_watches()
    await eventually(lambda: watched(k, mark) >= before, timeout=30)
    await settled(k, quiet=settle + 0.5)
    return mark


async def start(k: APIServer, services: int = SERVICES) -> None:
    for i in range(services):
        await create(k, DEMO, f"svc-{i}")

    def converged() -> bool:
        return all(
            condition(k.live(ISVCS, NS, f"svc-{i}"), "Ready")
            and set(children_of(k, f"svc-{i}")) == child_names(f"svc-{i}")
            for i in range(services)
        )

    await eventually(converged, timeout=60)
    await settled(k, quiet=RELIST_SETTLE + 0.5)


async def test_a_relist_that_changes_nothing_reconciles_nothing(cluster):
    k = cluster
    async with operator(k):
        await start(k)
        for _ in range(2):
            mark = await relist(k)
            assert reconciling(k, mark) == [], reconciled(k, mark)


async def test_a_change_made_while_unwatched_is_reconciled_after_the_relist(cluster):
    k = cluster
    async with operator(k):
        await start(k, 3)
        # Changed with no watch event, as while no watch was open: a new resourceVersion.
        k.change_unwatched(DEPLOYMENTS, NS, "svc-0-engine", {"spec": {"replicas": 5}})
        spec = copy.deepcopy(DEMO["spec"])
        spec["engine"]["maxNumSeqs"] = 8
        k.change_unwatched(ISVCS, NS, "svc-1", {"spec": spec})
        mark = await relist(k)

        assert k.live(DEPLOYMENTS, NS, "svc-0-engine")["spec"]["replicas"] == 1
        engine = k.live(DEPLOYMENTS, NS, "svc-1-engine")
        args = engine["spec"]["template"]["spec"]["containers"][0]["args"]
        assert args[args.index("--max-num-seqs") + 1] == "8"
        # Those two only: each reconcile begins by reading its InferenceService.
        assert reconciled(k, mark) == {"svc-0", "svc-1"}


async def test_a_child_deleted_while_unwatched_is_recreated_after_the_relist(cluster):
    k = cluster
    async with operator(k):
        await start(k, 3)
        # Gone with no watch event: a relist is how the operator learns of it.
        k.objects[SERVICE_ACCOUNTS, NS, "svc-0-router"].delete()
        k.objects[DEPLOYMENTS, NS, "svc-1-router"].delete()
        mark = await relist(k)
        await eventually(lambda: k.live(SERVICE_ACCOUNTS, NS, "svc-0-router"))
        await eventually(lambda: k.live(DEPLOYMENTS, NS, "svc-1-router"))
        assert reconciled(k, mark) == {"svc-0", "svc-1"}


@pytest.mark.parametrize("bookmarks", [None, 0.2])
async def test_bookmarks_keep_quiet_watches_open(bookmarks):
    """kopf asks for bookmarks; the emulator's keep a quiet watch from being ended after kopf's
    inactivity timeout, which without them ends each watch, and the next replays every
    object."""
    inactivity = 1.0
    async with emulated_cluster() as k:
        k.bookmark_every = bookmarks
        async with operator(k, inactivity):
            await create(k, DEMO, "svc")
            await eventually(lambda: condition(k.live(ISVCS, NS, "svc"), "Ready"))
            if bookmarks:
                # A watch can still end while the operator is busy creating the children (an
                # event loop held past the timeout on a slow machine) and is opened again after
                # a backoff: those watches are not the quiet ones this is about.
                await settled(k, quiet=2 * inactivity)
            mark = len(k)
            await asyncio.sleep(3 * inactivity)
            assert all(
                r.params.get("allowWatchBookmarks") == "true"
                for r in by_operator(k)
                if r.params.get("watch")
            )
            if bookmarks:
                assert watched(k, mark) == set()
            else:
                assert "/apis/kvfleet.dev/v1alpha1/inferenceservices" in watched(k, mark)
