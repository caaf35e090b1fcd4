"""Relaying a server-sent event stream whole events at a time, so that a stream that breaks can
still be ended the way the engine ends one that fails: an error event, then ``data: [DONE]``.

A chunk from the engine may end inside an event (the transport splits what it likes); the part
after the last complete event is held until the rest arrives, which costs a client nothing: an
SSE client acts on an event only once its blank line is in. Should the stream break, the held
part is dropped and the error event follows complete events, never half of one. A held part
over ``max_held`` bytes (an event that large, or an upstream that never ends one) is passed on
as it is, to keep the router's memory bounded; until an event ends again, a break then cannot
be reported in the stream.
"""

from __future__ import annotations

import json
from typing import Any

# What the engine ends a stream with, failed or not (engine/server/streaming.py).
DONE = b"data: [DONE]\n\n"
# An event ends at a blank line: "\n\n" also ends "\r\n\n"; "\n\r\n" also ends "\r\n\r\n".
_ENDS = ((b"\n\n", 2), (b"\n\r\n", 3))
MAX_HELD_BYTES = 1 << 20


def is_event_stream(content_type: str) -> bool:
    return content_type.split(";", 1)[0].strip().lower() == "text/event-stream"


def error_events(payload: dict[str, Any]) -> bytes:
    """An error event and the end of the stream, as the engine sends them."""
    data = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return b"data: " + data.encode() + b"\n\n" + DONE


class EventFramer:
    """Splits a byte stream at event boundaries: ``feed`` returns what may be sent now."""

    def __init__(self, max_held: int = MAX_HELD_BYTES) -> None:
        self.max_held = max_held
        self._held = b""
        # Whether what was sent so far ends with a complete event (nothing sent: it does).
        self.at_boundary = True

    def feed(self, chunk: bytes) -> bytes:
        data = self._held + chunk if self._held else chunk
        # A boundary that spans the held part and the chunk is found too: the search starts
        # just before the chunk.
        start = max(0, len(self._held) - 2)
        end = 0
        for sep, n in _ENDS:
            if (i := data.rfind(sep, start)) >= 0:
                end = max(end, i + n)
        if end:
            self._held = data[end:]
            self.at_boundary = True
            if len(self._held) <= self.max_held:
                return data[:end]
        elif len(data) <= self.max_held:
            self._held = data
            return b""
        # Too much held: pass it all on.
        self._held = b""
        self.at_boundary = False
        return data

    def flush(self) -> bytes:
        """What is held, at the stream's normal end (an upstream's last event may lack its
        blank line: it is passed on as it came)."""
        held, self._held = self._held, b""
        return held
