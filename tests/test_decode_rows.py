"""Prompt tokens run as decode rows (how the CUDA-graph path takes short prefills and mixed
steps): a token at position p as a one-token "sequence" of length p + 1 over its sequence's
block table gives the same hidden states as the prefill path, for both attention backends (the
Triton one through its interpreter), with a sliding window and soft-capping (Gemma 2) too."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

from pathlib import Path

import numpy as np
import pytest
import torch

from kvfleet.engine.attention_backend import TorchAttentionBackend
from kvfleet.engine.attention_metadata import AttentionMetadata, attention_context
from kvfleet.engine.model_runner import fits_decode_graph
from kvfleet.engine.models import get_model_class
from kvfleet.engine.models.loader import load_weights

BS = 16


def _model(path: Path, backend) -> torch.nn.Module:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    arch = config.architectures[0]
    model = get_model_class(arch)(config, arch).eval()
    load_weights(model, path)
    for layer in model.attention_layers():
        layer.backend = backend
    return model


def _run(model, cached: list[int], new: list[int], as_rows: bool) -> torch.Tensor:
    """Hidden states of `new`, after `cached` tokens already in the cache (a prefix hit or an
    earlier chunk), computed as one prefill chunk or as one decode row per token."""
    c, n = len(cached), len(new)
    total = c + n
    num_blocks = -(-total // BS) + 1
    table = torch.arange(
        1, num_blocks, dtype=torch.int32
    )  # block 0 stays unused, as the null block
    for layer in model.attention_layers():
        layer.kv_cache = torch.full(
            (2, num_blocks, BS, layer.num_kv_heads, layer.head_dim), float("nan")
        )
    with torch.inference_mode():
        if c:  # fill the cache for the cached prefix with an ordinary prefill
            _forward(model, cached, np.arange(c), table, rows=False)
        return _forward(model, new, np.arange(c, total), table, rows=as_rows)


def _forward(model, ids: list[int], positions: np.ndarray, table: torch.Tensor, rows: bool):
    n = len(ids)
    slots = torch.from_numpy(table.numpy()[positions // BS].astype(np.int64) * BS + positions % BS)
    if rows:
        lens = (positions + 1).tolist()
        meta = AttentionMetadata(
            slot_mapping=slots,
            block_tables=table.unsqueeze(0).expand(n, -1).contiguous(),
            seq_lens=torch.tensor(lens),
            query_start_loc=torch.arange(n + 1),
            seq_lens_cpu=lens,
            query_start_loc_cpu=list(range(n + 1)),
            max_query_len=1,
            max_seq_len=max(lens),
        )
    else:
        end = int(positions[-1]) + 1
        meta = AttentionMetadata(
            slot_mapping=slots,
            block_tables=table.unsqueeze(0),
            seq_lens=torch.tensor([end]),
            query_start_loc=torch.tensor([0, n]),
            seq_lens_cpu=[end],
            query_start_loc_cpu=[0, n],
            max_query_len=n,
            max_seq_len=end,
        )
    with attention_context(meta):
        return model(torch.tensor(ids), torch.from_numpy(positions))


def _backends():
    yield "torch", TorchAttentionBackend()
    pytest.importorskip("triton")
    from kvfleet.kernels.triton_backend import TritonAttentionBackend

    yield "triton", TritonAttentionBackend(max_model_len=256)


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
@pytest.mark.parametrize("backend_name", ["torch", "triton"])
def test_prompt_tokens_as_decode_rows_equal_the_prefill(model_dirs, arch, backend_name):
    backend = dict(_backends())[backend_name]
    model = _model(model_dirs[arch], backend)
    rng = np.random.default_rng(0)
    cached = rng.integers(3, 500, 21).tolist()  # the chunk starts mid-block
    new = rng.integers(3, 500, 30).tolist()  # crosses into a third block; Gemma's window is 24
    want = _run(model, cached, new, as_rows=False)
    got = _run(model, cached, new, as_rows=True)
    assert not torch.isnan(got).any()
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    # The comparison has teeth: rows that attended one token fewer would be far off.
    assert (want[1:] - want[:-1]).abs().max() > 0.1


def test_which_steps_replay_a_decode_graph():
    decode = np.array([99, 500, 7]), np.array([100, 501, 8])
    assert fits_decode_graph(*decode, max_rows=8)
    assert not fits_decode_graph(*decode, max_rows=2)  # more rows than the largest graph
    # 32 decodes at ~150 tokens plus a new 27-token chat prompt: the chat workload's step.
    pos = np.concatenate([np.full(32, 149), np.arange(27)])
    assert fits_decode_graph(pos, np.concatenate([np.full(32, 150), [27]]), max_rows=256)
    # A 200-token chunk at 3,000 tokens of context: each row would re-read the context.
    assert not fits_decode_graph(np.arange(3000, 3200), np.array([3200]), max_rows=256)
    # The bound is on the extra reads: a 255-token prompt alone is inside, 300 tokens are not.
    assert fits_decode_graph(np.arange(255), np.array([255]), max_rows=512)
    assert not fits_decode_graph(np.arange(300), np.array([300]), max_rows=512)
