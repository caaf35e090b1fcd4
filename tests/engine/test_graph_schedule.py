"""Which decode graphs are captured before ready and which after, and what a batch replays
meanwhile (engine/graph_schedule.py)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvfleet.engine.cuda_graphs import capture_sizes
from kvfleet.engine.graph_schedule import (
    BUSY_CAPTURE_GAP,
    PAD_MAX_FACTOR,
    UPFRONT_MAX_ROWS,
    GraphSchedule,
    upfront_sizes,
)

SIZES = capture_sizes(512)


def test_before_ready_the_small_sizes_and_the_largest_first():
    assert upfront_sizes(SIZES) == [512, 32, 24, 16, 8, 4, 2, 1]
    assert upfront_sizes(capture_sizes(8)) == [8, 4, 2, 1]
    # Far fewer than the 67 sizes of a large GPU's default.
    assert len(upfront_sizes(SIZES)) * 8 < len(SIZES)


def test_a_batch_pads_to_a_captured_size_within_the_factor_else_runs_eagerly():
    s = GraphSchedule(SIZES, upfront_sizes(SIZES))
    assert s.replay_size(3) == 4  # its own size, captured
    assert s.replay_size(32) == 32
    assert s.replay_size(33) is None  # 512 is more than 4 x 33 rows
    assert s.replay_size(128) == 512  # exactly the factor
    assert s.replay_size(600) is None  # more rows than any graph
    # The two batches that would have had a graph of their own (40, 128) asked for it.
    assert s.demand == {40: 1, 128: 1}


def test_idle_captures_the_most_asked_for_size_then_the_largest():
    s = GraphSchedule(SIZES, upfront_sizes(SIZES))
    for rows in (100, 100, 60):
        s.replay_size(rows)
    assert s.next_capture(0.0, idle=True) == 104
    s.mark_captured(104)
    assert s.replay_size(100) == 104 and 104 not in s.demand
    assert s.next_capture(0.0, idle=True) == 64
    s.mark_captured(64)
    assert s.next_capture(0.0, idle=True) == 504  # nothing asked for: largest first


def test_busy_captures_only_what_batches_asked_for_and_at_most_once_a_gap():
    s = GraphSchedule(SIZES, upfront_sizes(SIZES))
    assert s.next_capture(10.0, idle=False) is None  # nobody asked
    s.replay_size(50)
    s.replay_size(70)
    s.replay_size(70)
    assert s.next_capture(10.0, idle=False) == 72
    s.mark_captured(72)
    assert s.next_capture(10.0 + BUSY_CAPTURE_GAP / 2, idle=False) is None
    assert s.next_capture(10.0 + BUSY_CAPTURE_GAP, idle=False) == 56
    # Idle is never held back by the gap.
    s.mark_captured(56)
    s.replay_size(90)
    assert s.next_capture(10.0 + BUSY_CAPTURE_GAP, idle=True) == 96


def test_done_once_every_size_is_captured():
    sizes = capture_sizes(16)
    s = GraphSchedule(sizes, [])
    assert s.pending == sizes and not s.done
    while (size := s.next_capture(0.0, idle=True)) is not None:
        s.mark_captured(size)
    assert s.done and s.captured == sizes


@given(st.integers(1, 512), st.integers(1, 512))
def test_a_replay_size_is_captured_holds_the_rows_and_pads_within_the_factor(max_seqs, rows):
    sizes = capture_sizes(max_seqs)
    s = GraphSchedule(sizes, upfront_sizes(sizes))
    size = s.replay_size(rows)
    if size is not None:
        assert size in s.captured and rows <= size
        own = min(x for x in sizes if x >= rows)
        assert size == own or size <= PAD_MAX_FACTOR * rows
    elif rows <= max_seqs:
        assert rows > UPFRONT_MAX_ROWS  # every small batch has a graph from the start
