"""Adapter-aware placement (router/adapter_placement.py): resident engines first within the
load bound, loads where they evict the least used adapter, replication by load, prefix affinity
among an adapter's engines; and the Balancer that feeds it the engines' reports."""

from __future__ import annotations

import pytest

from kvfleet.router.adapter_placement import AdapterUsage, EngineAdapters, place
from kvfleet.router.engine_load import EngineReport, adapters_of, report_of
from kvfleet.router.hash_ring import HashRing
from kvfleet.router.proxy import Balancer
from kvfleet.telemetry.metrics_reader import ScrapeError

ENGINES = ("10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000", "10.0.0.4:8000")


def ring(*endpoints: str) -> HashRing:
    r = HashRing(load_factor=1.25)
    r.set_endpoints(endpoints or ENGINES)
    return r


def no_usage(_endpoint: str, _adapter: str) -> float:
    return 0.0


def held(*gpu: str, cpu: tuple[str, ...] = (), slots: int | None = 4) -> EngineAdapters:
    return EngineAdapters(frozenset(gpu), frozenset(cpu), slots)


def test_an_engine_holding_it_on_the_gpu_comes_first_then_host_memory() -> None:
    a, b, c, _ = ENGINES
    holdings = {a: held("other"), b: held(cpu=("sql",)), c: held("sql")}
    p = place("sql", "prefix:x", ring(), {}, holdings, no_usage)
    assert p is not None and (p.endpoint, p.reason) == (c, "resident_gpu")
    del holdings[c]
    p = place("sql", "prefix:x", ring(), {}, holdings, no_usage)
    assert p is not None and (p.endpoint, p.reason) == (b, "resident_cpu")


def test_a_holder_over_the_bound_is_passed_by_for_a_load_elsewhere() -> None:
    a, b, c, d = ENGINES
    holdings = {ep: held() for ep in ENGINES} | {a: held("hot")}
    # 8 in flight on the holder: the bound is ceil(1.25 * 9 / 4) = 3.
    p = place("hot", "prefix:x", ring(), {a: 8}, holdings, no_usage)
    assert p is not None and p.endpoint != a and p.reason == "load_free_slot"
    # Within the bound it stays.
    p = place("hot", "prefix:x", ring(), {a: 1, b: 1, c: 1, d: 1}, holdings, no_usage)
    assert p is not None and (p.endpoint, p.reason) == (a, "resident_gpu")


def test_a_load_goes_to_a_free_slot_then_evicts_the_least_used_adapter() -> None:
    a, b, c, d = ENGINES
    usage = {(a, "x1"): 9.0, (a, "x2"): 7.0, (b, "y1"): 5.0, (b, "y2"): 0.5, (c, "z1"): 3.0,
             (c, "z2"): 2.0, (d, "w1"): 8.0}  # fmt: skip

    def used(ep: str, name: str) -> float:
        return usage.get((ep, name), 0.0)

    holdings = {
        a: held("x1", "x2", slots=2),
        b: held("y1", "y2", slots=2),
        c: held("z1", "z2", slots=2),
        d: held("w1", slots=2),
    }
    p = place("new", "prefix:k", ring(), {}, holdings, used)
    assert p is not None and (p.endpoint, p.reason) == (d, "load_free_slot")
    holdings[d] = held("w1", "w2", slots=2)  # w2: no recent requests at all
    p = place("new", "prefix:k", ring(), {}, holdings, used)
    assert p is not None and (p.endpoint, p.reason) == (d, "load_evict")
    usage[d, "w2"] = 4.0
    # b's y2 (0.5 recent requests) is the least useful adapter of the fleet.
    p = place("new", "prefix:k", ring(), {}, holdings, used)
    assert p is not None and (p.endpoint, p.reason) == (b, "load_evict")
    # Unless b is over the bound: then the next least useful, c's z2.
    p = place("new", "prefix:k", ring(), {b: 9}, holdings, used)
    assert p is not None and (p.endpoint, p.reason) == (c, "load_evict")


def test_an_engine_that_reports_no_adapters_is_the_last_to_load_one() -> None:
    a, b, c, _ = ENGINES
    holdings = {a: held("x", slots=1), b: held("y", slots=1), c: held("z", slots=1)}
    p = place("new", "prefix:k", ring(), {}, holdings, lambda ep, n: 1.0)
    assert p is not None and p.endpoint in (a, b, c)


def test_prefix_affinity_holds_among_the_adapters_engines() -> None:
    r = ring()
    holders = {ENGINES[0], ENGINES[2]}
    holdings = {ep: held("sql") if ep in holders else held("other") for ep in ENGINES}
    seen = set()
    for i in range(40):
        key = f"prefix:{i}"
        p = place("sql", key, r, {}, holdings, no_usage)
        assert p is not None and p.endpoint in holders
        # The key's first holder in ring order: the same prompt prefix, the same engine.
        assert p.endpoint == next(ep for ep in r.walk(key) if ep in holders)
        seen.add(p.endpoint)
    assert seen == holders  # and different prefixes spread over the holders


def test_excluded_engines_are_never_chosen() -> None:
    a = ENGINES[0]
    holdings = {a: held("sql")}
    p = place("sql", "k", ring(), {}, holdings, no_usage, exclude=frozenset({a}))
    assert p is not None and p.endpoint != a
    assert place("sql", "k", ring(a), {}, holdings, no_usage, exclude=frozenset({a})) is None


def report(*gpu: str, slots: int = 2) -> EngineReport:
    # No batch size reported: no engine counts as free, the bound alone decides.
    return EngineReport(0, 0, None, 0, held(*gpu, slots=slots))


def test_replication_grows_with_the_adapters_load() -> None:
    """One hot adapter over a fleet with other work (4 requests in flight each), its requests
    staying in flight: it stays on its holder while that is within the bound, then takes on
    engines one by one as its load grows, each loading it once and holding it from then on."""
    b = Balancer(load_factor=1.25, clock=lambda: 0.0)
    b.set_endpoints(ENGINES)
    for ep in ENGINES:
        b.report(ep, report())
        for _ in range(4):
            b.acquire(ep)
    b.report(ENGINES[0], report("hot"))
    placements = []
    for i in range(80):
        p = b.place("hot", f"prefix:{i % 3}")
        assert p is not None
        b.acquire(p.endpoint)
        placements.append(p)
        assert max(b.load().values()) <= b.ring.capacity(b.load())
    holders = [len({p.endpoint for p in placements[: n + 1]}) for n in range(80)]
    assert holders[:2] == [1, 1] and holders[-1] == len(ENGINES)
    assert holders == sorted(holders) and len(set(holders)) == len(ENGINES)  # one at a time
    loads = [p.endpoint for p in placements if p.reason.startswith("load_")]
    assert sorted(loads) == sorted(ENGINES[1:])  # each other engine loaded it exactly once


def test_a_loaded_adapter_counts_as_held_until_the_reports_take_over() -> None:
    clock = [0.0]
    b = Balancer(clock=lambda: clock[0])
    b.set_endpoints(ENGINES[:2])
    b.report(ENGINES[0], report())
    b.report(ENGINES[1], report())
    assert not b.serves_adapter("sql")
    p = b.place("sql", None)
    assert p is not None and p.reason == "load_free_slot"
    assert b.serves_adapter("sql")
    again = b.place("sql", None)
    assert again is not None and (again.endpoint, again.reason) == (p.endpoint, "resident_gpu")
    clock[0] += 10.0  # past LOADING_S, and the engine's report does not show it: not held
    assert not b.serves_adapter("sql")


def test_base_model_requests_are_routed_as_before() -> None:
    b = Balancer()
    b.set_endpoints(ENGINES)
    for ep in ENGINES:
        b.report(ep, report("sql", "chat"))
    r = ring()
    for i in range(20):
        key = f"prefix:{i}"
        assert b.choose(key) == r.choose(key, {})
    assert not b.serves_adapter("meta-llama/Llama-3.1-8B-Instruct")


def test_usage_decays_and_is_pruned() -> None:
    u = AdapterUsage(half_life=10.0, floor=0.1)
    u.add("e", "a", 0.0)
    u.add("e", "a", 0.0)
    assert u.of("e", "a", 10.0) == pytest.approx(1.0)
    u.prune(100.0, frozenset({"e"}))
    assert u.of("e", "a", 100.0) == 0.0


EXPOSITION = """\
vllm:num_requests_running{model_name="m"} 2
vllm:num_requests_waiting{model_name="m"} 0
kvfleet_engine_max_num_seqs 64
kvfleet_engine_lora_resident{lora_name="sql",tier="gpu"} 1
kvfleet_engine_lora_resident{lora_name="chat",tier="gpu"} 1
kvfleet_engine_lora_resident{lora_name="legal",tier="cpu"} 1
vllm:lora_requests_info{max_lora="2",running_lora_adapters="sql",waiting_lora_adapters=""} 1.7e9
"""


def test_the_engines_adapters_are_read_from_its_metrics() -> None:
    r = report_of(EXPOSITION.splitlines(), 0)
    assert (r.running, r.max_num_seqs) == (2, 64)
    assert r.adapters == EngineAdapters(frozenset({"sql", "chat"}), frozenset({"legal"}), 2)
    plain = [line for line in EXPOSITION.splitlines() if "lora" not in line]
    assert report_of(plain, 0).adapters is None
    bad = EXPOSITION.replace('max_lora="2"', 'max_lora="-1"').splitlines()
    with pytest.raises(ScrapeError):
        adapters_of(bad)
