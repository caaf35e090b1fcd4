"""kvfleet-operator: run the operator, or print the RBAC it needs.

    kvfleet-operator run [-n NAMESPACE]... [--peering NAME] [--health-address HOST:PORT]
                         [--allowed-images LIST] [--allowed-secrets LIST]
    kvfleet-operator print-rbac [-n NAMESPACE]... [--service-account NS/NAME]

With no namespace it serves all of them (and needs the ClusterRole that print-rbac prints); with
namespaces, only those (a Role in each: print-rbac -n). Several replicas are safe: every write is
idempotent (children are created once, 409 from a racing replica is absorbed, applies converge,
status is a function of the cluster), so two active replicas only duplicate reads and Events.
``--peering`` (kopf's ClusterKopfPeering/KopfPeering objects, created by the chart) keeps one
replica active and the others on standby, each with a random priority.

Under API faults (docs/operations.md, "API outages"): every request kopf makes, watches
included, is retried without end with exponential backoff and jitter (WatchBackoffs), so an
outage of any length is waited out instead of ending the process. A watch stream that fails
otherwise (an answer kopf does not retry, such as 410, an ERROR event, a stream that ends at once
with no event, a dropped connection) is listed or watched again in the process, after a wait
that grows with each failure in a row, and RECONNECT_S (jittered per process) before a list
(watch_recovery, which wraps kopf's watch: no public setting of kopf's reaches it). /healthz
fails when the operator can no longer watch: a watch task of kopf's has ended, one of its watch
streams has failed for WATCH_STALE_S with nothing listed or received since, or listing
InferenceServices has failed for WATCH_STALE_S. The operator's own writes are retried within
the request on a transient failure; an object whose writes keep failing is then written once
per reconcile, at the work queue's growing backoff, and by the autoscaler only after the
object's own backoff (kube.py). A failed status write is reported in an Event, a metric and the
log (status_writer.py).
Prometheus metrics (kvfleet_operator_*) are served at --metrics-address.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import socket
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import kopf
import prometheus_client
import yaml
from pydantic import ValidationError

from kvfleet.operator import watch_recovery
from kvfleet.operator.api import GROUP, MANAGED_BY, PLURAL, VERSION
from kvfleet.operator.autoscaler import Autoscaler
from kvfleet.operator.config import OperatorConfig, RunSettings
from kvfleet.operator.kube import Kube, NoClusterError, resource_url
from kvfleet.operator.rbac import cluster_role, namespaced_role, namespaced_role_binding
from kvfleet.operator.reconciler import RELIST_SETTLE_S, Reconciler, WorkQueue, register
from kvfleet.operator.status_writer import StatusWriter
from kvfleet.telemetry.logs import add_log_flags, configure_logging
from kvfleet.telemetry.settings_flags import COMMA_LIST, add_model_flags, flag_values, one_line

logger = logging.getLogger("kvfleet.operator")

FIRST_BACKOFF_S = 1.0
MAX_BACKOFF_S = 30.0
RECONNECT_S = 1.0  # .. 2 x this, per process
# API servers end a watch after timeoutSeconds; the client gives up a little later, so a
# connection a load balancer dropped silently is noticed too.
WATCH_SERVER_TIMEOUT_S = 300
WATCH_CLIENT_TIMEOUT_S = 330
CONNECT_TIMEOUT_S = 10.0
REQUEST_TIMEOUT_S = 60.0
WATCH_STALE_S = 300.0
PROBE_LIST_TIMEOUT_S = 3.0  # under the chart's livenessProbe timeoutSeconds (5)
WATCHER_TASK_PREFIX = "watcher for "  # how kopf names its watch tasks
# A setting that is not valid exits 2, as argparse's usage errors do.
EXIT_USAGE = 2


class WatchBackoffs:
    """kopf's retry delays for a failed request, and watch_recovery's between failing watches:
    exponential from FIRST_BACKOFF_S to MAX_BACKOFF_S with jitter, and unbounded. kopf's default
    is eight delays (54 s in all), after which the request's error escalates. Iterable anew for
    each request (kopf iterates it per request), and not Sized, which tells kopf there is no
    last attempt."""

    def __init__(self, first: float = FIRST_BACKOFF_S, cap: float = MAX_BACKOFF_S) -> None:
        self.first, self.cap = first, cap

    def __iter__(self) -> Iterator[float]:
        rng = random.Random()
        delay = self.first
        while True:
            # Half fixed, half random: replicas and watches that failed together spread out.
            yield rng.uniform(delay / 2, delay)
            delay = min(delay * 2, self.cap)


def build_settings(peering: str | None = None) -> kopf.OperatorSettings:
    settings = kopf.OperatorSettings()
    settings.networking.error_backoffs = WatchBackoffs()
    settings.networking.connect_timeout = CONNECT_TIMEOUT_S
    settings.networking.request_timeout = REQUEST_TIMEOUT_S
    settings.watching.server_timeout = WATCH_SERVER_TIMEOUT_S
    settings.watching.client_timeout = WATCH_CLIENT_TIMEOUT_S
    settings.watching.connect_timeout = CONNECT_TIMEOUT_S
    # A float in kopf: drawn once per process, so replicas that lost the API together do not
    # come back in step.
    settings.watching.reconnect_backoff = RECONNECT_S * random.uniform(1.0, 2.0)
    # No list/watch of CRDs (least privilege): the InferenceService CRD must exist when the
    # operator starts, which the chart guarantees by installing CRDs first.
    settings.scanning.disabled = True
    settings.posting.reporting_component = MANAGED_BY
    settings.posting.reporting_instance = socket.gethostname()
    settings.posting.event_name_prefix = "kvfleet-"
    if peering:
        settings.peering.name = peering
        settings.peering.mandatory = True
        settings.peering.stealth = True
        # Distinct priorities: the highest is active, the others pause until it stops.
        settings.peering.priority = random.SystemRandom().randint(1, 2**31 - 1)
    else:
        settings.peering.standalone = True
    return settings


def build_registry(
    settings: kopf.OperatorSettings,
    config: OperatorConfig,
    *,
    debounce: float = 0.1,
    backoff: float = 1.0,
    autoscale_interval: float = 10.0,
    scrape_timeout: float = 2.0,
    clock: Callable[[], float] = time.time,
    kube: Kube | None = None,
    namespaces: Sequence[str] = (),
    watch_stale_s: float = WATCH_STALE_S,
    relist_settle: float = RELIST_SETTLE_S,
) -> kopf.OperatorRegistry:
    """A registry with the operator's handlers; kopf logs in with the credentials of the
    operator's own client (by default the ServiceAccount in a pod, else the kubeconfig).

    clock: seconds since the epoch, for the autoscaler's windows (tests pass a fake one).
    namespaces: those served (none: all), where the liveness probe lists InferenceServices."""
    watch_recovery.install()
    registry = kopf.OperatorRegistry()
    api = kube or Kube()
    # One for both writers of the status: a failure to write it is reported once per cause.
    status = StatusWriter(api)
    reconciler = Reconciler(api, config, status)
    autoscaler = Autoscaler(
        api, status, interval=autoscale_interval, scrape_timeout=scrape_timeout, clock=clock
    )
    register(
        registry,
        settings,
        WorkQueue(reconciler.reconcile, debounce=debounce, backoff=backoff),
        autoscaler,
        relist_settle=relist_settle,
    )
    kopf.on.login(registry=registry)(api.login)
    probe = WatchProbe(api, namespaces, stale_after=watch_stale_s, clock=time.monotonic)
    # A bound method: kopf runs a callable object that is not a coroutine function in a thread.
    kopf.on.probe(id="watching", registry=registry)(probe.check)

    # After the queue's cleanup (kopf runs them in order): its last requests use the client.
    @kopf.on.cleanup(registry=registry)
    async def close_client(**_: Any) -> None:
        await reconciler.close()
        await api.close()

    return registry


class WatchProbe:
    """kopf's liveness probe (raising fails /healthz): whether the operator can still watch.

    kopf keeps no public record of its watches, so three signs are checked: a watch task of
    kopf's that has ended while the operator runs (watch_recovery keeps them going through any
    error of the API server's, so only a bug or a failed login ends one); a watch stream of one
    that has failed for stale_after seconds with nothing listed or received since (its
    WatchPacer); and a list of InferenceServices, the collection the operator watches, that has
    not succeeded for stale_after seconds. A stream that recovers within stale_after is healthy:
    a restart would do no more than list again. The list asks for a label nothing carries, so
    its answer is empty whatever the cluster holds; kopf calls a probe at most every 10 s.

    clock: time.monotonic, which watch_recovery times the streams by (tests pass a fake one)."""

    def __init__(
        self,
        api: Kube,
        namespaces: Sequence[str],
        *,
        stale_after: float,
        clock: Callable[[], float],
    ) -> None:
        self._api = api
        self._url = (
            resource_url(f"{GROUP}/{VERSION}", PLURAL, namespaces[0])
            if namespaces
            else f"/apis/{GROUP}/{VERSION}/{PLURAL}"
        )
        self._stale_after = stale_after
        self._clock = clock
        self._listed = clock()
        self._watchers: set[asyncio.Task[Any]] = set()

    async def check(self, **_: Any) -> str:
        self._watchers |= {
            t for t in asyncio.all_tasks() if t.get_name().startswith(WATCHER_TASK_PREFIX)
        }
        if ended := sorted(t.get_name() for t in self._watchers if t.done()):
            raise kopf.PermanentError(f"no longer watching: {', '.join(ended)} ended")
        now = self._clock()
        failing = {
            t.get_name().removeprefix(WATCHER_TASK_PREFIX): pacer.failing_for(now)
            for t in self._watchers
            if (pacer := watch_recovery.PACERS.get(t)) is not None
        }
        failing = {name: since for name, since in sorted(failing.items()) if since > 0}
        if stale := [f"{n} for {s:.0f}s" for n, s in failing.items() if s >= self._stale_after]:
            raise kopf.PermanentError(f"watches failing: {', '.join(stale)}")
        watching = (
            "recovering " + ", ".join(f"{n} for {s:.0f}s" for n, s in failing.items())
            if failing
            else "watching"
        )
        try:
            # Bounded: the client's own retries must not outlast the kubelet's probe timeout.
            async with asyncio.timeout(PROBE_LIST_TIMEOUT_S):
                await self._api.list(self._url, "kvfleet.dev/liveness-probe=none")
            self._listed = self._clock()
        except Exception as e:
            # Within the threshold an outage is waited out: a restart would not end it.
            since = self._clock() - self._listed
            if since >= self._stale_after:
                raise kopf.PermanentError(
                    f"cannot list InferenceServices for {since:.0f}s: {e}"
                ) from e
            return f"{watching}; listing fails for {since:.0f}s: {e}"
        return watching


async def _operate(kube: Kube, **operator_args: Any) -> int:
    try:
        await kube.connect()
    except NoClusterError as e:
        logger.error("%s", e)
        return 1
    await kopf.operator(**operator_args)
    return 0


def _run(ns: argparse.Namespace) -> int:
    try:
        config = OperatorConfig(**flag_values(ns, OperatorConfig))
        run = RunSettings(**flag_values(ns, RunSettings))
    except ValidationError as e:
        logger.error("%s", one_line(e))
        return EXIT_USAGE
    settings = build_settings(run.peering)
    kube = Kube()
    namespaces = list(run.namespace)
    registry = build_registry(
        settings,
        config,
        autoscale_interval=run.autoscale_interval,
        scrape_timeout=run.scrape_timeout,
        kube=kube,
        namespaces=namespaces,
    )
    host, _, port = run.metrics_address.rpartition(":")
    prometheus_client.start_http_server(int(port), host or "0.0.0.0")
    logger.info(
        "kvfleet operator: namespaces=%s engine image %s (CPU: %s), router image %s, "
        "allowed images %s, allowed secrets %s",
        ",".join(namespaces) or "all",
        config.engine_image,
        config.engine_cpu_image,
        config.router_image,
        "any" if config.allowed_images is None else ",".join(config.allowed_images) or "defaults",
        "any" if config.allowed_secrets is None else ",".join(config.allowed_secrets) or "none",
    )
    return asyncio.run(
        _operate(
            kube,
            registry=registry,
            settings=settings,
            clusterwide=not namespaces,
            namespaces=namespaces,
            liveness_endpoint=f"http://{run.health_address}/healthz",
        )
    )


def _print_rbac(ns: argparse.Namespace) -> int:
    namespaces = ns.namespace
    if not namespaces:
        sys.stdout.write(yaml.safe_dump(cluster_role(), sort_keys=False))
        return 0
    sa_namespace, _, sa_name = ns.service_account.rpartition("/")
    docs = [
        doc
        for n in namespaces
        for doc in (namespaced_role(n), namespaced_role_binding(n, sa_name, sa_namespace))
    ]
    sys.stdout.write(yaml.safe_dump_all(docs, sort_keys=False))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvfleet-operator", description=(__doc__ or "").split("\n")[0]
    )
    add_log_flags(parser)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="reconcile InferenceService objects")
    add_log_flags(run, defaults=False)
    add_model_flags(run, RunSettings, "operator")
    add_model_flags(run, OperatorConfig, "defaults and allow-lists of InferenceServices")
    run.set_defaults(func=_run)
    rbac = sub.add_parser(
        "print-rbac",
        help="print the operator's ClusterRole, or with namespaces its Roles and RoleBindings",
    )
    rbac.add_argument(
        "-n",
        "--namespace",
        action="extend",
        type=COMMA_LIST.parse,
        default=[],
        help="a watched namespace; repeatable or comma-separated",
    )
    rbac.add_argument(
        "--service-account",
        default="kvfleet-system/kvfleet-operator",
        help="NAMESPACE/NAME of the operator's ServiceAccount, the subject of the RoleBindings"
        " (default: %(default)s)",
    )
    rbac.set_defaults(func=_print_rbac)
    return parser


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    # kopf.operator() adds no log handler of its own (only its CLI does): kopf's lines, its
    # per-object ones included, reach this root handler and come out in the same format.
    configure_logging(ns.log_level, ns.log_format)
    # Kopf logs every handler call; ours only queue a reconcile, which logs what it changes.
    logging.getLogger("kopf.objects").setLevel(max(logging.WARNING, logging.root.level))
    return ns.func(ns)
