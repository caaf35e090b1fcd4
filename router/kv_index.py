"""Which engine holds which KV block, per medium, as the engines' event streams say
(GET /kv_events, kvfleet.protocol.kv_events): the router's exact view of the fleet's prefix
caches, for precise prefix scoring (prefix_score.py). Pure: the subscriber (kv_subscriber.py)
reads the streams and hands each line here with the time it came.

An engine's view starts from its snapshot and follows its batches in sequence order; a batch or
heartbeat whose seq is not the one expected means lines were lost, and the view is dropped
until the subscriber resyncs from a new snapshot. A view is *live* while its last line is at
most ``stale_after`` seconds old: the engine heartbeats every second when idle, so a silent
stream is a dead one, and a dead stream's view describes a cache that may have moved on.

Memory is bounded per engine (``max_blocks``, over both media): a stream that announces more
blocks than that keeps its first ``max_blocks`` and the rest are not indexed (the view then
under-reports that engine's cache, which costs hits, never correctness), with one warning per
engine each time it goes over.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kvfleet.protocol.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    Medium,
    Snapshot,
)

logger = logging.getLogger("kvfleet.router.kv_index")

# A block held in host memory (the CPU KV tier) is worth this much of one in GPU memory: it
# saves the block's prefill as a GPU block does, but the engine copies it back over PCIe before
# the request's prefill goes on (a few tens of microseconds a block against the hundreds its
# prefill takes), and that copy shares the link with every other swap. 0.8 keeps a GPU copy
# ahead of a CPU one for the same prefix while a long CPU-held prefix still beats a short GPU one.
CPU_BLOCK_WEIGHT = 0.8
# Per engine: an 8B model's 16-token blocks on a 141 GB GPU are ~70k, and a host tier a few
# times that; 2^18 bounds an engine's view to some 30 MB of hashes.
MAX_BLOCKS = 2**18


class Gap(Exception):
    """A line out of sequence: the view is dropped, the stream must resync from a snapshot."""


@dataclass
class EngineView:
    engine_id: str
    seq: int
    seen: float
    gpu: set[bytes] = field(default_factory=set)
    cpu: set[bytes] = field(default_factory=set)
    over_cap: bool = False

    def size(self) -> int:
        return len(self.gpu) + len(self.cpu)

    def medium(self, medium: Medium) -> set[bytes]:
        return self.gpu if medium == "gpu" else self.cpu


@dataclass(frozen=True)
class CachedPrefix:
    """The leading blocks of a prompt an engine holds: consecutive from the first, each in GPU
    or host memory (the first block held in neither ends the prefix)."""

    gpu: int = 0
    cpu: int = 0

    @property
    def blocks(self) -> float:
        """GPU blocks count 1, host-memory blocks CPU_BLOCK_WEIGHT."""
        return self.gpu + CPU_BLOCK_WEIGHT * self.cpu


class KvIndex:
    def __init__(self, stale_after: float, max_blocks: int = MAX_BLOCKS) -> None:
        if stale_after <= 0 or max_blocks < 1:
            raise ValueError("stale_after must be > 0 and max_blocks >= 1")
        self.stale_after = stale_after
        self.max_blocks = max_blocks
        self._views: dict[str, EngineView] = {}

    def snapshot(self, endpoint: str, line: Snapshot, now: float) -> None:
        """Start (or restart) an engine's view from its snapshot."""
        self.install(endpoint, build_view(endpoint, line, now, self.max_blocks))

    def install(self, endpoint: str, view: EngineView) -> None:
        """An engine's view built from its snapshot (build_view, off the event loop for a
        large one)."""
        self._views[endpoint] = view

    def apply(self, endpoint: str, batch: EventBatch, now: float) -> int:
        """Apply one batch of events in order; the number applied. Raises Gap (and drops the
        view) when the batch is not the next in sequence or the engine has no view."""
        view = self._next(endpoint, batch.seq, batch.seq - 1)
        view.seq, view.seen = batch.seq, now
        for event in batch.events:
            if isinstance(event, BlockStored):
                _store(endpoint, view, event.medium, event.block_hashes, self.max_blocks)
            elif isinstance(event, BlockRemoved):
                held = view.medium(event.medium)
                held.difference_update(_hashes(event.block_hashes))
                view.over_cap = view.over_cap and view.size() >= self.max_blocks
            elif isinstance(event, AllBlocksCleared):
                view.gpu.clear()
                view.cpu.clear()
                view.over_cap = False
        return len(batch.events)

    def heartbeat(self, endpoint: str, seq: int, now: float) -> None:
        """A quiet stream's sign of life; raises Gap as apply does (a heartbeat repeats the
        last seq)."""
        self._next(endpoint, seq, seq).seen = now

    def drop(self, endpoint: str) -> None:
        """Forget an engine (its stream ended, or it left the fleet)."""
        self._views.pop(endpoint, None)

    def live(self, now: float) -> frozenset[str]:
        """The engines whose view is current: a line within the last ``stale_after`` seconds."""
        return frozenset(ep for ep, v in self._views.items() if now - v.seen <= self.stale_after)

    def engines(self) -> frozenset[str]:
        return frozenset(self._views)

    def size(self, endpoint: str) -> int:
        view = self._views.get(endpoint)
        return view.size() if view is not None else 0

    def longest_prefix(self, endpoint: str, hashes: Sequence[bytes]) -> CachedPrefix:
        """How many of a prompt's leading blocks (its chained hashes, first block first) the
        engine holds, per medium; nothing for an engine without a view."""
        view = self._views.get(endpoint)
        if view is None:
            return CachedPrefix()
        gpu = cpu = 0
        for h in hashes:
            if h in view.gpu:
                gpu += 1
            elif h in view.cpu:
                cpu += 1
            else:
                break
        return CachedPrefix(gpu, cpu)

    def _next(self, endpoint: str, seq: int, expected_last: int) -> EngineView:
        view = self._views.get(endpoint)
        if view is None:
            raise Gap(f"{endpoint}: no snapshot before seq {seq}")
        if view.seq != expected_last:
            del self._views[endpoint]
            raise Gap(f"{endpoint}: seq {seq} after {view.seq}")
        return view


def build_view(endpoint: str, line: Snapshot, now: float, max_blocks: int) -> EngineView:
    """An engine's view as its snapshot line states it."""
    view = EngineView(line.engine_id, line.seq, now)
    _store(endpoint, view, "gpu", line.blocks.gpu, max_blocks)
    _store(endpoint, view, "cpu", line.blocks.cpu, max_blocks)
    return view


def _store(
    endpoint: str, view: EngineView, medium: Medium, hexes: Iterable[str], max_blocks: int
) -> None:
    held = view.medium(medium)
    for h in _hashes(hexes):
        if h in held:
            continue
        if view.size() >= max_blocks:
            if not view.over_cap:
                view.over_cap = True
                logger.warning(
                    "engine %s announces over %d KV blocks; the rest are not indexed (its "
                    "prefix scores under-report until it evicts some)",
                    endpoint,
                    max_blocks,
                )
            return
        held.add(h)


def _hashes(hexes: Iterable[str]) -> Iterable[bytes]:
    return (bytes.fromhex(h) for h in hexes)
