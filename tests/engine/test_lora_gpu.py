"""LoRA on the CUDA path: the Triton kernels (or their twins) inside the decode CUDA graphs,
adapters mixed with the base model in one batch, against HF transformers + PEFT in fp32;
adapters paged through one slot again and again (one copy from a pinned image each, queued
without the host waiting) while the graphs replay; fp8 base weights with adapters in the
model dtype; and a layer's shrink on the side stream beside its GEMM, eager and replayed from a
CUDA graph, against the twin. Skipped where no GPU is visible (CI); run on
a GPU machine with `pytest -q tests/engine/test_lora_gpu.py`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvfleet.engine import LLM, LoRARequest, SamplingParams
from kvfleet.engine.layers.batched_lora import side_stream
from kvfleet.engine.layers.linear import QKVParallelLinear
from kvfleet.engine.layers.lora import LinearLoRA, LoRASlice, lora_context
from kvfleet.engine.llm import TokensPrompt
from kvfleet.engine.lora_adapter import TargetShape
from kvfleet.engine.lora_slots import SlotChanges
from kvfleet.kernels import lora as kernels
from kvfleet.kernels import reference
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


# Llama-3.1-8B's fused qkv: hidden size, head size, heads, KV heads.
QKV = (4096, 128, 32, 8)
NUM_SLOTS, RANK = 8, 16


@pytest.fixture(scope="module")
def qkv_with_lora() -> tuple[QKVParallelLinear, LinearLoRA]:
    """Llama-3.1-8B's qkv layer in bf16 with random weights and LoRA slots, each slot a rank-16
    adapter on q, k and v (B scaled as the engine folds lora_alpha / r into it)."""
    hidden = QKV[0]
    layer = QKVParallelLinear(*QKV, bias=False).to("cuda", torch.bfloat16)
    gen = torch.Generator(device="cuda").manual_seed(0)
    layer.weight.data.copy_(torch.randn(layer.weight.shape, device="cuda", generator=gen) * 0.02)
    slices = []
    for name in ("q", "k", "v"):
        offset, rows, index, _ = layer._shard_rows(name)
        shape = TargetShape(rows, hidden)
        slices.append(LoRASlice(f"self_attn.{name}_proj", offset, rows, index, shape))
    a = torch.randn(NUM_SLOTS, 3 * RANK, hidden, device="cuda", generator=gen) / hidden**0.5
    bs = [torch.randn(NUM_SLOTS, s.rows, RANK, device="cuda", generator=gen) * 0.5 for s in slices]
    lora = LinearLoRA(slices, False, RANK, [t.to(torch.bfloat16) for t in (a, *bs)])
    layer.lora = lora
    return layer, lora


def _slot_map(t: int, case: int, gen: torch.Generator) -> torch.Tensor:
    """Mostly adapters and the base model mixed token by token; every eighth map all the base
    model's, every eighth after it all one slot's."""
    if case % 8 == 0:
        return torch.full((t,), -1, dtype=torch.int32, device="cuda")
    if case % 8 == 1:
        return torch.full((t,), case % NUM_SLOTS, dtype=torch.int32, device="cuda")
    return torch.randint(-1, NUM_SLOTS, (t,), generator=gen, device="cuda", dtype=torch.int32)


def _assert_matches_twin(
    layer: QKVParallelLinear,
    lora: LinearLoRA,
    x: torch.Tensor,
    slots: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """out is x's GEMM, with the twin's product of each adapter token's slot added."""
    gemm = torch.nn.functional.linear(x, layer.weight)
    want = gemm.clone()
    reference.add_lora_slices(x, lora.a_slices, lora.b, slots, want, lora.offsets)
    base, mine = slots == -1, slots >= 0
    torch.testing.assert_close(out[base], gemm[base])
    if mine.any():
        # A stale or half-written shrink (a race) would be off by whole adapter products.
        delta, want_delta = (out - gemm)[mine].float(), (want - gemm)[mine].float()
        assert (delta - want_delta).norm() <= 1e-2 * want_delta.norm()


def test_a_lora_layer_overlapped_replays_from_a_cuda_graph_as_inputs_and_slot_maps_change(
    qkv_with_lora,
):
    """A decode step's qkv captured once with its shrink forked onto the side stream and joined
    back, replayed with a new x and slot map each time against the twin."""
    layer, lora = qkv_with_lora
    t = 32
    x = torch.zeros(t, QKV[0], device="cuda", dtype=torch.bfloat16)
    slots = torch.full((t,), -1, dtype=torch.int32, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), lora_context(slots):
        layer(x)  # compiles the kernels before capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), lora_context(slots):
        out = layer(x)
    gen = torch.Generator(device="cuda").manual_seed(1)
    for case in range(64):
        x.copy_(torch.randn(t, QKV[0], device="cuda", generator=gen))
        slots.copy_(_slot_map(t, case, gen))
        graph.replay()
        _assert_matches_twin(layer, lora, x, slots, out)


def test_a_lora_layer_overlapped_eagerly_matches_the_twin_with_new_buffers_each_call(
    qkv_with_lora,
):
    """Eager steps of several sizes, each x and output freshly allocated (the caching
    allocator hands the last call's memory out again): the join orders every reuse."""
    layer, lora = qkv_with_lora
    gen = torch.Generator(device="cuda").manual_seed(2)
    for case, t in enumerate([1, 7, 32, 300, 2048] * 4):
        x = torch.randn(t, QKV[0], device="cuda", generator=gen).to(torch.bfloat16)
        slots = _slot_map(t, case, gen)
        with lora_context(slots):
            out = layer(x)
        _assert_matches_twin(layer, lora, x, slots, out)


def test_the_shrink_forks_onto_the_side_stream_only_in_steps_with_adapters(
    qkv_with_lora, monkeypatch
):
    """With a slot map the shrink launches on the device's side stream and the expand on the
    current one; without, neither launches and the layer is its GEMM."""
    layer, _ = qkv_with_lora
    launched: list[tuple[str, torch.cuda.Stream]] = []

    def spy(name: str, launch):
        def run(*args, **kwargs):
            launched.append((name, torch.cuda.current_stream()))
            return launch(*args, **kwargs)

        return run

    monkeypatch.setattr(kernels, "shrink", spy("shrink", kernels.shrink))
    monkeypatch.setattr(kernels, "expand", spy("expand", kernels.expand))
    x = torch.randn(4, QKV[0], device="cuda", dtype=torch.bfloat16)
    main = torch.cuda.current_stream()
    with lora_context(None):
        assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight))
    assert launched == []
    with lora_context(torch.tensor([0, -1, 3, 3], dtype=torch.int32, device="cuda")):
        layer(x)
    side = side_stream(x.device)
    assert side != main and launched == [("shrink", side), ("expand", main)]
    assert side_stream(x.device) is side  # one per device, not one per call
