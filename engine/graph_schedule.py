"""Which decode CUDA graphs are captured when: a few before the engine is ready, the rest while
it serves, and what a batch replays meanwhile. Pure decisions; the capture is the runner's.

Before ready: the small sizes (the decode batches of a lightly loaded engine, which a scale-up
or a scale from zero serves first) and the largest (captured first, it sizes the graphs' shared
memory pool, which every smaller graph reuses). After ready: the rest, the sizes batches asked
for most first, one graph at a time between steps: whenever the engine is idle, and while it is
busy at most one every BUSY_CAPTURE_GAP seconds, so a capture delays running requests by one
graph's capture time (tens of milliseconds) at most that often. A batch whose own size has no
graph yet pads up to a captured size no more than PAD_MAX_FACTOR times as large (its rows cost
little next to the weights each step reads, and a replay saves the eager pass's host time), and
otherwise runs eagerly."""

from __future__ import annotations

import bisect
from collections import Counter

# Sizes up to this many rows are captured before ready.
UPFRONT_MAX_ROWS = 32
# While requests run, at most one capture per this many seconds.
BUSY_CAPTURE_GAP = 2.0
# A batch pads to a captured size at most this many times its row count; beyond, eager.
PAD_MAX_FACTOR = 4


def upfront_sizes(sizes: list[int]) -> list[int]:
    """The sizes captured before ready, largest first: every size up to UPFRONT_MAX_ROWS and
    the largest."""
    chosen = {s for s in sizes if s <= UPFRONT_MAX_ROWS}
    if sizes:
        chosen.add(max(sizes))
    return sorted(chosen, reverse=True)


class GraphSchedule:
    """The sizes a decode graph exists for and those still to capture, with how often batches
    asked for each missing one."""

    def __init__(self, sizes: list[int], captured: list[int]) -> None:
        self.sizes = sorted(set(sizes))
        self.captured = sorted(set(captured))
        unknown = set(self.captured) - set(self.sizes)
        if unknown:
            raise ValueError(f"captured sizes {sorted(unknown)} are not graph sizes {self.sizes}")
        self.demand: Counter[int] = Counter()
        self._last_busy_capture: float | None = None

    @property
    def pending(self) -> list[int]:
        have = set(self.captured)
        return [s for s in self.sizes if s not in have]

    @property
    def done(self) -> bool:
        return len(self.captured) == len(self.sizes)

    def replay_size(self, rows: int) -> int | None:
        """The captured size a batch of `rows` rows replays (padded up to it), or None: it runs
        eagerly. A batch that would have had a graph of its own counts toward that size's
        demand."""
        if not self.sizes or rows > self.sizes[-1]:
            return None
        own = self.sizes[bisect.bisect_left(self.sizes, rows)]
        i = bisect.bisect_left(self.captured, rows)
        size = self.captured[i] if i < len(self.captured) else None
        if size == own:
            return size
        self.demand[own] += 1
        if size is not None and size <= PAD_MAX_FACTOR * rows:
            return size
        return None

    def next_capture(self, now: float, idle: bool) -> int | None:
        """The size to capture now, or None. Idle: the most asked-for missing size (the largest
        of equals, whose memory the smaller ones reuse). Busy: only a size batches asked for,
        and no sooner than BUSY_CAPTURE_GAP after the last busy capture."""
        pending = self.pending
        if not pending:
            return None
        best = max(pending, key=lambda s: (self.demand[s], s))
        if idle:
            return best
        if self.demand[best] == 0:
            return None
        last = self._last_busy_capture
        if last is not None and now - last < BUSY_CAPTURE_GAP:
            return None
        self._last_busy_capture = now
        return best

    def mark_captured(self, size: int) -> None:
        if size not in self.sizes:
            raise ValueError(f"{size} is not a graph size {self.sizes}")
        if size not in self.captured:
            bisect.insort(self.captured, size)
        self.demand.pop(size, None)
