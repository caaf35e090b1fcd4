"""A fake OpenAI-compatible streaming server, for the load generators' end-to-end tests."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from aiohttp import web

from tests.support.servers import runner_in_thread


def sse_chunk(text: str, chat: bool = False) -> str:
    choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
    return json.dumps({"choices": [choice]})


class FakeServer:
    """Streams one chunk per requested token with a small sleep, then usage and [DONE].

    With ``faulty``, request k (in arrival order) gets HTTP 500 when k % 5 == 0 and a stream
    cut off before [DONE] when k % 5 == 1. With ``token_cap``, no request gets more tokens
    than that, whatever it asked for.
    """

    def __init__(
        self, faulty: bool = False, delay_s: float = 0.002, token_cap: int | None = None
    ) -> None:
        self.faulty = faulty
        self.delay_s = delay_s
        self.token_cap = token_cap
        self.bodies: list[dict[str, Any]] = []
        self.auth: list[str | None] = []
        self.in_flight = 0
        self.max_in_flight = 0

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        k = len(self.bodies)
        self.bodies.append(body)
        self.auth.append(request.headers.get("Authorization"))
        if self.faulty and k % 5 == 0:
            return web.json_response({"error": {"message": "injected"}}, status=500)
        chat = request.path.endswith("/chat/completions")
        n_out = body["max_completion_tokens"] if chat else body["max_tokens"]
        n_out = min(n_out, self.token_cap or n_out)
        n_in = len(body["prompt"]) if not chat else 3 + len(body["messages"][0]["content"])
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            if chat:
                role = {"choices": [{"index": 0, "delta": {"role": "assistant"}}]}
                await resp.write(f"data: {json.dumps(role)}\n\n".encode())
            for i in range(n_out):
                await asyncio.sleep(self.delay_s)
                await resp.write(f"data: {sse_chunk(f'tok{i} ', chat)}\n\n".encode())
            if self.faulty and k % 5 == 1:
                return resp
            usage = {"prompt_tokens": n_in, "completion_tokens": n_out}
            await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        finally:
            self.in_flight -= 1


@contextmanager
def running(server: FakeServer) -> Iterator[str]:
    """Serves on 127.0.0.1 from a thread of its own (the benchmarks run their own event loop);
    yields the base URL."""
    app = web.Application()
    app.router.add_post("/v1/completions", server.handle)
    app.router.add_post("/v1/chat/completions", server.handle)
    with runner_in_thread(web.AppRunner(app)) as srv:
        yield srv.url
