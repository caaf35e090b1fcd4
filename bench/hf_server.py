"""The naive baseline server: HF transformers' ``generate`` behind an OpenAI ``/v1/completions``
endpoint, one request at a time, greedy.

The model is built from ``--model``'s config.json with transformers' own random initialisation
on the GPU when there is one (as the engine's ``--load-format dummy``); the tokenizer is the
directory's (see ``bench/dummy_tokenizer.py``)::

    python bench/hf_server.py --model /tmp/gpt2-large --dtype bfloat16 --port 8001

A request takes ``prompt`` (text or token ids), ``max_tokens``, ``ignore_eos`` (then exactly
``max_tokens`` come back) and ``stream``; a stream carries the whole completion in one chunk,
since ``generate`` hands nothing out before it is done, then the usage chunk when
``stream_options.include_usage`` asks for it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import torch
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import hf_model

logger = logging.getLogger("bench.hf_server")


class HFGenerator:
    def __init__(self, model_dir: str, dtype: str, served_name: str) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = hf_model(model_dir, dtype)
        self.served_name = served_name
        eos = self.model.generation_config.eos_token_id
        self.eos_ids = set(eos) if isinstance(eos, list) else {eos} - {None}
        # generate wants a pad id even for one unpadded row; any id will do, none is padded.
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else next(iter(self.eos_ids), 0)
        self.lock = asyncio.Lock()

    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], max_tokens: int, ignore_eos: bool) -> list[int]:
        ids = torch.tensor([prompt_ids], device=self.model.device)
        out = self.model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_tokens,
            # Keeps EOS from being sampled until max_tokens, which is what ignore_eos promises.
            min_new_tokens=max_tokens if ignore_eos else 0,
            do_sample=False,
            pad_token_id=self.pad_id,
        )
        return out[0, len(prompt_ids) :].tolist()

    async def complete(self, body: dict[str, Any]) -> tuple[list[int], list[int]]:
        """(prompt ids, completion ids) of a request body; the completion ends with an EOS id
        when the model stopped before ``max_tokens``."""
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            prompt_ids = self.tokenizer(prompt).input_ids
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            prompt_ids = prompt
        else:
            raise web.HTTPBadRequest(text="prompt must be a string or a list of token ids")
        if body.get("temperature") not in (None, 0, 0.0):
            raise web.HTTPBadRequest(text="this baseline decodes greedily: temperature must be 0")
        max_tokens = int(body.get("max_tokens") or 16)
        # One at a time, in a worker thread so that health checks still get answers.
        async with self.lock:
            out = await asyncio.to_thread(
                self.generate, prompt_ids, max_tokens, bool(body.get("ignore_eos"))
            )
        return prompt_ids, out


GENERATOR = web.AppKey("generator", HFGenerator)


async def completions(request: web.Request) -> web.StreamResponse:
    gen = request.app[GENERATOR]
    body = await request.json()
    prompt_ids, out = await gen.complete(body)
    choice = {
        "index": 0,
        "text": gen.tokenizer.decode(out, skip_special_tokens=True),
        "logprobs": None,
        "finish_reason": "stop" if out and out[-1] in gen.eos_ids else "length",
    }
    usage = {
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": len(out),
        "total_tokens": len(prompt_ids) + len(out),
    }
    head = {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": gen.served_name,
    }
    if not body.get("stream"):
        return web.json_response({**head, "choices": [choice], "usage": usage})
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    events = [{**head, "choices": [choice]}]
    if (body.get("stream_options") or {}).get("include_usage"):
        events.append({**head, "choices": [], "usage": usage})
    for event in events:
        await resp.write(f"data: {json.dumps(event)}\n\n".encode())
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def health(_request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


def build_app(gen: HFGenerator) -> web.Application:
    app = web.Application()
    app[GENERATOR] = gen
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/health", health)
    return app


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", required=True, help="directory with config.json and a tokenizer")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--served-model-name", default="hf")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8001)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    gen = HFGenerator(args.model, args.dtype, args.served_model_name)
    logger.info("HF %s on %s, %s", type(gen.model).__name__, gen.model.device, gen.model.dtype)
    web.run_app(build_app(gen), host=args.host, port=args.port, print=None, access_log=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
