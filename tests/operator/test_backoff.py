"""Exponential backoff with jitter, per key (kvfleet.operator.backoff): what the work queue's
retries and the client's per-object write backoff are made of."""

from __future__ import annotations

from kvfleet.operator.backoff import PerKeyBackoff, backoff_delay


def test_the_delay_doubles_to_its_cap_with_jitter_of_at_most_half():
    for failures in range(1, 12):
        nominal = min(4.0 * 2 ** (failures - 1), 60.0)
        delays = [backoff_delay(failures, 4.0, 60.0) for _ in range(200)]
        assert all(nominal / 2 <= d <= nominal for d in delays)
        assert len(set(delays)) > 1  # spread: clients that failed together do not return together


def test_each_key_backs_off_until_a_success():
    now = [0.0]
    backoff: PerKeyBackoff[str] = PerKeyBackoff(4.0, 60.0, forget_after=600.0, clock=lambda: now[0])
    assert backoff.failing("a") is None and backoff.wait("a") == 0.0
    for failures in range(1, 8):
        state = backoff.failed("a", f"conflict #{failures}", 409)
        nominal = min(4.0 * 2 ** (failures - 1), 60.0)
        assert (state.failures, state.last, state.status) == (
            failures,
            f"conflict #{failures}",
            409,
        )
        assert nominal / 2 <= backoff.wait("a") <= nominal
    assert backoff.wait("b") == 0.0  # per key
    now[0] += 60.0
    assert backoff.wait("a") == 0.0
    assert backoff.failing("a") is not None  # may be tried: still failing until it succeeds
    backoff.succeeded("a")
    assert backoff.failing("a") is None


def test_a_key_that_stops_failing_without_a_success_is_forgotten():
    """An object deleted while its writes failed is never written again: it is not held."""
    now = [0.0]
    backoff: PerKeyBackoff[str] = PerKeyBackoff(4.0, 60.0, forget_after=600.0, clock=lambda: now[0])
    backoff.failed("deleted", "HTTP 503", 503)
    now[0] += 599.0
    assert backoff.failing("deleted") is not None
    now[0] += 2.0
    backoff.failed("other", "HTTP 503", 503)
    assert set(backoff._failing) == {"other"}  # what is held is what failed within the time
    assert backoff.failing("deleted") is None
