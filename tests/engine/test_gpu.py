"""The CUDA path: Triton kernels, CUDA graphs, KV sizing. Skipped where no GPU is visible (CI);
run on a GPU machine with `pytest -q tests/engine/test_gpu.py`."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from kvfleet.engine import LLM, SamplingParams
from tests.support.engine import (
    MAX_TOKENS,
    assert_no_leak,
    first_token_logprob_gaps,
    long_random_prompts,
    recorded_cascade_prefixes,
)
from tests.support.tiny_model import ALL_ARCHITECTURES

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

BENCH_MODELS = Path(__file__).resolve().parents[2] / "bench" / "models"


@pytest.mark.parametrize("arch", ALL_ARCHITECTURES)
def test_triton_path_greedy_equals_hf_in_fp32(arch, model_dirs, prompts, hf_reference):
    llm = LLM(str(model_dirs[arch]), dtype="float32", device="cuda")
    assert llm.engine.runner.backend.name == "triton"
    assert llm.engine.runner.graphs is not None
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
    )
    assert [o.outputs[0].token_ids for o in outs] == hf_reference[arch]
    assert_no_leak(llm)


def test_triton_path_under_preemption_and_chunking(model_dirs, prompts, hf_reference):
    llm = LLM(
        str(model_dirs["llama"]),
        dtype="float32",
        device="cuda",
        num_gpu_blocks_override=20,
        max_num_batched_tokens=48,
    )
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
    )
    assert [o.outputs[0].token_ids for o in outs] == hf_reference["llama"]
    assert llm.engine.stats().num_preemptions > 0
    assert_no_leak(llm)


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_shared_prefix_decode_steps_equal_hf(arch, model_dirs):
    """Twelve requests on one cached 300-token system prompt: decode steps attend to it once
    per step (cascade pass, in CUDA graphs and eagerly); Gemma 2's sliding-window layers keep
    the plain kernel. Greedy output equals HF's."""
    from kvfleet.engine import model_runner
    from tests.support.engine import hf_greedy

    rng = torch.Generator().manual_seed(11)
    system = torch.randint(3, 500, (300,), generator=rng).tolist()
    prompts = [system + torch.randint(3, 500, (n,), generator=rng).tolist() for n in range(1, 13)]
    for eager in (False, True):
        llm = LLM(str(model_dirs[arch]), dtype="float32", device="cuda", enforce_eager=eager)
        with recorded_cascade_prefixes(llm.engine.runner) as prefixes:
            llm.generate({"prompt_token_ids": system}, SamplingParams(temperature=0, max_tokens=1))
            outs = llm.generate(
                [{"prompt_token_ids": p} for p in prompts],
                SamplingParams(temperature=0, max_tokens=16),
            )
        assert [o.outputs[0].token_ids for o in outs] == hf_greedy(model_dirs[arch], prompts, 16)
        assert max(prefixes) >= model_runner.CASCADE_MIN_PREFIX
        assert_no_leak(llm)
        del llm
        gc.collect()
        torch.cuda.empty_cache()


def test_bf16_triton_logprobs_close_to_reference_on_a_real_size_model():
    """Qwen3-0.6B architecture, dummy weights, bf16: the first token's top-20 logprobs from the
    Triton path (CUDA graphs on) against the PyTorch reference path (eager)."""
    common = dict(
        model=str(BENCH_MODELS / "Qwen3-0.6B"),
        load_format="dummy",
        dtype="bfloat16",
        skip_tokenizer_init=True,
        max_model_len=2048,
        max_num_seqs=16,
        gpu_memory_utilization=0.3,
    )
    prompts = long_random_prompts()
    sp = SamplingParams(temperature=0, max_tokens=4, logprobs=20, ignore_eos=True)
    fast = LLM(**common).generate(prompts, sp)
    torch.cuda.empty_cache()
    ref = LLM(**common, attention_backend="torch", enforce_eager=True).generate(prompts, sp)
    worst = max(gap for _, gap in first_token_logprob_gaps(fast, ref))
    assert worst < 0.05, worst


def test_kv_cache_is_sized_from_gpu_memory_utilization():
    llm = LLM(
        str(BENCH_MODELS / "Qwen3-0.6B"),
        load_format="dummy",
        dtype="bfloat16",
        skip_tokenizer_init=True,
        max_model_len=4096,
        gpu_memory_utilization=0.5,
    )
    runner = llm.engine.runner
    total = torch.cuda.get_device_properties(0).total_memory
    kv_bytes = runner.num_blocks * runner.block_bytes
    assert 0.2 * total < kv_bytes < 0.5 * total
    assert torch.cuda.memory_allocated() < 0.55 * total


@pytest.mark.parametrize(
    ("arch", "pooling"),
    [
        ("qwen3", "lasttoken"),
        ("qwen3", "mean"),
        ("gpt2", "mean"),
        ("gemma2", "lasttoken"),
        ("mixtral", "lasttoken"),
        ("qwen3_moe", "mean"),
    ],
)
def test_triton_path_embeddings_equal_hf_in_fp32(arch, pooling, tmp_path, prompts):
    """The pooling runner on the GPU (Triton attention, the fused experts, no CUDA graphs), a
    long prompt in chunks, for each family: each vector HF transformers' pooled final hidden
    states."""
    from tests.support.engine import hf_embeddings
    from tests.support.tiny_model import build_tiny_embedding_model

    model = build_tiny_embedding_model(tmp_path / "embed", pooling, arch=arch)
    with LLM(str(model), dtype="float32", device="cuda", max_num_batched_tokens=48) as llm:
        assert llm.engine.runner.backend.name == "triton" and llm.engine.runner.graphs is None
        outs = llm.embed([{"prompt_token_ids": p} for p in prompts])
        for out, ref in zip(outs, hf_embeddings(model, prompts, pooling), strict=True):
            got = torch.tensor(out.outputs.embedding)
            assert (got - ref).abs().max().item() < 1e-4
        assert_no_leak(llm)


def test_graphs_captured_after_ready_equal_hf(model_dirs, prompts, hf_reference, monkeypatch):
    """The server's start: the small sizes and the largest captured up front, the rest between
    steps. Decode batches of 40 rows (n=5 of 8 prompts) replay the 64-row graph padded before
    their own exists and their own after the idle captures: the output equals HF's both times
    (the second from the prefix cache, which the captures left intact), and every size ends
    captured."""
    from kvfleet.engine import model_runner
    from kvfleet.engine.graph_schedule import upfront_sizes

    # As a server starts: LLM's capture of every graph before the first batch left out.
    monkeypatch.setattr(model_runner.ModelRunner, "capture_all_graphs", lambda self: None)
    llm = LLM(str(model_dirs["llama"]), dtype="float32", device="cuda", skip_tokenizer_init=True,
              max_num_seqs=64)  # fmt: skip
    core = llm.engine
    graphs = core.runner.graphs
    assert graphs is not None
    assert graphs.schedule.captured == sorted(upfront_sizes(graphs.sizes))
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, n=5)
    want = [[r] * 5 for r in hf_reference["llama"]]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
    assert [[c.token_ids for c in o.outputs] for o in outs] == want
    assert graphs.schedule.demand[40] > 0
    # The input rows beyond the last replay's batch as an older, larger batch may leave them:
    # slots in a block the prefix cache holds, which the next run of the same prompts reads
    # (the second block cached: the 33-token prompt's first, the 16-token one's coming first).
    # A capture must not write there.
    block = list(core.kv_cache_manager.pool.cached.values())[1].block_id
    graphs.slot_mapping[48:64] = torch.arange(16, device="cuda") + block * 16
    graphs.seq_lens[48:64] = 1
    graphs.input_ids[48:64] = 7
    while core.capture_next_graph(idle=True):
        pass
    assert graphs.schedule.done and (40, False) in graphs.graphs
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
    assert [[c.token_ids for c in o.outputs] for o in outs] == want
    assert_no_leak(llm)


def test_a_second_start_reuses_the_kept_memory_profile(model_dirs, tmp_path, monkeypatch):
    """--compile-cache-dir: Triton compiles into the keyed folder, and a second start of the
    same configuration takes the kept profile (the profile run does not run) and sizes the same
    KV cache; weights of another size on the device make it profile again."""
    import os

    from kvfleet.engine import model_runner

    # Restored at the end, whether it was set or not: later tests compile where they did.
    monkeypatch.setenv("TRITON_CACHE_DIR", "unset")
    monkeypatch.delenv("TRITON_CACHE_DIR")
    kwargs = dict(dtype="float32", device="cuda", compile_cache_dir=str(tmp_path),
                  skip_tokenizer_init=True, max_num_seqs=16)  # fmt: skip
    first = LLM(str(model_dirs["llama"]), **kwargs)
    blocks = first.engine.runner.num_blocks
    folder = first.engine.cache_folder
    assert folder is not None and folder.parent == tmp_path
    assert os.environ["TRITON_CACHE_DIR"] == str(folder / "triton")
    assert list((folder / "memory-profiles").iterdir())
    first.shutdown()

    runs: list[int] = []
    profile_run = model_runner.ModelRunner._profile_run
    monkeypatch.setattr(model_runner.ModelRunner, "_profile_run",
                        lambda self: runs.append(1) or profile_run(self))  # fmt: skip
    second = LLM(str(model_dirs["llama"]), **kwargs)
    assert runs == [] and second.engine.runner.num_blocks == blocks
    assert second.engine.startup.seconds["memory_profile"] < 1.0
    second.shutdown()
    # Weights of other bytes under the same key (a checkpoint changed in place, say).
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 12345)
    LLM(str(model_dirs["llama"]), **kwargs).shutdown()
    assert runs == [1]
