"""The LoRA adapters a server serves, by name: those of --lora-modules, and with
--enable-runtime-lora-updating those loaded and unloaded since (vLLM's /v1/load_lora_adapter and
/v1/unload_lora_adapter). A request whose `model` is an adapter's name runs with it."""

from __future__ import annotations

import asyncio
import itertools

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field

from kvfleet.engine.lora_request import LoRARequest
from kvfleet.engine.server.errors import bad_request
from kvfleet.engine.server.serving import SERVING
from kvfleet.engine.server.validation import parse_body

# Adapters one server has registered at once: each costs a name and a path here (its weights
# live in the engine's bounded slots and host cache), but an endless stream of loads must not
# grow the table for ever.
MAX_REGISTERED_ADAPTERS = 4096
MAX_NAME_CHARS = 256
MAX_PATH_CHARS = 4096


class AdapterRegistry:
    def __init__(self, initial: list[LoRARequest]) -> None:
        self.by_name: dict[str, LoRARequest] = {lora.lora_name: lora for lora in initial}
        # Every adapter gets an id never used before: one unloaded and loaded again under the
        # same name shares no cached KV with the one before (KVCacheManager checks the id).
        self._ids = itertools.count(max((lora.lora_int_id for lora in initial), default=0) + 1)

    def get(self, name: str | None) -> LoRARequest | None:
        return None if name is None else self.by_name.get(name)

    def new(self, name: str, path: str) -> LoRARequest:
        return LoRARequest(name, next(self._ids), path)


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1, max_length=MAX_NAME_CHARS)
    lora_path: str = Field(min_length=1, max_length=MAX_PATH_CHARS)


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1, max_length=MAX_NAME_CHARS)
    # vLLM's request carries it too; the name alone decides.
    lora_int_id: int | None = None


ADAPTERS = web.AppKey("adapters", AdapterRegistry)


async def load_lora_adapter(request: web.Request) -> web.Response:
    """Check the adapter folder against the engine (off the event loop: it reads the file's
    header) and serve it under its name from now on."""
    ctx = request.app[SERVING]
    registry = request.app[ADAPTERS]
    req = await parse_body(request, LoadLoRAAdapterRequest)
    name = req.lora_name
    if name in registry.by_name:
        raise bad_request(f"The lora adapter '{name}' has already been loaded.", "lora_name")
    if name in ctx.served_model_names:
        raise bad_request(f"'{name}' is the base model's name, not one for an adapter", "lora_name")
    if len(registry.by_name) >= MAX_REGISTERED_ADAPTERS:
        raise bad_request(
            f"this server serves {MAX_REGISTERED_ADAPTERS} adapters already; unload one first",
            "lora_name",
        )
    lora = registry.new(name, req.lora_path)
    try:
        await asyncio.to_thread(ctx.engine.check_adapter, lora)
    except ValueError as e:
        raise bad_request(str(e), "lora_path") from None
    if name in registry.by_name:  # loaded by a request that came meanwhile
        raise bad_request(f"The lora adapter '{name}' has already been loaded.", "lora_name")
    registry.by_name[name] = lora
    return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora_adapter(request: web.Request) -> web.Response:
    """Stop serving the adapter: new requests for it get 404 at once; the engine frees its slot
    and host copy when no request of it is left."""
    registry = request.app[ADAPTERS]
    req = await parse_body(request, UnloadLoRAAdapterRequest)
    lora = registry.by_name.pop(req.lora_name, None)
    if lora is None:
        raise bad_request(f"The lora adapter '{req.lora_name}' cannot be found.", "lora_name")
    request.app[SERVING].engine.remove_adapter(lora)
    return web.Response(text=f"Success: LoRA adapter '{req.lora_name}' removed successfully.")
