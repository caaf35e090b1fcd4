"""The prefix cache's block hash, which the engine caches by and the router scores by: its bytes
are a wire format now (KV events), so they are pinned."""

from __future__ import annotations

import numpy as np

from kvfleet.protocol.block_hash import (
    BLOCK_SIZE,
    extend_block_hashes,
    hash_block_tokens,
    lora_extra_key,
    prompt_block_hashes,
)


def test_the_hash_bytes_are_pinned() -> None:
    """Digests the engine computed before the hash moved here (numpy int64 tokens): a change
    would make every router disagree with every engine of an older release."""
    first = hash_block_tokens(None, list(range(16)), lora_extra_key("ad"))
    assert first.hex() == "607718adeb2aeea439fd6c64961552d6"
    assert hash_block_tokens(first, [100000] * 16).hex() == "5d565ee7d7acbca7cee49291f66600d1"
    assert hash_block_tokens(None, list(range(16))).hex() == "d995551d6b33c83d05b8d9a79d1c7671"
    assert hash_block_tokens(None, np.arange(16, dtype=np.int64).tolist()) == hash_block_tokens(
        None, range(16)
    )


def test_the_hash_is_content_and_parent_sensitive() -> None:
    toks = [7] * 16
    p1, p2 = hash_block_tokens(None, [1] * 16), hash_block_tokens(None, [2] * 16)
    assert hash_block_tokens(None, toks) != hash_block_tokens(None, [*toks[:-1], 8])
    assert hash_block_tokens(p1, toks) != hash_block_tokens(p2, toks)
    assert hash_block_tokens(p1, toks) != hash_block_tokens(None, toks)
    assert len(hash_block_tokens(None, toks)) == 16


def test_prompt_block_hashes_chain_full_blocks_with_the_extra_key_on_the_first() -> None:
    tokens = list(range(3 * BLOCK_SIZE + 5))  # three full blocks and a partial one
    key = lora_extra_key("ad")
    expected, parent = [], None
    for i in range(3):
        block = tokens[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE]
        parent = hash_block_tokens(parent, block, key if i == 0 else None)
        expected.append(parent)
    assert prompt_block_hashes(tokens, key) == expected
    assert prompt_block_hashes(tokens)[0] != expected[0]
    assert prompt_block_hashes(tokens[: BLOCK_SIZE - 1]) == []
    assert len(prompt_block_hashes(tokens, block_size=8)) == len(tokens) // 8


def test_extending_as_tokens_arrive_equals_hashing_at_once() -> None:
    tokens = list(range(100))
    hashes: list[bytes] = []
    for end in (3, 16, 17, 40, 100):
        extend_block_hashes(hashes, tokens[:end], b"k")
    assert hashes == prompt_block_hashes(tokens, b"k")


def test_the_lora_key_is_the_adapters_name() -> None:
    assert lora_extra_key("ad") == b"lora:ad"
    assert lora_extra_key("a") != lora_extra_key("b")
