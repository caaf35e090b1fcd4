"""Prompt tokens run as decode rows (how the CUDA-graph path takes short prefills and mixed
steps): a token at position p as a one-token "sequence" of length p + 1 over its sequence's
block table gives the same hidden states as the prefill path, for both attention backends (the
Triton one through its interpreter), with a sliding window and soft-capping (Gemma 2) too."""

from __future__ import annotations

import asyncio
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

from pathlib import Path

import numpy as np
import pytest
import torch

from kvfleet.engine import LLM, SamplingParams
from kvfleet.engine.attention_backend import TorchAttentionBackend
from kvfleet.engine.attention_metadata import AttentionMetadata, attention_context
from kvfleet.engine.cuda_graphs import DecodeGraphs
from kvfleet.engine.model_runner import fits_decode_graph, shared_prefix_len
from kvfleet.engine.models import get_model_class
from kvfleet.engine.models.loader import load_weights
from tests.support.engine import MAX_TOKENS, assert_no_leak, recorded_cascade_prefixes

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
    from kvfleet.engine.triton_attention import TritonAttentionBackend

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


class _EagerReplay:
    """Stands in for one captured CUDA graph on the CPU: runs the model on the graph's static
    buffers (with host-side lengths, which the reference backend needs) into its output."""

    def __init__(self, graphs: DecodeGraphs, key: tuple[int, bool], log: list[int]) -> None:
        self.graphs, self.key, self.log = graphs, key, log

    def replay(self) -> None:
        g, (bs, cascade) = self.graphs, self.key
        lens = g.seq_lens[:bs].tolist()
        meta = AttentionMetadata(
            slot_mapping=g.slot_mapping[:bs],
            block_tables=g.block_tables[:bs],
            seq_lens=g.seq_lens[:bs],
            query_start_loc=g.query_start_loc[: bs + 1],
            seq_lens_cpu=lens,
            query_start_loc_cpu=list(range(bs + 1)),
            max_query_len=1,
            max_seq_len=max(max(lens), 1),
            cascade_prefix_len=g.prefix_len.clone() if cascade else None,
        )
        with attention_context(meta):
            g.outputs[self.key].copy_(g.model(g.input_ids[:bs], g.positions[:bs]))
        rows = [i for i, n in enumerate(lens) if n]
        # Rows sharing a first block belong to one sequence: a prompt chunk ran as rows.
        self.log.append(len(rows) - len({int(g.block_tables[i, 0]) for i in rows}))


def _fake_capture(
    graphs: DecodeGraphs, runner, log: list[int], sizes: list[int] | None = None
) -> None:
    for key in graphs.variants(sizes):
        graphs.outputs[key] = torch.empty(key[0], runner.model_config.hf_config.hidden_size)
        graphs.graphs[key] = _EagerReplay(graphs, key, log)
        graphs.schedule.mark_captured(key[0])


@pytest.mark.parametrize("budget", [48, 5])
def test_engine_through_the_graph_path_equals_hf(model_dirs, prompts, hf_reference, budget):
    """The runner's graph path end to end on the CPU, replays done eagerly: greedy output with
    prompt chunks next to decodes and a cache small enough to preempt equals HF's. A 5-token
    budget also makes steps of one token per sequence in which a prompt's one-token chunk
    does not sample (all rows sample only in a pure decode step)."""
    llm = LLM(str(model_dirs["llama"]), device="cpu", dtype="float32", skip_tokenizer_init=True,
              max_num_batched_tokens=budget, num_gpu_blocks_override=20)  # fmt: skip
    runner = llm.engine.runner
    graphs = DecodeGraphs(runner.model, runner.args.max_num_seqs, runner.max_blocks_per_seq,
                          runner.model_config.max_model_len, runner.device)  # fmt: skip
    shared_rows: list[int] = []
    _fake_capture(graphs, runner, shared_rows)
    runner.graphs = graphs
    one_token_chunks = 0
    forward = runner.forward

    def spy(plan, prev_tokens=None):
        nonlocal one_token_chunks
        if len(plan.input_ids) == len(plan.rows) > len(plan.sampling):
            one_token_chunks += 1
        return forward(plan, prev_tokens)

    runner.forward = spy
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
    )
    assert [o.outputs[0].token_ids for o in outs] == hf_reference["llama"]
    assert llm.engine.stats().num_preemptions > 0
    assert_no_leak(llm)
    # Prompt chunks did go through the graphs, not only decodes.
    assert max(shared_rows) > 0
    assert one_token_chunks > 0 or budget != 5


def test_shared_prefix_len():
    tables = np.array([[7, 8, 9, 4], [7, 8, 9, 5], [7, 8, 2, 6]])
    assert shared_prefix_len(tables, np.array([64, 64, 64]), 16) == 32  # row 2 parts at block 2
    assert shared_prefix_len(tables[:2], np.array([64, 64]), 16) == 48  # whole blocks only
    assert shared_prefix_len(tables[:2], np.array([40, 64]), 16) == 32  # the shortest row bounds
    assert shared_prefix_len(tables[:2], np.array([15, 64]), 16) == 0
    assert shared_prefix_len(tables[:1], np.array([64]), 16) == 64  # one row shares it all


@pytest.mark.parametrize("graphs", [False, True])
def test_cascade_decode_steps_equal_hf(model_dirs, monkeypatch, graphs):
    """Sequences on one cached system prompt decode with the shared-prefix pass (Triton, through
    its interpreter), eagerly and through the graph path (replays done eagerly): greedy output
    equals HF's, and the pass did run."""
    from kvfleet.engine import model_runner
    from tests.support.engine import hf_greedy

    monkeypatch.setattr(model_runner, "CASCADE_MIN_PREFIX", 32)
    monkeypatch.setattr(model_runner, "CASCADE_MIN_ROWS", 4)
    rng = np.random.default_rng(7)
    system = rng.integers(3, 500, 40).tolist()
    prompts = [system + rng.integers(3, 500, n).tolist() for n in (1, 5, 9, 17, 30)]
    llm = LLM(str(model_dirs["llama"]), device="cpu", dtype="float32", skip_tokenizer_init=True,
              attention_backend="triton", max_num_seqs=8)  # fmt: skip
    runner = llm.engine.runner
    if graphs:
        max_len = runner.model_config.max_model_len
        runner.graphs = DecodeGraphs(
            runner.model, 8, runner.max_blocks_per_seq, max_len, runner.device, 4
        )
        _fake_capture(runner.graphs, runner, [])
    sp = SamplingParams(temperature=0, max_tokens=8)
    with recorded_cascade_prefixes(runner) as prefixes:
        llm.generate({"prompt_token_ids": system}, SamplingParams(temperature=0, max_tokens=1))
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(model_dirs["llama"], prompts, 8)
    assert 32 in prefixes  # the system prompt's two whole blocks, attended once per step
    assert_no_leak(llm)


@pytest.mark.asyncio
async def test_graphs_left_for_after_ready_pad_meanwhile_and_are_captured_while_idle(
    model_dirs, prompts, hf_reference
):
    """A served engine starts with the small sizes and the largest captured: decode batches of
    40 rows, whose own size waits, replay the 64-row graph padded (replays done eagerly), and
    the output equals HF's; then the idle engine loop captures the rest, the size those
    batches asked for first, and counts the time as after ready."""
    from kvfleet.engine.async_engine import AsyncEngine
    from kvfleet.engine.graph_schedule import upfront_sizes
    from kvfleet.engine.startup_timing import AFTER_READY

    llm = LLM(str(model_dirs["llama"]), device="cpu", dtype="float32", skip_tokenizer_init=True,
              max_num_seqs=64)  # fmt: skip
    core = llm.engine
    runner = core.runner
    graphs = DecodeGraphs(runner.model, 64, runner.max_blocks_per_seq,
                          runner.model_config.max_model_len, runner.device)  # fmt: skip
    captures: list[list[int]] = []

    def capture(sizes: list[int] | None = None) -> None:
        sizes = graphs.schedule.pending if sizes is None else sizes
        captures.append(sorted(sizes))
        _fake_capture(graphs, runner, [], sizes)

    graphs.capture = capture
    graphs.capture(upfront_sizes(graphs.sizes))
    runner.graphs = graphs
    replayed: list[int] = []
    run = graphs.run

    def spy(*args, **kwargs):
        replayed.append(args[5])
        return run(*args, **kwargs)

    graphs.run = spy
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, n=5),
    )
    assert [[c.token_ids for c in o.outputs] for o in outs] == [
        [r] * 5 for r in hf_reference["llama"]
    ]
    assert 64 in replayed and graphs.schedule.demand[40] > 0
    assert core.graphs_pending

    engine = AsyncEngine(core)
    engine.start()
    try:
        async with asyncio.timeout(30):
            while core.graphs_pending:
                await asyncio.sleep(0.01)
    finally:
        await engine.stop()
    assert captures[1] == [40]
    assert graphs.schedule.done and core.startup.seconds[AFTER_READY] > 0
    assert_no_leak(llm)
