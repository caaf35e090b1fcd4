"""The router's index of the engines' KV blocks (kv_index.py) and the precise scoring rule
(prefix_score.py): snapshots and batches in sequence, resync on a gap, staleness, the per-engine
bound, the longest cached prefix per medium, and the rule's trade of prefix against load."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from kvfleet.protocol.block_hash import prompt_block_hashes
from kvfleet.protocol.kv_events import EventBatch, Snapshot
from kvfleet.router.kv_index import CPU_BLOCK_WEIGHT, CachedPrefix, Gap, KvIndex
from kvfleet.router.prefix_score import EngineState, ranked, score

PROMPT = list(range(16 * 8))  # eight full blocks
HASHES = prompt_block_hashes(PROMPT)
HEX = [h.hex() for h in HASHES]


def snapshot(gpu: list[str], cpu: list[str] | None = None, seq: int = 0, engine_id: str = "a"):
    line = {"type": "snapshot", "engine_id": engine_id, "seq": seq, "block_size": 16,
            "blocks": {"gpu": gpu, "cpu": cpu or []}}  # fmt: skip
    return Snapshot.model_validate(line)


def batch(seq: int, *events: dict[str, Any]) -> EventBatch:
    return EventBatch.model_validate({"seq": seq, "events": list(events)})


def stored(hexes: list[str], medium: str = "gpu") -> dict[str, Any]:
    return {"type": "stored", "block_hashes": hexes, "parent_block_hash": None, "medium": medium,
            "lora_name": None}  # fmt: skip


def removed(hexes: list[str], medium: str = "gpu") -> dict[str, Any]:
    return {"type": "removed", "block_hashes": hexes, "medium": medium}


def test_the_longest_prefix_is_consecutive_from_the_first_block_across_media() -> None:
    index = KvIndex(stale_after=3)
    index.snapshot("e", snapshot(HEX[:3], cpu=HEX[3:5] + HEX[6:]), now=0)
    got = index.longest_prefix("e", HASHES)
    # Blocks 0-2 on the GPU, 3-4 in host memory; block 5 is nowhere, so 6-7 do not count.
    assert got == CachedPrefix(gpu=3, cpu=2)
    assert got.blocks == 3 + 2 * CPU_BLOCK_WEIGHT
    assert index.longest_prefix("e", prompt_block_hashes([7, *PROMPT[1:]])) == CachedPrefix()
    assert index.longest_prefix("unknown", HASHES) == CachedPrefix()


def test_batches_apply_in_order_and_a_gap_drops_the_view() -> None:
    index = KvIndex(stale_after=3)
    index.snapshot("e", snapshot([], seq=5), now=0)
    assert index.apply("e", batch(6, stored(HEX[:4]), removed(HEX[2:3])), now=1) == 2
    assert index.longest_prefix("e", HASHES) == CachedPrefix(gpu=2)
    index.heartbeat("e", 6, now=2)  # a heartbeat repeats the last seq
    index.apply("e", batch(7, stored(HEX[2:3], "cpu")), now=2)
    assert index.longest_prefix("e", HASHES) == CachedPrefix(gpu=3, cpu=1)  # block 3 follows
    index.apply("e", batch(8, {"type": "cleared"}), now=2)
    assert index.longest_prefix("e", HASHES) == CachedPrefix()
    with pytest.raises(Gap):
        index.apply("e", batch(10, stored(HEX)), now=3)  # 9 was lost
    assert "e" not in index.engines()  # until a snapshot: the subscriber resyncs
    with pytest.raises(Gap):
        index.heartbeat("e", 10, now=3)
    index.snapshot("e", snapshot(HEX, seq=10, engine_id="b"), now=4)
    assert index.longest_prefix("e", HASHES) == CachedPrefix(gpu=8)


def test_a_view_goes_stale_without_lines() -> None:
    index = KvIndex(stale_after=3)
    index.snapshot("e", snapshot(HEX), now=10)
    index.snapshot("f", snapshot(HEX), now=10)
    index.heartbeat("f", 0, now=12)
    assert index.live(13) == {"e", "f"}
    assert index.live(14) == {"f"}
    index.drop("f")
    assert index.live(14) == frozenset()


def test_an_engine_over_the_bound_is_indexed_up_to_it_with_one_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    index = KvIndex(stale_after=3, max_blocks=4)
    with caplog.at_level(logging.WARNING, "kvfleet.router.kv_index"):
        index.snapshot("e", snapshot(HEX[:3], cpu=HEX[3:]), now=0)
        index.apply("e", batch(1, stored(HEX[5:])), now=0)
    assert index.size("e") == 4
    assert index.longest_prefix("e", HASHES) == CachedPrefix(gpu=3, cpu=1)
    assert len([r for r in caplog.records if "over 4 KV blocks" in r.message]) == 1
    # Evicting makes room again, and going over again warns again.
    with caplog.at_level(logging.WARNING, "kvfleet.router.kv_index"):
        index.apply("e", batch(2, removed(HEX[3:4], "cpu"), stored(HEX[4:6])), now=0)
    assert index.size("e") == 4
    assert len([r for r in caplog.records if "over 4 KV blocks" in r.message]) == 2


def state(
    cached: float, requests: int = 0, batch: int = 8, kv: float = 0.0, assumed: bool = False
) -> EngineState:
    return EngineState(cached, requests, batch, kv, assumed)


def test_the_rule_trades_the_cached_prefix_against_load() -> None:
    # The engine holding the prompt wins at equal load, and at a moderately higher one.
    order = ["cold", "warm"]
    assert ranked(order, {"cold": state(0), "warm": state(8)}, 8)[0].endpoint == "warm"
    assert ranked(order, {"cold": state(0), "warm": state(8, requests=4)}, 8)[0].endpoint == "warm"
    # A small shared prefix (one block of eight) loses to a small load difference.
    assert ranked(order, {"cold": state(0), "warm": state(1, requests=2)}, 8)[0].endpoint == "cold"
    # A full KV cache counts as a full batch.
    assert ranked(order, {"cold": state(0), "warm": state(6, kv=0.9)}, 8)[0].endpoint == "cold"
    # Equal scores keep ring order: the first met from the request's key wins.
    assert ranked(order, {"cold": state(0), "warm": state(0)}, 8)[0].endpoint == "cold"
    # A prefix known from events goes before one assumed for a stale view, at equal scores.
    stale_home = {"cold": state(8, assumed=True), "warm": state(8)}
    assert ranked(order, stale_home, 8)[0].endpoint == "warm"
    assert score(state(8, requests=8), 8) == 0.0  # a whole prompt is worth one full engine
