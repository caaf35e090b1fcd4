"""Writing an InferenceService's status, and reporting a write that fails where the status
cannot.

Both writers of the status go through one StatusWriter: the reconciler (conditions, counts) and
the autoscaler (its decision, its memory, why its steps fail). A failed status write cannot be
recorded in the status (that is another write to the same subresource), so it is reported
through what does not depend on it: kvfleet_operator_status_write_failures_total{reason} counts
every write sent that failed, and the first failure of each cause, per service, is a log warning
and a Warning Event StatusWriteFailed (an Event is an object of its own); the next write that
succeeds is a log line and a Normal Event StatusWriteRecovered. Retrying is kube.py's: the
object's writes back off, and one not sent meanwhile (WriteDeferred) is neither counted nor
reported again.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from prometheus_client import Counter

from kvfleet.operator import kube
from kvfleet.operator.api import GROUP, PLURAL, VERSION

logger = logging.getLogger("kvfleet.operator.status")

FAILURES = Counter(
    "kvfleet_operator_status_write_failures",
    "InferenceService status writes sent that failed, by cause: conflict (409), unavailable "
    "(429, 5xx), unreachable (no answer), refused (another 4xx).",
    ["reason"],
)


def failure_cause(status: int) -> str:
    """The cause of a failed write, from its HTTP status (0: no answer)."""
    if status == 0:
        return "unreachable"
    if status == 409:
        return "conflict"
    if status == 429 or status >= 500:
        return "unavailable"
    return "refused"


class StatusWriter:
    def __init__(self, api: kube.Kube) -> None:
        self._api = api
        # The cause last reported per service, until a write succeeds or the service is gone.
        self._failing: dict[kube.Key, str] = {}

    async def write(
        self,
        key: kube.Key,
        isvc: dict[str, Any],
        patch: Mapping[str, Any],
        *,
        periodic: bool = False,
    ) -> None:
        """Merge ``patch`` into the status of ``isvc``; raises APIError after reporting it.
        ``periodic``: the caller's, as for kube.Kube."""
        url = kube.resource_url(f"{GROUP}/{VERSION}", PLURAL, *key, "status")
        try:
            await self._api.merge_patch(url, {"status": patch}, periodic=periodic)
        except kube.APINotFoundError:
            self.forget(key)
            raise
        except kube.APIError as e:
            cause = failure_cause(e.status)
            if not isinstance(e, kube.WriteDeferred):
                FAILURES.labels(cause).inc()
            if self._failing.get(key) != cause:
                self._failing[key] = cause
                message = f"status not written ({cause}): {e}; retried with backoff"
                logger.warning("%s/%s: %s", *key, message)
                kube.post_event(isvc, type="Warning", reason="StatusWriteFailed", message=message)
            raise
        if self._failing.pop(key, None) is not None:
            message = "the status is written again"
            logger.info("%s/%s: %s", *key, message)
            kube.post_event(isvc, type="Normal", reason="StatusWriteRecovered", message=message)

    def forget(self, key: kube.Key) -> None:
        """The service is gone."""
        self._failing.pop(key, None)
