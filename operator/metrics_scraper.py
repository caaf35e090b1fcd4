"""Reading the engines' and routers' Prometheus metrics for the autoscaler.

Targets are pods, not Services: the autoscaler needs each engine's own numbers, and a Service
would answer from one pod at random. A pod is scraped once it is Ready and has an IP, on the
container port named ``http`` (what the operator's Deployments declare; tests point it at their
own servers), else the component's default port. Every pod is fetched concurrently with its own
timeout; one that does not answer in time, answers with an error, or lacks a metric is reported
as unanswered, never as idle.

Parsing is prometheus-client's text parser, so the exposition format (escapes, timestamps,
comments) is read as Prometheus reads it. A metric with several series (several model_name
values) is summed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from kvfleet.operator.scaling_policy import PodMetrics

logger = logging.getLogger("kvfleet.operator.metrics")

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_CACHE_USAGE = "vllm:kv_cache_usage_perc"
# The router's gauge of requests waiting for a ready engine (scale from zero).
HELD_REQUESTS = "kvfleet_router_held_requests"
METRICS_PATH = "/metrics"


@dataclass(frozen=True)
class Target:
    name: str  # the pod's name, as reported in status
    url: str


def _is_ready(pod: Mapping[str, Any]) -> bool:
    status = pod.get("status") or {}
    return (
        not (pod.get("metadata") or {}).get("deletionTimestamp")
        and bool(status.get("podIP"))
        and any(
            c.get("type") == "Ready" and c.get("status") == "True"
            for c in status.get("conditions") or []
        )
    )


def _http_port(pod: Mapping[str, Any], default: int) -> int:
    for container in (pod.get("spec") or {}).get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("name") == "http" and port.get("containerPort"):
                return int(port["containerPort"])
    return default


def ready_targets(pods: Iterable[Mapping[str, Any]], default_port: int) -> list[Target]:
    """The /metrics URL of each Ready pod, by pod name."""
    targets = []
    for pod in pods:
        if not _is_ready(pod):
            continue
        ip = pod["status"]["podIP"]
        host = f"[{ip}]" if ":" in ip else ip
        port = _http_port(pod, default_port)
        targets.append(Target(pod["metadata"]["name"], f"http://{host}:{port}{METRICS_PATH}"))
    return sorted(targets, key=lambda t: t.name)


def parse_metrics(text: str, names: Iterable[str]) -> dict[str, float]:
    """The sum over series of each named metric found in an exposition; absent ones are left out.

    Raises ValueError on text that is not the Prometheus exposition format.
    """
    wanted = set(names)
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in wanted:
                found[sample.name] = found.get(sample.name, 0.0) + sample.value
    return found


async def fetch(session: aiohttp.ClientSession, target: Target, timeout: float) -> str | None:
    """The body of one scrape, or None when the pod did not answer in time or failed."""
    try:
        async with session.get(
            target.url, timeout=aiohttp.ClientTimeout(total=timeout)
        ) as response:
            if response.status != 200:
                logger.warning("%s: /metrics answered %d", target.name, response.status)
                return None
            return await response.text()
    except (TimeoutError, aiohttp.ClientError, OSError) as e:
        logger.warning("%s: no metrics from %s: %r", target.name, target.url, e)
        return None


def _parsed(
    target: Target, text: str | None, names: Sequence[str], *, required: bool
) -> dict[str, float] | None:
    if text is None:
        return None
    try:
        values = parse_metrics(text, names)
    except ValueError as e:
        logger.warning("%s: unreadable metrics: %s", target.name, e)
        return None
    if required and (missing := [n for n in names if n not in values]):
        logger.warning("%s: metrics lack %s", target.name, ", ".join(missing))
        return None
    return values


async def scrape_engines(
    session: aiohttp.ClientSession, targets: Sequence[Target], timeout: float
) -> list[PodMetrics]:
    """Queue depth and KV-cache usage of each engine; a pod without them is unanswered."""
    names = (RUNNING, WAITING, KV_CACHE_USAGE)
    texts = await asyncio.gather(*(fetch(session, t, timeout) for t in targets))
    metrics = []
    for target, text in zip(targets, texts, strict=True):
        values = _parsed(target, text, names, required=True)
        if values is None:
            metrics.append(PodMetrics(target.name))
        else:
            metrics.append(
                PodMetrics(target.name, values[RUNNING], values[WAITING], values[KV_CACHE_USAGE])
            )
    return metrics


async def scrape_held_requests(
    session: aiohttp.ClientSession, targets: Sequence[Target], timeout: float
) -> tuple[float, tuple[str, ...]]:
    """Requests the routers hold for want of a ready engine, summed; and the routers that did not
    answer. A router that answers without the gauge holds nothing (a labelled gauge has no series
    until first set)."""
    texts = await asyncio.gather(*(fetch(session, t, timeout) for t in targets))
    held, unanswered = 0.0, []
    for target, text in zip(targets, texts, strict=True):
        values = _parsed(target, text, (HELD_REQUESTS,), required=False)
        if values is None:
            unanswered.append(target.name)
        else:
            held += values.get(HELD_REQUESTS, 0.0)
    return held, tuple(unanswered)
