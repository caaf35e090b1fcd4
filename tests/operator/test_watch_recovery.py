"""operator/watch_recovery.py: when a failing watch stream of kopf's may list or watch again
(pure), the kopf release its patch was written for, and the liveness probe's view of a stream
that keeps failing. The wrappers under kopf, on the emulator: test_operator_faults.py."""

from __future__ import annotations

import asyncio
import re
import tomllib
from importlib.metadata import version
from pathlib import Path
from typing import Any

import kopf
import pytest
from kopf._cogs.clients import watching

from kvfleet.operator import watch_recovery
from kvfleet.operator.kube import Kube
from kvfleet.operator.main import WATCHER_TASK_PREFIX, WatchBackoffs, WatchProbe, build_registry
from kvfleet.operator.watch_recovery import HEALTHY_STREAM_S, KOPF_SERIES, WatchPacer
from tests.support.kmock import CONFIG

ROOT = Path(__file__).resolve().parents[2]


def bounds(failures: int, first: float = 1.0, cap: float = 30.0) -> tuple[float, float]:
    """The range WatchBackoffs draws the n-th delay in a row from."""
    delay = min(first * 2 ** (failures - 1), cap)
    return delay / 2, delay


def test_a_stream_that_ends_at_once_waits_longer_each_time_up_to_the_cap():
    pacer = WatchPacer(WatchBackoffs())
    assert pacer.delay == 0.0  # a working stream waits for nothing
    now = 100.0
    for n in range(1, 12):
        pacer.opened(now)
        pacer.ended(now + 0.001)  # no event
        low, high = bounds(n)
        assert low <= pacer.delay <= high, (n, pacer.delay)
        assert pacer.failures == n
        now += pacer.delay
    assert pacer.delay >= 15.0  # capped at 30 s, jittered down to half of it at most


def test_an_event_or_a_stream_open_long_enough_starts_the_backoff_again():
    pacer = WatchPacer(WatchBackoffs())
    for _ in range(5):
        pacer.failed(0.0)
    assert pacer.delay >= bounds(5)[0]
    pacer.opened(1.0)
    pacer.event(1.5)
    assert (pacer.delay, pacer.failures) == (0.0, 0)
    pacer.ended(2.0)  # after an event: not a failure
    assert pacer.delay == 0.0

    for _ in range(5):
        pacer.failed(3.0)
    pacer.opened(10.0)
    pacer.ended(10.0 + HEALTHY_STREAM_S - 0.1)  # no event, not open long enough
    assert pacer.failures == 6
    pacer.opened(100.0)
    pacer.ended(100.0 + HEALTHY_STREAM_S)  # no event, but it stayed open: an idle cluster
    assert (pacer.delay, pacer.failures) == (0.0, 0)
    # After a reset, the first delay again.
    pacer.failed(200.0)
    assert bounds(1)[0] <= pacer.delay <= bounds(1)[1]


def test_a_completed_list_ends_failing_but_not_the_backoff():
    """A watch answered 410 after every list: the lists keep coming slower, while the operator,
    which sees every object at each list, counts as working."""
    pacer = WatchPacer(WatchBackoffs())
    pacer.failed(10.0)
    pacer.failed(11.0)
    assert pacer.failing_for(50.0) == 40.0
    pacer.listed(60.0)
    assert pacer.failing_for(61.0) == 0.0
    assert pacer.delay == 0.0  # its watch goes at once
    pacer.failed(62.0)
    assert pacer.failures == 3 and bounds(3)[0] <= pacer.delay
    assert pacer.failing_for(70.0) == 8.0


def test_failing_for_counts_from_the_first_failure_until_the_stream_works():
    pacer = WatchPacer(WatchBackoffs())
    assert pacer.failing_for(5.0) == 0.0
    pacer.opened(10.0)
    pacer.ended(10.0)
    pacer.opened(12.0)
    pacer.ended(12.0)
    assert pacer.failing_for(20.0) == 10.0
    pacer.opened(20.0)  # open, no event yet: still failing
    assert pacer.failing_for(25.0) == 15.0
    assert pacer.failing_for(20.0 + HEALTHY_STREAM_S) == 0.0  # open long enough
    pacer.paused()  # kopf paused it (peering): nothing to judge
    assert pacer.failing_for(1000.0) == 0.0


def test_kopfs_finite_and_fixed_backoffs_repeat_their_last_delay():
    pacer = WatchPacer((1.0, 2.0))
    delays = []
    for _ in range(4):
        pacer.failed(0.0)
        delays.append(pacer.delay)
    assert delays == [1.0, 2.0, 2.0, 2.0]
    fixed = WatchPacer(0.5)
    fixed.failed(0.0)
    fixed.failed(0.0)
    assert fixed.delay == 0.5


def test_kopf_is_the_release_the_patch_was_written_for():
    """pyproject pins kopf to the series watch_recovery checks at import; the installed kopf is
    in it, and building the operator puts the wrappers in kopf's place."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (pin,) = [d for d in deps if re.match(r"kopf\b", d)]
    major, minor = KOPF_SERIES.rstrip(".").split(".")
    assert pin == f"kopf>=1.45.2,<{major}.{int(minor) + 1}", pin
    assert version("kopf").startswith(KOPF_SERIES)
    build_registry(kopf.OperatorSettings(), CONFIG, kube=Kube())
    assert watching.continuous_watch is watch_recovery.continuous_watch
    assert watching.watch_objs is watch_recovery.watch_objs


def test_kopf_internals_that_moved_fail_the_import(monkeypatch):
    async def watch_objs(*, settings: Any, resource: Any) -> Any:
        yield None

    monkeypatch.setattr(watching, "watch_objs", watch_objs)
    with pytest.raises(ImportError, match="watch_objs takes other parameters"):
        watch_recovery._check_kopf()
    monkeypatch.delattr(watching, "continuous_watch")
    with pytest.raises(ImportError, match="continuous_watch is gone"):
        watch_recovery._check_kopf()


class FakeKube:
    async def list(self, url: str, label_selector: str) -> list[dict[str, Any]]:
        return []


@pytest.mark.asyncio
async def test_the_probe_fails_once_a_watch_stream_has_failed_too_long():
    now = [0.0]
    probe = WatchProbe(FakeKube(), [], stale_after=300, clock=lambda: now[0])  # type: ignore[arg-type]
    stop = asyncio.Event()
    watcher = asyncio.create_task(stop.wait(), name=f"{WATCHER_TASK_PREFIX}inferenceservices")
    pacer = watch_recovery.PACERS[watcher] = WatchPacer(WatchBackoffs())
    try:
        assert await probe.check() == "watching"
        pacer.opened(0.0)
        pacer.ended(0.0)  # ended at once, and again and again
        now[0] = 299.0
        assert "recovering inferenceservices for 299s" in await probe.check()
        now[0] = 300.0
        with pytest.raises(kopf.PermanentError, match="inferenceservices for 300s"):
            await probe.check()
        pacer.event(301.0)  # it works again
        now[0] = 302.0
        assert await probe.check() == "watching"
    finally:
        stop.set()
        await watcher
