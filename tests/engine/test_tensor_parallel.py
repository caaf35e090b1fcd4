"""Tensor-parallel layers on the CPU: a tiny Llama split over 2 gloo ranks (column/row-parallel
linears, vocabulary-parallel embedding and LM head, each rank holding its KV heads) computes the
same logits as the unsplit model; the engine over 2 ranks generates what 1 does, also for the
mixtures of experts (each expert's intermediate dimension split, or the experts placed per rank
with --enable-expert-parallel)."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kvfleet.engine.async_engine import AsyncEngine, EngineDeadError
from kvfleet.engine.attention_backend import TorchAttentionBackend
from kvfleet.engine.attention_metadata import AttentionMetadata, attention_context
from kvfleet.engine.config import EngineArgs
from kvfleet.engine.engine_core import EngineCore
from kvfleet.engine.llm import LLM
from kvfleet.engine.models.llama import LlamaForCausalLM
from kvfleet.engine.models.loader import load_weights
from kvfleet.engine.sampling_params import SamplingParams
from tests.support.engine import assert_no_leak
from tests.support.net import free_port
from tests.support.tiny_model import MOE_ARCHITECTURES

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


def test_two_ranks_equal_one(model_dirs, tmp_path):
    path = str(model_dirs["llama"])
    whole = _logits(path, 1)
    out = str(tmp_path / "tp2.pt")
    mp.spawn(_rank, args=(2, path, free_port(), out), nprocs=2, join=True)
    split = torch.load(out)
    assert split.shape == whole.shape
    torch.testing.assert_close(split, whole, atol=1e-4, rtol=1e-4)
    # The comparison has teeth: the logits are far from trivially equal.
    assert whole.std() > 0.1


# -- the engine with tensor-parallel worker processes (gloo on the CPU) -------------------------

TP_PROMPTS = [[(7 * i + 3 * j) % 480 + 3 for j in range(n)] for i, n in enumerate((1, 17, 40, 90))]


def _greedy(path: str, tp: int, **engine_args) -> list[list[int]]:
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    with LLM(path, tensor_parallel_size=tp, device="cpu", skip_tokenizer_init=True,
             **engine_args) as llm:  # fmt: skip
        outs = llm.generate([{"prompt_token_ids": p} for p in TP_PROMPTS], sp)
        assert_no_leak(llm)
        if tp > 1:
            workers = llm.engine.workers._procs
    if tp > 1:
        # Shut down cleanly: every worker exited by itself, the process group is gone.
        assert [w.exitcode for w in workers] == [0] * (tp - 1)
        assert not dist.is_initialized()
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("arch", ["llama", "gpt2", "gemma2", "mixtral", "qwen3_moe"])
def test_engine_with_two_ranks_generates_what_one_rank_does(model_dirs, arch):
    """Chunked prefill (48-token budget) and a 14-block cache that forces preemption: the plan
    each worker gets must carry every block-table change, across steps and re-admissions. A
    mixture of experts both ways: each expert split, and the experts placed whole per rank
    (--enable-expert-parallel; tests/engine/test_expert_parallel.py: the placement itself)."""
    path = str(model_dirs[arch])
    limits = {"max_num_batched_tokens": 48, "num_gpu_blocks_override": 14, "max_num_seqs": 4}
    one = _greedy(path, 1, **limits)
    assert _greedy(path, 2, **limits) == one
    if arch in MOE_ARCHITECTURES:
        assert _greedy(path, 2, enable_expert_parallel=True, **limits) == one
    assert len({tuple(o) for o in one}) == len(one)  # distinct outputs: a real comparison


def test_tensor_parallel_size_must_divide_the_heads(model_dirs):
    with pytest.raises(ValueError, match="does not divide the model's 4 attention heads"):
        EngineCore(EngineArgs(model=str(model_dirs["llama"]), tensor_parallel_size=3,
                              device="cpu", skip_tokenizer_init=True))  # fmt: skip


@pytest.mark.asyncio
async def test_a_dead_worker_fails_health_and_requests(model_dirs):
    core = EngineCore(EngineArgs(model=str(model_dirs["llama"]), tensor_parallel_size=2,
                                 device="cpu", skip_tokenizer_init=True))  # fmt: skip
    engine = AsyncEngine(core)
    engine.start()
    try:
        params = SamplingParams(max_tokens=1000, ignore_eos=True)
        stream = engine.generate("r", core.admit(list(range(3, 40)), params))
        await anext(stream)  # running, on both ranks
        assert engine.is_healthy()
        os.kill(core.workers._procs[0].pid, signal.SIGKILL)
        # Whichever notices first (the watcher thread, or gloo in the loop) fails the stream.
        with pytest.raises(EngineDeadError, match="the engine loop died"):
            async with asyncio.timeout(30):
                async for _ in stream:
                    pass
        assert not engine.is_healthy()
        assert core.worker_failure() == "tensor-parallel worker rank 1 exited with code -9"
    finally:
        await engine.stop()
    assert not dist.is_initialized()


def test_a_worker_that_cannot_load_its_shard_is_reported_not_waited_for(model_dirs, tmp_path):
    """A checkpoint whose o_proj is one column short: rank 0's half is intact, rank 1's is not.
    Rank 0 must say so before its first collective (on NCCL it would wait there for good)."""
    from safetensors.torch import load_file, save_file

    src = model_dirs["llama"]
    dst = tmp_path / "broken"
    shutil.copytree(src, dst)
    (weights,) = dst.glob("*.safetensors")
    tensors = load_file(weights)
    name = "model.layers.0.self_attn.o_proj.weight"
    tensors[name] = tensors[name][:, :-1].contiguous()
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(RuntimeError, match=r"worker rank 1 failed to load: RuntimeError: .*"):
        EngineCore(EngineArgs(model=str(dst), tensor_parallel_size=2, device="cpu",
                              skip_tokenizer_init=True))  # fmt: skip
    assert not dist.is_initialized()
    assert not mp.active_children()


@pytest.mark.parametrize("failing", ["StructuredOutputs", "KVCacheManager"])
def test_an_engine_that_fails_after_its_workers_start_stops_them(model_dirs, monkeypatch, failing):
    """A failure at start-up must not leave the workers running and holding their memory: the
    next engine on those GPUs found no room for a KV cache. The grammar compiler's tokenizer
    (on two GPUs, llguidance refused the EOS ids) is read before any worker starts; what fails
    after the shards are loaded gives back rank 0's runner too."""
    import kvfleet.engine.engine_core as engine_core

    def refuse(*args, **kwargs):
        raise TypeError("argument 'eos_token': 'list' object cannot be interpreted as an integer")

    monkeypatch.setattr(engine_core, failing, refuse)
    released = []
    monkeypatch.setattr(engine_core.ModelRunner, "release", lambda runner: released.append(runner))
    started = []
    start = engine_core.TensorParallelWorkers.__init__

    def spy(self, args):
        started.append(self)
        start(self, args)

    monkeypatch.setattr(engine_core.TensorParallelWorkers, "__init__", spy)
    with pytest.raises(TypeError, match="eos_token"):
        EngineCore(EngineArgs(model=str(model_dirs["llama"]), tensor_parallel_size=2,
                              device="cpu"))  # fmt: skip
    after_load = failing == "KVCacheManager"
    assert len(started) == len(released) == after_load
    assert not dist.is_initialized()
    assert not mp.active_children()


def test_an_engine_process_with_workers_exits_cleanly(model_dirs):
    """What the engine's own process says when it ends: an exit code of 0 and no warning of
    leaked semaphores (a worker's tqdm lock, which its os._exit never unlinked) or of a worker
    that had to be killed."""
    code = (
        "import sys\n"
        "from kvfleet.engine.llm import LLM\n"
        "from kvfleet.engine.sampling_params import SamplingParams\n"
        "if __name__ == '__main__':\n"
        "    llm = LLM(sys.argv[1], tensor_parallel_size=2, device='cpu')\n"
        "    llm.generate([{'prompt_token_ids': [1, 2, 3]}], SamplingParams(max_tokens=2))\n"
        "    llm.shutdown()\n"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(model_dirs["llama"])],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "leaked" not in proc.stderr and "did not stop" not in proc.stderr, proc.stderr


def test_the_runner_is_released_before_the_process_group_is_destroyed(model_dirs, monkeypatch):
    """NCCL does not destroy a communicator while a CUDA graph that captured its collectives
    lives: on two GPUs, destroying the group under live graphs hung for its 10 s limit, the
    worker was killed, and the next engine's communicator was aborted. So rank 0 gives back its
    runner (graphs, cache, weights) before the group's teardown starts."""
    core = EngineCore(EngineArgs(model=str(model_dirs["llama"]), tensor_parallel_size=2,
                                 device="cpu", skip_tokenizer_init=True))  # fmt: skip
    workers = core.workers
    assert workers is not None
    teardown = workers.shutdown
    at_teardown = []

    def shutdown() -> None:
        runner = core.runner
        at_teardown.append((getattr(runner, "model", None), runner.graphs, runner.kv_caches))
        teardown()

    monkeypatch.setattr(workers, "shutdown", shutdown)
    core.close()
    assert at_teardown == [(None, None, [])]
    assert [p.exitcode for p in workers._procs] == [0]
    assert not dist.is_initialized()
