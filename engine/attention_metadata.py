"""What every attention layer needs to know about the current flat batch, set once per step by the
ModelRunner and read by each layer (the model's forward signature stays HF-like)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] cache slot of each new token
    block_tables: torch.Tensor  # [num_seqs, max_blocks]
    seq_lens: torch.Tensor  # [num_seqs] context length after this step
    query_start_loc: torch.Tensor  # [num_seqs + 1]
    # Host copies, so a backend that loops over sequences never syncs with the device.
    seq_lens_cpu: list[int]
    query_start_loc_cpu: list[int]
    max_query_len: int
    max_seq_len: int
    # Decode steps only: [1] tokens every sequence's context starts with in the same blocks, to
    # be attended once for the whole batch (cascade attention); None when not worth it.
    cascade_prefix_len: torch.Tensor | None = None


_current: AttentionMetadata | None = None


@contextmanager
def attention_context(meta: AttentionMetadata) -> Iterator[None]:
    global _current
    prev, _current = _current, meta
    try:
        yield
    finally:
        _current = prev


def get_attention_metadata() -> AttentionMetadata:
    if _current is None:
        raise RuntimeError("attention layers ran outside ModelRunner's attention_context")
    return _current
