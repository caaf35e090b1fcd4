"""Relaying an event stream whole events at a time (router/sse.py), so that a broken stream can
still end with an error event after complete events, never inside one."""

from __future__ import annotations

import json

from kvfleet.router.sse import DONE, EventFramer, error_events, is_event_stream


def test_whole_events_pass_at_once_and_a_partial_one_is_held() -> None:
    f = EventFramer()
    assert f.feed(b"data: 1\n\ndata: 2\n\n") == b"data: 1\n\ndata: 2\n\n"
    assert f.feed(b'data: 3\n\ndata: {"a":') == b"data: 3\n\n"
    assert f.at_boundary
    assert f.feed(b"1}") == b""
    # The blank line split across chunks, "\n" | "\n", still ends the event.
    assert f.feed(b"\n") == b""
    assert f.feed(b"\ndata: 4") == b'data: {"a":1}\n\n'
    assert f.flush() == b"data: 4"
    assert f.flush() == b""


def test_crlf_events_end_at_their_blank_line() -> None:
    f = EventFramer()
    assert f.feed(b"data: 1\r\n\r\ndata: 2\r\n") == b"data: 1\r\n\r\n"
    assert f.feed(b"\r") == b""
    assert f.feed(b"\n") == b"data: 2\r\n\r\n"
    assert f.feed(b"data: 3\n") == b""
    assert f.feed(b"\n") == b"data: 3\n\n"


def test_a_held_part_over_the_limit_is_passed_on_and_the_stream_is_inside_an_event() -> None:
    f = EventFramer(max_held=16)
    assert f.feed(b"data: " + b"x" * 8) == b""
    big = b"x" * 20
    assert f.feed(big) == b"data: " + b"x" * 28
    assert not f.at_boundary
    # Once an event ends again, the stream is back at a boundary.
    assert f.feed(b"\n\ndata: y") == b"\n\n"
    assert f.at_boundary
    # A chunk whose tail after its last event is over the limit goes whole.
    assert f.feed(b"\n\n" + b"z" * 20) == b"data: y\n\n" + b"z" * 20
    assert not f.at_boundary


def test_the_error_tail_is_the_engines() -> None:
    payload = {"error": {"message": "é", "type": "t", "param": None, "code": "c"}}
    tail = error_events(payload)
    assert tail.endswith(b"\n\n" + DONE) and DONE == b"data: [DONE]\n\n"
    event = tail.removesuffix(DONE)
    assert event.startswith(b"data: ") and json.loads(event[6:]) == payload
    # Compact and unescaped, as the engine writes its events (engine/server/streaming.py).
    assert b", " not in event and "é".encode() in event


def test_event_stream_content_types() -> None:
    assert is_event_stream("text/event-stream")
    assert is_event_stream("Text/Event-Stream; charset=utf-8")
    assert not is_event_stream("application/json")
    assert not is_event_stream("")
