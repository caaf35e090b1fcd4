"""GET /tokenizer: the tokenizer the engine loaded (its --chat-template included; a GGUF model's
too, which the engine builds as an HF tokenizer), as the files ``save_pretrained`` writes, in one
JSON bundle (kvfleet.protocol.tokenizer_bundle), so that a router tokenizes prompts as the
engine does. Built once, on the first request, off the event loop; its ETag (the body's
digest) lets a router ask a newly started engine whether its tokenizer is still the one it has.
Not under /v1, so the router's proxy never forwards it; behind the API key when one is set."""

from __future__ import annotations

import asyncio
import hashlib
import tempfile
from pathlib import Path
from typing import Any

from aiohttp import web

from kvfleet.engine.server.errors import APIError
from kvfleet.engine.server.serving import SERVING
from kvfleet.protocol.tokenizer_bundle import MAX_BUNDLE_BYTES, TokenizerBundle


class TokenizerNotServable(Exception):
    """The engine's tokenizer has no bundle a router could load."""


def bundle_bytes(tokenizer: Any, tool_call_parser: str | None = None) -> bytes:
    """The tokenizer's files as a bundle, with the server's tool-call parser family; raises
    TokenizerNotServable."""
    with tempfile.TemporaryDirectory(prefix="kvfleet-tokenizer-") as folder:
        # legacy_format False: tokenizer.json alone, no slow tokenizer's vocabulary files.
        tokenizer.save_pretrained(folder, legacy_format=False)
        files: dict[str, str] = {}
        for path in sorted(Path(folder).iterdir()):
            try:
                files[path.name] = path.read_text(encoding="utf-8")
            except UnicodeDecodeError:
                raise TokenizerNotServable(f"{path.name} is not a text file") from None
    try:
        bundle = TokenizerBundle(files=files, tool_call_parser=tool_call_parser)
        body = bundle.model_dump_json().encode()
    except ValueError as e:
        raise TokenizerNotServable(str(e)) from None
    if len(body) > MAX_BUNDLE_BYTES:
        raise TokenizerNotServable(f"{len(body)} bytes, over the bound of {MAX_BUNDLE_BYTES}")
    return body


def etag_of(body: bytes) -> str:
    return f'"{hashlib.sha256(body).hexdigest()[:32]}"'


class TokenizerBundleCache:
    """The bundle and its ETag, built at most once (a failure is remembered too: it would fail
    again)."""

    def __init__(self, tokenizer: Any, tool_call_parser: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.tool_call_parser = tool_call_parser
        self._lock = asyncio.Lock()
        self._built: tuple[bytes, str] | TokenizerNotServable | None = None

    async def get(self) -> tuple[bytes, str]:
        async with self._lock:
            if self._built is None:
                try:
                    body = await asyncio.to_thread(
                        bundle_bytes, self.tokenizer, self.tool_call_parser
                    )
                    self._built = body, etag_of(body)
                except TokenizerNotServable as e:
                    self._built = e
        if isinstance(self._built, TokenizerNotServable):
            raise self._built
        return self._built


TOKENIZER_BUNDLE = web.AppKey("tokenizer_bundle", TokenizerBundleCache)


async def serve_tokenizer(request: web.Request) -> web.Response:
    if request.app[SERVING].tokenizer is None:
        raise APIError(404, "this server runs without a tokenizer", "not_found_error",
                       code="no_tokenizer")  # fmt: skip
    try:
        body, etag = await request.app[TOKENIZER_BUNDLE].get()
    except TokenizerNotServable as e:
        raise APIError(500, f"the engine's tokenizer cannot be served: {e}", "server_error",
                       code="tokenizer_not_servable") from None  # fmt: skip
    if request.headers.get("If-None-Match") == etag:
        return web.Response(status=304, headers={"ETag": etag})
    return web.Response(body=body, content_type="application/json", headers={"ETag": etag})
