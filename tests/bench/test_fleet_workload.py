"""The fleet harness's tenant workload (bench/fleet/workload.py): many tenants' long system prompts,
one short question a request, tenants drawn by popularity, the same requests for the same seed;
and the multi-turn workload's requests unchanged by the arrivals being drawn apart."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from tests.support.scripts import load_script

workload = load_script("bench/fleet/workload.py")

SHAPE: dict[str, Any] = dict(tenants=16, system_words=40, question_words=5, max_tokens=8, seed=7)


def test_each_request_is_one_question_under_its_tenants_prompt() -> None:
    w = workload.make_tenant_workload(
        workload.parse_phases("100x4"), popularity="uniform", zipf=1.0, **SHAPE
    )
    assert len(w.systems) == 16 and len(set(w.systems)) == 16
    assert all(len(p.split()) == 40 for p in w.systems)
    # Poisson arrivals at 4 requests a second for 100 s: about 400, in order, inside the phase.
    assert 320 < len(w.sessions) < 480
    starts = [s.start for s in w.sessions]
    assert starts == sorted(starts) and starts[0] > 0 and starts[-1] < 100
    for s in w.sessions[:20]:
        assert len(s.users) == 1 and len(s.users[0].split()) == 5 and s.adapter is None
        system, user = w.messages(s, 0, "run0")
        assert system == {"role": "system", "content": f"[run0] {w.systems[s.system]}"}
        assert user == {"role": "user", "content": s.users[0]}
    assert w.max_tokens == 8
    # Uniform: every tenant asked, none far above its share (about 25 requests each).
    counts = Counter(s.system for s in w.sessions)
    assert len(counts) == 16 and max(counts.values()) < 3 * len(w.sessions) / 16


def test_zipf_popularity_puts_the_first_tenants_ahead_and_keeps_the_text() -> None:
    phases = workload.parse_phases("200x5")
    zipf = workload.make_tenant_workload(phases, popularity="zipf", zipf=1.0, **SHAPE)
    uniform = workload.make_tenant_workload(phases, popularity="uniform", zipf=1.0, **SHAPE)
    counts = Counter(s.system for s in zipf.sessions)
    assert counts[0] > counts[1] > counts[7] and counts[0] > 5 * counts[15]
    # The popularity picks tenants only: the prompts, questions and arrivals are the same.
    assert zipf.systems == uniform.systems
    assert [(s.start, s.users) for s in zipf.sessions] == [
        (s.start, s.users) for s in uniform.sessions
    ]


def test_the_same_seed_gives_the_same_requests_and_another_seed_others() -> None:
    phases = workload.parse_phases("20x3,20x6")
    a, b = (
        workload.make_tenant_workload(phases, popularity="zipf", zipf=1.2, **SHAPE)
        for _ in range(2)
    )
    assert a == b
    other = workload.make_tenant_workload(
        phases, popularity="zipf", zipf=1.2, **{**SHAPE, "seed": 8}
    )
    assert other.systems != a.systems
    # The second phase's rate is twice the first's.
    first = sum(s.start < 20 for s in a.sessions)
    assert len(a.sessions) - first > first


def test_no_tenants_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one tenant"):
        workload.make_tenant_workload(
            workload.parse_phases("10x1"), popularity="uniform", zipf=1.0,
            **{**SHAPE, "tenants": 0},
        )  # fmt: skip
