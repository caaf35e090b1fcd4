"""The engines' own tokenizer, fetched from them (GET /tokenizer, kvfleet.protocol.tokenizer_bundle)
when the router is given none (--tokenizer) and precise prefix scoring is on: a router deployed
by the operator carries no model files, and must tokenize prompts exactly as the engines do for
their block hashes to match.

The first ready engine that answers gives it; until then, and for good where no engine can, the
router scores approximately (keys of characters, no KV events followed). Afterwards each engine
that starts (a new endpoint, or a new engine at one: its KV events say) is asked whether its
tokenizer is still that one (the bundle's ETag); one that has another (a rollout to another
model or chat template) gives the router its tokenizer, since the engines that start are the
ones that stay. Each failed round is
counted by reason (FETCH_FAILURES) and logged, and the next comes after a backoff with jitter.
The bundle is semi-trusted input: read up to its bound, validated, written into a private
temporary folder (mode 0700) under its plain file names, loaded there by transformers off the
event loop, and the folder removed.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

import aiohttp
from pydantic import ValidationError

from kvfleet.protocol.tokenizer_bundle import MAX_BUNDLE_BYTES, PATH, TokenizerBundle
from kvfleet.router.endpoints import Backoff
from kvfleet.router.prompt_tokenizer import EngineTokenizer

logger = logging.getLogger("kvfleet.router.fetched_tokenizer")

# Why a fetch from one engine failed: connect (not reached, or no answer in time), status (not
# 200: no tokenizer there, a wrong key), too_large, invalid (not a bundle), load (transformers
# could not load it).
FETCH_FAILURES = ("connect", "status", "too_large", "invalid", "load")
# One engine's whole answer, the bundle read included.
FETCH_TIMEOUT_S = 60.0
# Rounds over the engines, apart by a backoff from the first to the longest, with jitter.
FIRST_BACKOFF_S = 1.0
MAX_BACKOFF_S = 60.0


class FetchFailed(Exception):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def load_bundle(body: bytes, max_chars: int | None) -> EngineTokenizer:
    """The tokenizer of a bundle's bytes; raises FetchFailed (invalid, load)."""
    try:
        bundle = TokenizerBundle.model_validate_json(body)
    except ValidationError as e:
        raise FetchFailed("invalid", f"not a tokenizer bundle: {e.errors()[0]['msg']}") from None
    folder = Path(tempfile.mkdtemp(prefix="kvfleet-tokenizer-"))
    try:
        for name, text in bundle.files.items():
            (folder / name).write_text(text, encoding="utf-8")
        try:
            return EngineTokenizer(str(folder), max_chars, bundle.tool_call_parser)
        except Exception as e:  # transformers' failures on a file it cannot read are of any kind
            raise FetchFailed("load", f"transformers cannot load it: {e!r}") from None
    finally:
        shutil.rmtree(folder, ignore_errors=True)


class Fetched(NamedTuple):
    tokenizer: EngineTokenizer
    etag: str | None
    endpoint: str


async def fetch_bundle(
    session: aiohttp.ClientSession,
    endpoint: str,
    headers: dict[str, str],
    etag: str | None = None,
) -> tuple[bytes, str | None] | None:
    """The bundle's bytes from one engine, at most MAX_BUNDLE_BYTES, and its ETag; None where
    it is ``etag`` still; raises FetchFailed."""
    if etag is not None:
        headers = {**headers, "If-None-Match": etag}
    try:
        async with (
            asyncio.timeout(FETCH_TIMEOUT_S),
            session.get(f"http://{endpoint}{PATH}", headers=headers) as response,
        ):
            if response.status == 304 and etag is not None:
                return None
            if response.status != 200:
                raise FetchFailed("status", f"{PATH} answered {response.status}")
            declared = response.content_length
            if declared is not None and declared > MAX_BUNDLE_BYTES:
                raise FetchFailed("too_large", f"{declared} bytes declared")
            body = bytearray()
            async for chunk in response.content.iter_any():
                body += chunk
                if len(body) > MAX_BUNDLE_BYTES:
                    raise FetchFailed("too_large", f"over {MAX_BUNDLE_BYTES} bytes")
            return bytes(body), response.headers.get("ETag")
    except (aiohttp.ClientError, OSError, TimeoutError) as e:
        raise FetchFailed("connect", f"{type(e).__name__}: {e}") from None


async def fetch_tokenizer(
    endpoints: Callable[[], Sequence[str]],
    ready: asyncio.Event,
    headers: dict[str, str],
    max_chars: int | None,
    on_failure: Callable[[str], None],
) -> Fetched:
    """The tokenizer of the first engine of ``endpoints()`` that gives one, trying them in turn
    each round (waiting for ``ready`` when there is none), rounds apart by a backoff."""
    backoff = Backoff(FIRST_BACKOFF_S, MAX_BACKOFF_S)
    async with aiohttp.ClientSession() as session:
        while True:
            await ready.wait()
            for endpoint in endpoints():
                try:
                    fetched = await fetch_from(session, endpoint, headers, max_chars)
                except FetchFailed as e:
                    on_failure(e.reason)
                    logger.warning("tokenizer from %s: %s; prefix scoring approximate",
                                   endpoint, e)  # fmt: skip
                    continue
                assert fetched is not None
                logger.info("prefix keys from tokens: the engines' tokenizer, from %s", endpoint)
                return fetched
            await backoff.sleep()


async def fetch_from(
    session: aiohttp.ClientSession,
    endpoint: str,
    headers: dict[str, str],
    max_chars: int | None,
    etag: str | None = None,
) -> Fetched | None:
    """One engine's tokenizer; None where its ETag is ``etag`` still; raises FetchFailed."""
    fetched = await fetch_bundle(session, endpoint, headers, etag)
    if fetched is None:
        return None
    body, new_etag = fetched
    tokenizer = await asyncio.to_thread(load_bundle, body, max_chars)
    return Fetched(tokenizer, new_etag, endpoint)
