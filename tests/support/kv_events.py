"""A subscriber to an engine's GET /kv_events for tests, reading on a thread of its own: each
line validated against the wire format, its seq checked, and the picture a router would build
(the block hashes per medium) kept up to date."""

from __future__ import annotations

import http.client
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from urllib.parse import urlsplit

from kvfleet.protocol.kv_events import (
    MEDIA,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    Heartbeat,
    Snapshot,
    parse_line,
)


class KVEventsReader:
    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        assert parts.hostname is not None and parts.port is not None
        self._conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
        self._conn.request("GET", "/kv_events")
        self.response = self._conn.getresponse()
        self.status = self.response.status
        self.content_type = self.response.getheader("Content-Type")
        self.picture: dict[str, set[str]] = {m: set() for m in MEDIA}
        self.engine_id: str | None = None
        self.seq: int | None = None
        self.snapshot: Snapshot | None = None
        self.kinds: Counter[str] = Counter()  # lines and events seen, by type
        self.stored: list[BlockStored] = []
        self.error: BaseException | None = None  # what broke the stream (a bad line included)
        self.ended = threading.Event()  # the stream ended cleanly (the chunked end came)
        self._lock = threading.Lock()
        if self.status == 200:
            self._thread = threading.Thread(target=self._read, daemon=True)
            self._thread.start()

    def _read(self) -> None:
        try:
            while line := self.response.readline():
                self._apply(parse_line(line))
            self.ended.set()
        except BaseException as e:
            self.error = e

    def _apply(self, line: Snapshot | EventBatch | Heartbeat) -> None:
        with self._lock:
            self.kinds[line.type] += 1
            if isinstance(line, Snapshot):
                assert self.snapshot is None, "a second snapshot"
                self.snapshot, self.engine_id, self.seq = line, line.engine_id, line.seq
                self.picture = {"gpu": set(line.blocks.gpu), "cpu": set(line.blocks.cpu)}
                return
            assert self.seq is not None, f"{line.type} before the snapshot"
            if isinstance(line, Heartbeat):
                assert line.seq == self.seq, (line, self.seq)
                return
            assert line.seq == self.seq + 1, f"seq {line.seq} after {self.seq}"
            self.seq = line.seq
            for event in line.events:
                self.kinds[event.type] += 1
                if isinstance(event, BlockStored):
                    self.stored.append(event)
                    self.picture[event.medium].update(event.block_hashes)
                elif isinstance(event, BlockRemoved):
                    assert set(event.block_hashes) <= self.picture[event.medium], event
                    self.picture[event.medium].difference_update(event.block_hashes)
                else:
                    assert isinstance(event, AllBlocksCleared)
                    self.picture = {m: set() for m in MEDIA}

    def wait_for(self, what: Callable[[KVEventsReader], bool], timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                if what(self):
                    return
            assert self.error is None, repr(self.error)
            assert time.monotonic() < deadline, f"not seen in {timeout}s: {self.kinds}"
            time.sleep(0.02)

    def close(self) -> None:
        # Shut the socket first: the reading thread holds the response's buffer until a line
        # (up to a heartbeat) comes, and closing it would wait for that.
        sock = self._conn.sock
        if sock is not None:
            sock.shutdown(socket.SHUT_RDWR)
        self._conn.close()
