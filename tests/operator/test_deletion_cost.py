"""Which engine a scale-down removes: ranks by in-flight requests, then cached blocks; pods
without metrics first; only changed annotations are written."""

from __future__ import annotations

from kvfleet.operator.deletion_cost import DELETION_COST, cost_patches, deletion_costs
from kvfleet.operator.scaling_policy import PodMetrics


def test_in_flight_requests_outrank_a_warm_cache():
    costs = deletion_costs(
        [
            PodMetrics("busy-cold", running=3, waiting=1, kv_cache_usage=0.1, cached_blocks=0),
            PodMetrics("idle-warm", running=0, waiting=0, kv_cache_usage=0.0, cached_blocks=900),
            PodMetrics("idle-cold", running=0, waiting=0, kv_cache_usage=0.0, cached_blocks=3),
            PodMetrics("waiting", running=0, waiting=2, kv_cache_usage=0.0, cached_blocks=0),
        ]
    )
    assert costs == {"idle-cold": 0, "idle-warm": 1, "waiting": 2, "busy-cold": 3}


def test_a_pod_without_usable_metrics_goes_first():
    costs = deletion_costs(
        [
            PodMetrics("idle", running=0, waiting=0, kv_cache_usage=0.0, cached_blocks=0),
            PodMetrics("silent", error="timeout"),
            PodMetrics("broken", running=float("nan"), waiting=0, kv_cache_usage=0.0),
        ]
    )
    assert costs["idle"] == 2 and {costs["silent"], costs["broken"]} == {0, 1}


def test_kv_usage_stands_in_for_every_pod_when_one_lacks_cached_blocks():
    # Mid-upgrade: comparing one engine's block count with another's usage fraction would rank
    # any exporting engine above every other.
    costs = deletion_costs(
        [
            PodMetrics("new", running=0, waiting=0, kv_cache_usage=0.1, cached_blocks=40),
            PodMetrics("old", running=0, waiting=0, kv_cache_usage=0.6),
        ]
    )
    assert costs == {"new": 0, "old": 1}


def test_equal_pods_rank_by_name_so_ranks_are_stable():
    pods = [PodMetrics(name, 1, 0, 0.2, 7) for name in ("c", "a", "b")]
    assert deletion_costs(pods) == {"a": 0, "b": 1, "c": 2}
    assert deletion_costs(reversed(pods)) == {"a": 0, "b": 1, "c": 2}


def test_only_pods_whose_cost_changed_are_patched():
    def pod(name: str, cost: str | None) -> dict:
        annotations = {} if cost is None else {DELETION_COST: cost}
        return {"metadata": {"name": name, "annotations": annotations}}

    pods = [pod("a", "0"), pod("b", "0"), pod("c", None), pod("router", None)]
    assert cost_patches(pods, {"a": 0, "b": 1, "c": 2}) == {
        "b": {"metadata": {"annotations": {DELETION_COST: "1"}}},
        "c": {"metadata": {"annotations": {DELETION_COST: "2"}}},
    }


def test_an_impossible_cached_block_count_makes_the_metrics_unusable():
    assert PodMetrics("p", 0, 0, 0.0, cached_blocks=-1).problem == (
        "cached blocks: -1 is outside [0, 1e+09]"
    )
