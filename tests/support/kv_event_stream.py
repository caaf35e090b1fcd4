"""A fake engine for the router's precise prefix scoring: its GET /kv_events serves the wire format
of kvfleet.protocol.kv_events (a snapshot, then batches and heartbeats a test pushes), its GET
/tokenizer the bundle a test gives it, its /metrics an idle engine's load, and its /v1 endpoints
answer with the engine's name. With an API key, /kv_events and /tokenizer answer 401 without it,
as the engine's do."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from typing import Any

from aiohttp import web

from kvfleet.engine.server.tokenizer_bundle import etag_of
from kvfleet.protocol.block_hash import prompt_block_hashes

IDLE_METRICS = (
    "vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n"
    "kvfleet_engine_max_num_seqs 8\nvllm:kv_cache_usage_perc 0\n"
)


class CharTokenizer:
    """A router tokenizer (routing_key.PromptTokenizer) of one token per character, so a test
    knows a prompt's tokens, and so its block hashes, without a model."""

    def chat(
        self,
        messages: list[Any],
        add_generation_prompt: bool,
        template_kwargs: Any,
        tools: Any = None,
    ) -> list[int]:
        return self.text("".join(f"{m['role']}:{m['content']}\n" for m in messages))

    def text(self, prompt: str) -> list[int]:
        return [ord(c) for c in prompt]


def stored(tokens: Sequence[int], medium: str = "gpu") -> dict[str, Any]:
    """The event of an engine that cached every full block of ``tokens``."""
    hashes = [h.hex() for h in prompt_block_hashes(tokens)]
    return {"type": "stored", "block_hashes": hashes, "parent_block_hash": None,
            "medium": medium, "lora_name": None}  # fmt: skip


class FakeKvEngine:
    """One engine process: ``engine_id`` is its start, ``gpu`` the hashes it holds when a
    subscriber connects. ``push`` sends a batch to every subscriber (``seq_skip`` > 0 skips
    sequence numbers, as lost lines would); ``heartbeats`` off makes the stream silent."""

    def __init__(self, name: str, engine_id: str = "e1") -> None:
        self.name = name
        self.engine_id = engine_id
        self.gpu: list[str] = []
        self.cpu: list[str] = []
        self.seq = 0
        self.heartbeats = True
        self.subscribers: list[asyncio.Queue[dict[str, Any] | None]] = []
        self.connections = 0
        self.served = 0
        # Sent in place of the snapshot when set: a broken or hostile engine's stream.
        self.garbage: bytes | None = None
        # GET /tokenizer's body (404 while None; an ETag of its digest, 304 for a request
        # that has it), the statuses it answered, and the key it and /kv_events require.
        self.tokenizer: bytes | None = None
        self.tokenizer_statuses: list[int] = []
        self.api_key: str | None = None
        # The Authorization header of each /v1 request (None: none).
        self.authorizations: list[str | None] = []

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._gate])
        app.router.add_get("/kv_events", self.kv_events)
        app.router.add_get("/tokenizer", self.serve_tokenizer)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/health", self.health)
        app.router.add_route("*", "/v1/{tail:.*}", self.answer)
        return app

    @web.middleware
    async def _gate(self, request: web.Request, handler: Any) -> web.StreamResponse:
        keyed = request.path in ("/kv_events", "/tokenizer") and self.api_key is not None
        if keyed and request.headers.get("Authorization") != f"Bearer {self.api_key}":
            return web.json_response({"error": {"code": "invalid_api_key"}}, status=401)
        return await handler(request)

    def push(self, *events: dict[str, Any], seq_skip: int = 0) -> None:
        self.seq += 1 + seq_skip
        for event in events:
            if event["type"] == "stored":
                self.medium(event["medium"]).extend(event["block_hashes"])
        line = {"type": "batch", "seq": self.seq, "events": list(events)}
        for queue in self.subscribers:
            queue.put_nowait(line)

    def medium(self, name: str) -> list[str]:
        return self.gpu if name == "gpu" else self.cpu

    def disconnect(self) -> None:
        """End every subscriber's stream (the engine went away)."""
        for queue in self.subscribers:
            queue.put_nowait(None)

    async def kv_events(self, request: web.Request) -> web.StreamResponse:
        self.connections += 1
        response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await response.prepare(request)
        queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        self.subscribers.append(queue)
        snapshot = {"type": "snapshot", "engine_id": self.engine_id, "seq": self.seq,
                    "block_size": 16, "blocks": {"gpu": self.gpu, "cpu": self.cpu}}  # fmt: skip
        try:
            if self.garbage is not None:
                await response.write(self.garbage)
                return response
            await response.write(json.dumps(snapshot).encode() + b"\n")
            while True:
                try:
                    line = await asyncio.wait_for(queue.get(), 0.2)
                except TimeoutError:
                    if not self.heartbeats:
                        continue
                    line = {"type": "heartbeat", "seq": self.seq}
                if line is None:
                    break
                await response.write(json.dumps(line).encode() + b"\n")
        finally:
            self.subscribers.remove(queue)
        return response

    async def metrics(self, _request: web.Request) -> web.Response:
        return web.Response(text=IDLE_METRICS)

    async def health(self, _request: web.Request) -> web.Response:
        return web.json_response({})

    async def serve_tokenizer(self, request: web.Request) -> web.Response:
        if self.tokenizer is None:
            response = web.json_response({"error": {"code": "no_tokenizer"}}, status=404)
        elif request.headers.get("If-None-Match") == (etag := etag_of(self.tokenizer)):
            response = web.Response(status=304, headers={"ETag": etag})
        else:
            response = web.Response(body=self.tokenizer, content_type="application/json",
                                    headers={"ETag": etag})  # fmt: skip
        self.tokenizer_statuses.append(response.status)
        return response

    async def answer(self, request: web.Request) -> web.Response:
        await request.read()
        self.authorizations.append(request.headers.get("Authorization"))
        self.served += 1
        return web.json_response({"engine": self.name})
