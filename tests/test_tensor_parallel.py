"""Tensor-parallel layers on the CPU: a tiny Llama split over 2 gloo ranks (column/row-parallel
linears, vocabulary-parallel embedding and LM head, each rank holding its KV heads) computes the
same logits as the unsplit model."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kvfleet.engine.attention_backend import TorchAttentionBackend
from kvfleet.engine.attention_metadata import AttentionMetadata, attention_context
from kvfleet.engine.models.llama import LlamaForCausalLM
from kvfleet.engine.models.loader import load_weights

PROMPT = [5, 17, 99, 3, 250, 42, 7, 311, 64, 12, 480, 33, 2, 91, 150, 77, 8, 402, 19]


def _logits(path: str, world: int) -> torch.Tensor:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    model = LlamaForCausalLM(config, "LlamaForCausalLM").eval()
    load_weights(model, Path(path))
    head_dim = config.hidden_size // config.num_attention_heads
    n = len(PROMPT)
    num_blocks = -(-n // 16)
    for layer in model.attention_layers():
        assert layer.num_kv_heads == config.num_key_value_heads // world
        layer.kv_cache = torch.zeros(2, num_blocks, 16, layer.num_kv_heads, head_dim)
        layer.backend = TorchAttentionBackend()
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n),
        block_tables=torch.arange(num_blocks, dtype=torch.int32).unsqueeze(0),
        seq_lens=torch.tensor([n]),
        query_start_loc=torch.tensor([0, n]),
        seq_lens_cpu=[n],
        query_start_loc_cpu=[0, n],
        max_query_len=n,
        max_seq_len=n,
    )
    with torch.inference_mode(), attention_context(meta):
        hidden = model(torch.tensor(PROMPT), torch.arange(n))
        return model.compute_logits(hidden)


def _rank(rank: int, world: int, path: str, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        logits = _logits(path, world)
        if rank == 0:
            torch.save(logits, out)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_ranks_equal_one(model_dirs, tmp_path):
    path = str(model_dirs["llama"])
    whole = _logits(path, 1)
    out = str(tmp_path / "tp2.pt")
    mp.spawn(_rank, args=(2, path, _free_port(), out), nprocs=2, join=True)
    split = torch.load(out)
    assert split.shape == whole.shape
    torch.testing.assert_close(split, whole, atol=1e-4, rtol=1e-4)
    # The comparison has teeth: the logits are far from trivially equal.
    assert whole.std() > 0.1
