"""Loading and unloading a service's LoRA adapters in its running engine pods, through the
engines' ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (vLLM's endpoints), so that
editing spec.adapters restarts no pod.

The reconciler calls ``sync`` on every reconcile of a service with adapters (an engine pod
turning ready is one), which makes it level-triggered: each ready engine pod's ``/v1/models`` is
compared with the spec, and only the difference is sent. A failure is reported per adapter and
pod; the reconcile then fails with the reason, and its backoff paces the retries. An engine's
answers are untrusted input: read within a deadline and a byte limit, checked field by field.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from kvfleet.operator.metrics_scraper import METRICS_PATH, Target, ready_targets
from kvfleet.telemetry.ports import ENGINE_PORT

logger = logging.getLogger("kvfleet.operator.adapters")

# An engine's /v1/models lists the base model and its adapters (spec.MAX_ADAPTERS of them, a
# few hundred bytes each); more than this is not an engine's answer.
MAX_BODY_BYTES = 1 * 2**20
# Loading reads the adapter from disk (or its host copy): seconds, not minutes.
REQUEST_TIMEOUT_S = 30.0
# An engine's error message, as status and the Degraded condition quote it.
MAX_MESSAGE_CHARS = 300


class EngineAnswerError(Exception):
    """An engine's answer that cannot be used, or none; the message says why."""


@dataclass(frozen=True)
class PodAdapters:
    """One engine pod after a sync: the adapters it serves (name: path), and why each one that
    should be there is not."""

    pod: str
    loaded: Mapping[str, str]
    failures: Mapping[str, str] = field(default_factory=dict)


def plan(desired: Mapping[str, str], loaded: Mapping[str, str]) -> tuple[list[str], list[str]]:
    """What to unload and what to load so that an engine serving ``loaded`` (name: path)
    serves ``desired``: an adapter whose source changed is unloaded and loaded again."""
    unload = [name for name, path in loaded.items() if desired.get(name) != path]
    load = [name for name, path in desired.items() if loaded.get(name) != path]
    return unload, load


def adapter_status(desired: Iterable[str], pods: Sequence[PodAdapters]) -> list[dict[str, Any]]:
    """status.adapters: per adapter, the ready engine pods serving it, and the first reason one
    does not."""
    out = []
    for name in desired:
        entry: dict[str, Any] = {
            "name": name,
            "readyReplicas": sum(1 for p in pods if name in p.loaded),
        }
        if failed := [
            f"engine pod {p.pod}: {p.failures[name]}" for p in pods if name in p.failures
        ]:
            entry["message"] = failed[0] + (
                f" (and {len(failed) - 1} more)" if len(failed) > 1 else ""
            )
        out.append(entry)
    return out


def _clip(text: str) -> str:
    return text if len(text) <= MAX_MESSAGE_CHARS else text[: MAX_MESSAGE_CHARS - 3] + "..."


def served_adapters(body: Any) -> dict[str, str]:
    """The adapters of a /v1/models answer (the entries with a parent), name: path (root)."""
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list):
        raise EngineAnswerError("/v1/models: no data list")
    found = {}
    for entry in data:
        if not isinstance(entry, dict) or entry.get("parent") is None:
            continue
        name, root = entry.get("id"), entry.get("root")
        if not isinstance(name, str) or not isinstance(root, str):
            raise EngineAnswerError("/v1/models: an adapter without a string id and root")
        found[name] = root
    return found


class AdapterSync:
    """Brings every ready engine pod's adapters to the spec's; ``close`` it when done."""

    def __init__(self, *, timeout: float = REQUEST_TIMEOUT_S) -> None:
        self.timeout = timeout
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.timeout), auto_decompress=False
            )
        return self._session

    async def sync(
        self, pods: Iterable[Mapping[str, Any]], desired: Mapping[str, str]
    ) -> list[PodAdapters]:
        """Every ready engine pod (of ``pods``), synced at once."""
        targets = ready_targets(pods, ENGINE_PORT)
        return list(await asyncio.gather(*(self._sync_pod(t, desired) for t in targets)))

    async def _sync_pod(self, target: Target, desired: Mapping[str, str]) -> PodAdapters:
        base = target.url.removesuffix(METRICS_PATH)
        try:
            loaded = served_adapters(await self._call("GET", f"{base}/v1/models"))
        except EngineAnswerError as e:
            logger.warning("engine pod %s: %s", target.name, e)
            return PodAdapters(target.name, {}, dict.fromkeys(desired, str(e)))
        failures: dict[str, str] = {}
        unload, load = plan(desired, loaded)
        for name in unload:
            try:
                await self._call("POST", f"{base}/v1/unload_lora_adapter", {"lora_name": name})
            except EngineAnswerError as e:
                logger.warning("engine pod %s: unloading adapter %s: %s", target.name, name, e)
                if name in desired:
                    failures[name] = f"unloading its former source: {e}"
                continue
            logger.info("engine pod %s: unloaded adapter %s", target.name, name)
            del loaded[name]
        for name in load:
            if name in failures:
                continue
            body = {"lora_name": name, "lora_path": desired[name]}
            try:
                await self._call("POST", f"{base}/v1/load_lora_adapter", body)
            except EngineAnswerError as e:
                logger.warning("engine pod %s: loading adapter %s: %s", target.name, name, e)
                failures[name] = str(e)
                continue
            logger.info(
                "engine pod %s: loaded adapter %s from %s", target.name, name, body["lora_path"]
            )
            loaded[name] = desired[name]
        return PodAdapters(target.name, loaded, failures)

    async def _call(self, method: str, url: str, body: Any = None) -> Any:
        """The JSON answer of a 200; EngineAnswerError with the engine's own message else."""
        try:
            async with self._client().request(
                method, url, json=body, headers={"Accept-Encoding": "identity"}
            ) as r:
                status = r.status
                raw = bytearray()
                async for chunk in r.content.iter_chunked(64 * 2**10):
                    raw += chunk
                    if len(raw) > MAX_BODY_BYTES:
                        raise EngineAnswerError(f"answer over {MAX_BODY_BYTES} bytes")
        except TimeoutError:
            raise EngineAnswerError(f"no answer within {self.timeout:g} s") from None
        except (aiohttp.ClientError, OSError) as e:
            raise EngineAnswerError(f"unreachable: {e!r}") from None
        try:
            answer = json.loads(raw) if raw else None
        except (ValueError, UnicodeDecodeError):
            answer = None
            if status == 200 and method == "GET":
                raise EngineAnswerError("answer is not JSON") from None
        if status != 200:
            message = _error_message(answer) or f"HTTP {status}"
            raise EngineAnswerError(_clip(f"the engine refused ({status}): {message}"))
        return answer

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


def _error_message(answer: Any) -> str | None:
    error = answer.get("error") if isinstance(answer, dict) else None
    message = error.get("message") if isinstance(error, dict) else None
    return message if isinstance(message, str) else None
