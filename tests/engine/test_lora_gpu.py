"""LoRA on the CUDA path: the Triton kernels (or their twins) inside the decode CUDA graphs,
adapters mixed with the base model in one batch, against HF transformers + PEFT in fp32;
adapters paged through one slot again and again (one copy from a pinned image each, queued
without the host waiting) while the graphs replay; and fp8 base weights with adapters in the
model dtype. Skipped where no GPU is visible (CI); run on
a GPU machine with `pytest -q tests/engine/test_lora_gpu.py`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvfleet.engine import LLM, LoRARequest, SamplingParams
from kvfleet.engine.llm import TokensPrompt
from kvfleet.engine.lora_slots import SlotChanges
from tests.support.engine import PROMPT_LENS, hf_greedy
from tests.support.lora_adapters import write_test_adapters

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

MAX_TOKENS = 16


@pytest.fixture(scope="module")
def adapters(model_dirs, tmp_path_factory) -> list[LoRARequest]:
    return write_test_adapters(model_dirs["llama"], tmp_path_factory.mktemp("gpu-adapters"))


def _prompts(prompts: list[list[int]]) -> list[TokensPrompt]:
    return [TokensPrompt(prompt_token_ids=p) for p in prompts]


def _loras(adapters: list[LoRARequest], n: int) -> list[LoRARequest | None]:
    cycle: list[LoRARequest | None] = [*adapters, None]
    return [cycle[i % len(cycle)] for i in range(n)]


def test_cuda_graphs_with_adapters_equal_peft_in_fp32(model_dirs, prompts, adapters):
    base = model_dirs["llama"]
    loras = _loras(adapters, len(PROMPT_LENS))
    with LLM(str(base), dtype="float32", device="cuda", enable_lora=True, max_loras=2,
             skip_tokenizer_init=True) as llm:  # fmt: skip
        graphs = llm.engine.runner.graphs
        assert graphs is not None and graphs.lora_slots is not None
        outs = llm.generate(
            _prompts(prompts),
            SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
            lora_request=loras,
        )
    got = [o.outputs[0].token_ids for o in outs]
    for i, (p, lora) in enumerate(zip(prompts, loras, strict=True)):
        lora_dir = None if lora is None else Path(lora.lora_path)
        assert got[i] == hf_greedy(base, [p], MAX_TOKENS, lora_dir=lora_dir)[0], (i, lora)


def test_adapters_paged_through_one_slot_under_cuda_graphs_equal_peft(
    model_dirs, prompts, adapters
):
    """--max-loras 1 and two host copies for three adapters, twice over: each switch reloads
    the slot the captured decode graphs read (the buffer never moves), and host copies are
    dropped and read again. Tokens are PEFT's; every load's time is the device's, reported
    once its copy completed."""
    base = model_dirs["llama"]
    loras = _loras(adapters, len(PROMPT_LENS))
    want: dict[int, list[int]] = {}
    for lora in [*adapters, None]:
        mine = [i for i, x in enumerate(loras) if x == lora]
        lora_dir = None if lora is None else Path(lora.lora_path)
        got = hf_greedy(base, [prompts[i] for i in mine], MAX_TOKENS, lora_dir=lora_dir)
        want.update(zip(mine, got, strict=True))
    with LLM(str(base), dtype="float32", device="cuda", enable_lora=True, max_loras=1,
             max_cpu_loras=2, skip_tokenizer_init=True) as llm:  # fmt: skip
        engine = llm.engine
        runner = engine.runner
        assert runner.graphs is not None and runner.graphs.lora_slots is not None
        for _ in range(2):
            outs = llm.generate(
                _prompts(prompts),
                SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
                lora_request=loras,
            )
            for i, out in enumerate(outs):
                assert out.outputs[0].token_ids == want[i], (i, loras[i])
        assert runner.lora_host and all(image.is_pinned() for image in runner.lora_host.values())
        slots = engine.lora_slots
        assert slots is not None and sum(slots.stats.evictions.values()) >= 4
        # Every load timed, by the device: the engine core's count and the rest just completed.
        late = runner.take_lora_load_seconds()
        assert sum(engine._lora_load_hist) + len(late) == sum(slots.stats.loads.values())
        assert all(0 < seconds < 1 for _, seconds in late)
        assert engine._lora_load_seconds > 0


def test_a_host_copy_dropped_as_its_load_is_queued_still_fills_the_slot(model_dirs, adapters):
    """The slot load's copy is queued without the host waiting; the host tier drops the
    adapter's image at once and pinned memory is taken and written meanwhile: the slot holds
    the adapter (SlotLoads keeps the image until the copy completed)."""
    with LLM(str(model_dirs["llama"]), dtype="float32", device="cuda", enable_lora=True,
             max_loras=2, skip_tokenizer_init=True, enforce_eager=True) as llm:  # fmt: skip
        runner = llm.engine.runner
        layers = runner.lora
        assert layers is not None
        lora = adapters[0]
        adapter = runner.read_adapter(lora)
        for _ in range(5):
            runner.host_adapter(lora, adapter)
            runner._apply_lora_changes(SlotChanges([(1, lora)]))
            runner.drop_adapter(lora.lora_int_id)
            for _ in range(4):
                torch.full_like(layers.image(adapter), 7.0).pin_memory()
            torch.cuda.synchronize()
            assert torch.equal(layers.buffer[1].cpu(), layers.image(adapter))
            layers.load(1, None)
        assert not layers.buffer.any()


def test_fp8_base_weights_with_bf16_adapters(model_dirs, prompts, adapters):
    """Adapters in bf16 over fp8 base weights (their producers' fused quantization turned off,
    the layers quantize their own input): each request's first token under --quantization fp8
    mostly matches the same adapter's on bf16 weights."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs compute capability 8.9+")
    base = str(model_dirs["llama"])
    loras = _loras(adapters, len(PROMPT_LENS))
    sp = SamplingParams(temperature=0, max_tokens=1)

    def first_tokens(**kwargs) -> list[int]:
        # Eager and a short context: one token a request; graphs are the other test's.
        with LLM(base, dtype="bfloat16", device="cuda", enable_lora=True, max_loras=3,
                 skip_tokenizer_init=True, enforce_eager=True, max_model_len=512,
                 **kwargs) as llm:  # fmt: skip
            outs = llm.generate(_prompts(prompts), sp, lora_request=loras)
        return [o.outputs[0].token_ids[0] for o in outs]

    bf16 = first_tokens()
    fp8 = first_tokens(quantization="fp8")
    agree = sum(a == b for a, b in zip(bf16, fp8, strict=True))
    assert agree >= len(prompts) - 2, (bf16, fp8)
