"""The prefix cache's block hash: the one definition the engine caches KV by and the router
scores prompts by, so that a hash an engine publishes (its KV events) is the hash a router
computes for the same prompt.

A prompt's tokens are cut into ``BLOCK_SIZE``-token blocks; each FULL block is hashed with its
parent's hash (a chain: a block's hash names its whole prefix). A partial last block has no hash:
it is not in the cache. An extra key (a LoRA adapter's) goes into the first block's hash only;
the chain carries it to every later one.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

# The engine's KV block size, fixed (EngineArgs.block_size).
BLOCK_SIZE = 16
# A token id's width in the hashed bytes: int64, native byte order (little-endian wherever the
# engine runs), as the cache has always hashed them.
_TOKEN_BYTES = 8


def hash_block_tokens(
    parent_hash: bytes | None, token_ids: Sequence[int], extra_key: bytes | None = None
) -> bytes:
    """Chained content hash of one full block. A cryptographic digest (blake2b, 128 bits), not
    Python's hash(), so a collision cannot silently hand one request another prompt's KV, and a
    router in another process computes the same bytes. `extra_key` (vLLM's extra_keys: the
    LoRA adapter) sets apart blocks whose KV differs for the same tokens."""
    return _hash(parent_hash, array("q", token_ids).tobytes(), extra_key)


def _hash(parent_hash: bytes | None, block: bytes, extra_key: bytes | None) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    if parent_hash is not None:
        h.update(parent_hash)
    if extra_key is not None:
        h.update(len(extra_key).to_bytes(4, "little") + extra_key)
    h.update(block)
    return h.digest()


def extend_block_hashes(
    hashes: list[bytes],
    token_ids: Sequence[int],
    extra_key: bytes | None = None,
    block_size: int = BLOCK_SIZE,
) -> None:
    """Append to `hashes` (the chained hashes of the leading full blocks of `token_ids`, as this
    function left them) the hashes of the full blocks past them. A sequence that grows is
    hashed block by block over its life, never again from the start."""
    start = len(hashes)
    end = len(token_ids) // block_size
    if end <= start:
        return
    data = array("q", token_ids[start * block_size : end * block_size]).tobytes()
    width = block_size * _TOKEN_BYTES
    parent = hashes[-1] if hashes else None
    for i in range(end - start):
        parent = _hash(
            parent, data[i * width : (i + 1) * width], extra_key if start + i == 0 else None
        )
        hashes.append(parent)


def prompt_block_hashes(
    token_ids: Sequence[int], extra_key: bytes | None = None, block_size: int = BLOCK_SIZE
) -> list[bytes]:
    """The chained hashes of the prompt's full blocks, first block first: the keys under which
    an engine caches this prompt's KV."""
    hashes: list[bytes] = []
    extend_block_hashes(hashes, token_ids, extra_key, block_size)
    return hashes


def lora_extra_key(name: str) -> bytes:
    """The extra key of a LoRA adapter's blocks: its name, the OpenAI `model` of its requests,
    which is all a router knows of it. (An adapter unloaded and loaded again under the same
    name keeps the key; the engine never hands the new one the old one's blocks.)"""
    return f"lora:{name}".encode()
