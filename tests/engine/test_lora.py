"""LoRA adapters in the engine, against HF transformers + PEFT (fp32, CPU, greedy): adapters of
different ranks and target modules and the base model mixed in one batch; adapters evicted and
loaded again through one GPU slot; the prefix cache kept apart per adapter; an adapter whose
folder breaks after its check failing its own requests alone; two tensor-parallel ranks
generating what one does."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from kvfleet.engine import LLM, LoRARequest, SamplingParams
from kvfleet.engine.llm import TokensPrompt
from kvfleet.engine.lora_adapter import WEIGHTS_FILE
from kvfleet.engine.outputs import CompletionOutput, RequestOutput
from tests.support.engine import assert_no_leak, hf_greedy
from tests.support.lora_adapters import write_test_adapters

MAX_TOKENS = 12
# Lengths on and off the 16-token blocks, the longest two blocks and more.
PROMPTS = [
    [5, 17, 99, 3, 250, 42, 7, 311, 64, 12],
    [480, 33, 2, 91, 150, 77, 8, 402, 19, 6, 300, 11, 40, 70, 90, 100, 3, 9],
    [15, 25, 35, 45, 55, 65, 75, 85],
    [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30,
     31, 32, 33, 34, 35, 36, 37, 38, 39, 40],
]  # fmt: skip


@pytest.fixture(scope="module")
def adapters(model_dirs, tmp_path_factory) -> list[LoRARequest]:
    return write_test_adapters(model_dirs["llama"], tmp_path_factory.mktemp("adapters"))


@pytest.fixture(scope="module")
def expected(model_dirs, adapters) -> dict[str | None, list[list[int]]]:
    """HF + PEFT's greedy tokens for every prompt, per adapter (None: the base model)."""
    base = model_dirs["llama"]
    out: dict[str | None, list[list[int]]] = {None: hf_greedy(base, PROMPTS, MAX_TOKENS)}
    for lora in adapters:
        out[lora.lora_name] = hf_greedy(base, PROMPTS, MAX_TOKENS, lora_dir=Path(lora.lora_path))
    # Each adapter changes the base model's output: the comparisons below can fail.
    for lora in adapters:
        assert out[lora.lora_name] != out[None], lora.lora_name
    return out


def _mixed(adapters: list[LoRARequest]) -> list[LoRARequest | None]:
    """Per prompt, in turn: each adapter and the base model, two rounds."""
    cycle: list[LoRARequest | None] = [*adapters, None]
    return [cycle[i % len(cycle)] for i in range(2 * len(cycle))]


def _run(llm: LLM, loras: list[LoRARequest | None]) -> list[list[int]]:
    prompts = [TokensPrompt(prompt_token_ids=PROMPTS[i % len(PROMPTS)]) for i in range(len(loras))]
    outs = llm.generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), lora_request=loras
    )
    return [o.outputs[0].token_ids for o in outs]


def _want(expected, loras: list[LoRARequest | None]) -> list[list[int]]:
    return [
        expected[None if lora is None else lora.lora_name][i % len(PROMPTS)]
        for i, lora in enumerate(loras)
    ]


# How an adapter's folder breaks after its check, and what its requests' error then says.
BREAKS = {"deleted": "it is missing", "truncated": "cannot be read", "reshaped": "has shape"}


def _broken(llm: LLM, source: LoRARequest, root: Path, first_id: int) -> list[LoRARequest]:
    """Copies of `source`, one per BREAKS, each checked by the engine (as an adapter is at
    registration) and broken after."""
    broken = []
    for i, how in enumerate(BREAKS, first_id):
        lora = LoRARequest(how, i, str(shutil.copytree(source.lora_path, root / how)))
        llm.engine.check_adapter(lora)
        weights = root / how / WEIGHTS_FILE
        if how == "deleted":
            weights.unlink()
        elif how == "truncated":
            weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
        else:
            tensors = load_file(weights)
            key = next(k for k in tensors if ".lora_A." in k)
            tensors[key] = tensors[key][:-1]
            save_file(tensors, weights)
        broken.append(lora)
    return broken


def _assert_failed(out, lora: LoRARequest) -> None:
    assert out.outputs[0].finish_reason == "error" and not out.outputs[0].token_ids
    assert f"reading LoRA adapter {lora.lora_name!r} failed" in out.error, out.error
    assert BREAKS[lora.lora_name] in out.error, out.error


def _llm(model_dirs, **kwargs) -> LLM:
    return LLM(str(model_dirs["llama"]), device="cpu", dtype="float32", enable_lora=True,
               skip_tokenizer_init=True, **kwargs)  # fmt: skip


def test_adapters_and_the_base_model_in_one_batch_match_peft(model_dirs, adapters, expected):
    loras = _mixed(adapters)
    with _llm(model_dirs, max_loras=3) as llm:
        assert _run(llm, loras) == _want(expected, loras)
        assert_no_leak(llm)
        slots = llm.engine.lora_slots
        assert slots is not None and not slots.pins
        assert sum(slots.stats.loads.values()) == 3  # each loaded once, none evicted


def test_one_slot_pages_adapters_in_and_out(model_dirs, adapters, expected):
    """--max-loras 1 with three adapters: requests of an adapter wait for the slot while
    another's run, the base model's go on; host memory holds two, so one is read from disk
    again. Chunked prefill (a 24-token budget) and a cache small enough to preempt."""
    loras = _mixed(adapters)
    with _llm(model_dirs, max_loras=1, max_cpu_loras=2, max_num_batched_tokens=24,
              num_gpu_blocks_override=8, max_num_seqs=4) as llm:  # fmt: skip
        # Twice: the second round reads the first adapter from disk again.
        for _ in range(2):
            assert _run(llm, loras) == _want(expected, loras)
        assert_no_leak(llm)
        assert llm.engine.stats().num_preemptions > 0
        assert llm.engine.lora_slots is not None
        stats = llm.engine.lora_slots.stats
        assert sum(stats.evictions.values()) >= 4
        assert stats.disk_reads[adapters[0].lora_name] == 2
        assert len(llm.engine.runner.lora_host) == 2


def test_a_stream_of_one_adapters_requests_does_not_starve_another(model_dirs, adapters, expected):
    """--max-loras 1 and one host copy: a new request of adapter A every step keeps the slot
    pinned and A's copy in use; B's request, once passed over --max-lora-wait-steps times, holds
    A's new requests back until A's running ones finish, takes A's host copy and the slot, and
    completes with PEFT's tokens while A's stream goes on."""
    a, b = adapters[:2]
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    wait_steps = 4
    with _llm(model_dirs, max_loras=1, max_lora_wait_steps=wait_steps) as llm:
        engine = llm.engine
        results: dict[str, RequestOutput] = {}

        def add(rid: str, lora: LoRARequest, prompt: list[int]) -> None:
            engine.add_request(rid, engine.admit(prompt, sp, lora=lora))
            results[rid] = RequestOutput(rid, prompt, [CompletionOutput(index=0)])

        add("a", a, PROMPTS[1])
        engine.step()
        add("b", b, PROMPTS[0])
        for k in range(3 * MAX_TOKENS):
            add(f"a{k}", a, PROMPTS[k % len(PROMPTS)])
            for delta in engine.step():
                results[delta.request_id].add(delta)
            if results["b"].finished:
                break
        # Passed over wait_steps times, then A's last admitted request runs out (its prefill
        # step and MAX_TOKENS - 1 more), then B's own run.
        assert results["b"].finished and k <= wait_steps + 2 * MAX_TOKENS + 2, k
        assert results["b"].outputs[0].token_ids == expected[b.lora_name][0]
        for rid in list(results):
            engine.abort_request(rid)
        assert not engine.has_unfinished_requests()


def test_the_prefix_cache_is_kept_apart_per_adapter(model_dirs, adapters):
    prompt = [TokensPrompt(prompt_token_ids=PROMPTS[3])]  # two full blocks and more
    sp = SamplingParams(temperature=0.0, max_tokens=2)
    first, second = adapters[:2]
    with _llm(model_dirs, max_loras=2) as llm:
        assert llm.generate(prompt, sp, lora_request=first)[0].num_cached_tokens == 0
        assert llm.generate(prompt, sp, lora_request=second)[0].num_cached_tokens == 0
        assert llm.generate(prompt, sp)[0].num_cached_tokens == 0
        assert llm.generate(prompt, sp, lora_request=first)[0].num_cached_tokens == 32
        assert llm.generate(prompt, sp)[0].num_cached_tokens == 32


def test_an_adapter_broken_after_its_check_fails_its_requests_alone(
    model_dirs, adapters, expected, tmp_path
):
    """Its weights are read into host memory before any request of it is scheduled, outside
    the step: the read fails its requests, which never ran, and the engine serves on."""
    good = adapters[0]
    with _llm(model_dirs, max_loras=2, max_cpu_loras=2) as llm:
        broken = _broken(llm, adapters[1], tmp_path, first_id=10)
        loras = [broken[0], good, None, broken[1], broken[2], good, broken[0], None]
        prompts = [TokensPrompt(prompt_token_ids=PROMPTS[i % len(PROMPTS)]) for i in range(8)]
        sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
        outs = llm.generate(prompts, sp, lora_request=loras)
        for i, (out, lora) in enumerate(zip(outs, loras, strict=True)):
            if lora in broken:
                _assert_failed(out, lora)
            else:
                assert out.error is None
                name = None if lora is None else lora.lora_name
                assert out.outputs[0].token_ids == expected[name][i % len(PROMPTS)]
        assert_no_leak(llm)
        slots = llm.engine.lora_slots
        assert slots is not None and not slots.pins and not slots.users
        assert slots.resident() == {good.lora_name: "gpu"}
        assert set(llm.engine.runner.lora_host) == {good.lora_int_id}
        # The engine goes on: the same requests again, the good ones from host memory.
        again = llm.generate(prompts, sp, lora_request=loras)
        assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outs]
        assert_no_leak(llm)


def test_two_ranks_generate_what_one_does(model_dirs, adapters, expected, tmp_path):
    """Column-parallel layers hold their rows of B, row-parallel ones their columns of A. Rank
    0 alone reads an adapter and sends it to the workers: one whose folder broke fails its
    request on every rank alike."""
    loras = _mixed(adapters)[:4]
    with _llm(model_dirs, max_loras=2, tensor_parallel_size=2) as llm:
        assert _run(llm, loras) == _want(expected, loras)
        deleted = _broken(llm, adapters[0], tmp_path, first_id=10)[0]
        outs = llm.generate(
            [TokensPrompt(prompt_token_ids=PROMPTS[0])] * 2,
            SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
            lora_request=[deleted, adapters[2]],
        )
        _assert_failed(outs[0], deleted)
        assert outs[1].outputs[0].token_ids == expected[adapters[2].lora_name][0]
        assert_no_leak(llm)
