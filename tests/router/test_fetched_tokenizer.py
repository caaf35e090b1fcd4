"""The router's fetch of the engines' tokenizer is bounded and validated: a bundle whose file
names could leave its folder, with too many files or none usable, one transformers cannot load,
or a body over the bound (declared, or streamed) is a counted failure, never a router error."""

from __future__ import annotations

import json

import aiohttp
import pytest
from aiohttp import web

from kvfleet.protocol.tokenizer_bundle import MAX_FILES
from kvfleet.router import fetched_tokenizer
from kvfleet.router.fetched_tokenizer import FetchFailed, fetch_bundle, load_bundle
from tests.support.servers import serving


def bundle(files: dict[str, str]) -> bytes:
    return json.dumps({"files": files}).encode()


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b"not json", "invalid"),
        (bundle({"../tokenizer.json": "{}"}), "invalid"),
        (bundle({"tokenizer.json": "{}", "sub/x.json": "{}"}), "invalid"),
        (bundle({"tokenizer.json": "{}", ".bashrc": ""}), "invalid"),
        (bundle({"tokenizer_config.json": "{}"}), "invalid"),  # no tokenizer.json
        (bundle({"tokenizer.json": "{}", **{f"f{i}": "" for i in range(MAX_FILES)}}), "invalid"),
        (json.dumps({"files": {"tokenizer.json": "{}"}, "extra": 1}).encode(), "invalid"),
        (bundle({"tokenizer.json": "not a tokenizer"}), "load"),
    ],
)
def test_a_bad_bundle_is_refused(body: bytes, reason: str) -> None:
    with pytest.raises(FetchFailed) as e:
        load_bundle(body, None)
    assert e.value.reason == reason


@pytest.mark.asyncio
async def test_a_body_over_the_bound_is_not_read_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fetched_tokenizer, "MAX_BUNDLE_BYTES", 1000)

    async def declared(_request: web.Request) -> web.Response:
        return web.Response(body=b"x" * 1001)

    async def streamed(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        response.enable_chunked_encoding()
        await response.prepare(request)
        for _ in range(3):
            await response.write(b"x" * 400)
        return response

    for handler in (declared, streamed):
        app = web.Application()
        app.router.add_get("/tokenizer", handler)
        async with serving(app) as addr, aiohttp.ClientSession() as session:
            with pytest.raises(FetchFailed) as e:
                await fetch_bundle(session, addr, {})
            assert e.value.reason == "too_large"
