"""PROVISIONAL copy of the issue-41 contract (kv-events builds the real one): the prefix cache's
chained block hash, shared by the engine and the router."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from array import array

BLOCK_SIZE = 16


def hash_block_tokens(
    parent_hash: bytes | None, token_ids: Sequence[int], extra_key: bytes | None = None
) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    if parent_hash is not None:
        h.update(parent_hash)
    if extra_key is not None:
        h.update(len(extra_key).to_bytes(4, "little") + extra_key)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def prompt_block_hashes(
    token_ids: Sequence[int], extra_key: bytes | None = None, block_size: int = BLOCK_SIZE
) -> list[bytes]:
    hashes: list[bytes] = []
    for i in range(len(token_ids) // block_size):
        parent = hashes[i - 1] if i else None
        block = token_ids[i * block_size : (i + 1) * block_size]
        hashes.append(hash_block_tokens(parent, block, None if i else extra_key))
    return hashes


def lora_extra_key(name: str) -> bytes:
    return f"lora:{name}".encode()
