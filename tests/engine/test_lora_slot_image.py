"""LoRA slots as one buffer: an adapter's slot image, copied into a slot, puts every layer's A and
B where the kernels read them (rank-padded, zeros for the modules it leaves out, each rank of
two its own shard, the shards together the whole adapter); an emptied slot is zeros; a slot
load is one copy; the Triton kernels (interpreted) read the layers' views of the buffer as
their twin does. PEFT's tokens through these slots: test_lora.py."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

from collections import defaultdict

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from kvfleet.engine import LLM, LoRARequest
from kvfleet.engine.layers.lora import LoRALayers, attach_lora
from kvfleet.engine.lora_adapter import LoRAAdapter, read_config, read_weights
from kvfleet.engine.lora_slots import SlotChanges
from kvfleet.engine.models.llama import LlamaForCausalLM
from kvfleet.kernels import reference
from tests.support.lora_adapters import write_test_adapters

MAX_RANK = 16


@pytest.fixture(scope="module")
def adapters(model_dirs, tmp_path_factory) -> list[LoRARequest]:
    return write_test_adapters(model_dirs["llama"], tmp_path_factory.mktemp("adapters"))


def _lora_layers(path, monkeypatch, rank: int, world: int) -> LoRALayers:
    """The tiny Llama's LoRA slots as rank `rank` of `world` builds them (the process group
    faked: building the layers only asks for the rank and size)."""
    from transformers import AutoConfig

    if world > 1:
        monkeypatch.setattr(dist, "is_initialized", lambda: True)
        monkeypatch.setattr(dist, "get_rank", lambda group=None: rank)
        monkeypatch.setattr(dist, "get_world_size", lambda group=None: world)
    model = LlamaForCausalLM(AutoConfig.from_pretrained(path), "LlamaForCausalLM")
    return attach_lora(model, 3, MAX_RANK, torch.float32, torch.device("cpu"))


def _read(lora: LoRARequest, layers: LoRALayers) -> LoRAAdapter:
    return read_weights(lora.lora_path, read_config(lora.lora_path, MAX_RANK), layers.targets)


def _padded(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    out = torch.zeros(rows, cols)
    out[: t.shape[0], : t.shape[1]] = t
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_slot_images_put_every_layers_shard_of_the_adapter_in_its_slot(
    model_dirs, adapters, monkeypatch, world
):
    """Every rank loads the three adapters (ranks 8, 4 and 16; all, q/v and the MLP's
    modules) into slots 0-2 from its own images. Column-parallel slices hold the whole A and
    their block of B's rows, row-parallel ones their block of A's columns and the whole B: put
    back together they are each adapter's tensors, zero-padded to the slots' rank, and zeros
    for the modules it leaves out."""
    path = model_dirs["llama"]
    # module -> slot -> (A per shard, B per shard): a replicated tensor lands on one key.
    a_parts: dict[str, dict[int, dict[int, torch.Tensor]]] = defaultdict(lambda: defaultdict(dict))
    b_parts: dict[str, dict[int, dict[int, torch.Tensor]]] = defaultdict(lambda: defaultdict(dict))
    for rank in range(world):
        with monkeypatch.context() as m:
            layers = _lora_layers(path, m, rank, world)
            read = [_read(lora, layers) for lora in adapters]
            for slot, adapter in enumerate(read):
                image = layers.image(adapter)
                assert image.shape == (layers.buffer.shape[1],) and not image.is_pinned()
                layers.load(slot, image)
            for layer in layers.layers:
                r = layer.max_rank
                for i, (s, b) in enumerate(zip(layer.slices, layer.b, strict=True)):
                    # This rank's shard: 1/world of A's columns or of B's rows.
                    if layer.row_parallel:
                        assert layer.a.shape[2] * world == s.shape.in_features
                    else:
                        assert b.shape[1] * world == s.shape.out_features
                    for slot in range(len(read)):
                        a = layer.a[slot, i * r : (i + 1) * r]
                        a_key = rank if layer.row_parallel else 0
                        b_key = 0 if layer.row_parallel else s.shard_index
                        for parts, key, t in ((a_parts, a_key, a), (b_parts, b_key, b[slot])):
                            held = parts[s.module][slot].setdefault(key, t.clone())
                            assert torch.equal(held, t), (s.module, slot, rank)
    # Put together along the split dimension (A's columns, B's rows) in shard order.
    targets = layers.targets
    for slot, adapter in enumerate(read):
        for module, shape in targets.items():
            a_whole = torch.cat([p for _, p in sorted(a_parts[module][slot].items())], dim=1)
            b_whole = torch.cat([p for _, p in sorted(b_parts[module][slot].items())], dim=0)
            a_want = torch.zeros(MAX_RANK, shape.in_features)
            b_want = torch.zeros(shape.out_features, MAX_RANK)
            if module in adapter.weights:
                a_full, b_full = adapter.weights[module]
                a_want, b_want = _padded(a_full, *a_want.shape), _padded(b_full, *b_want.shape)
            assert torch.equal(a_whole, a_want), (module, slot)
            assert torch.equal(b_whole, b_want), (module, slot)
    # All seven projections of each layer, q and v, the MLP's three.
    n = len(targets) // 7
    assert [len(a.weights) for a in read] == [7 * n, 2 * n, 3 * n]


def test_emptying_a_slot_zeroes_it_alone(model_dirs, adapters, monkeypatch):
    layers = _lora_layers(model_dirs["llama"], monkeypatch, 0, 1)
    for slot, lora in enumerate(adapters):
        layers.load(slot, layers.image(_read(lora, layers)))
    before = layers.buffer.clone()
    layers.load(1, None)
    assert not layers.buffer[1].any()
    assert torch.equal(layers.buffer[0], before[0]) and torch.equal(layers.buffer[2], before[2])
    qkv = layers.layers[0]
    assert not qkv.a[1].any() and all(not b[1].any() for b in qkv.b)


def test_the_kernels_read_the_layers_views_of_the_slot_buffer(model_dirs, adapters, monkeypatch):
    """The fused qkv's A slices and B (views strided by the slot's size, not their own) through
    the Triton kernels, interpreted, equal the twin's on the same views."""
    pytest.importorskip("triton")
    from kvfleet.kernels import lora as kernels

    layers = _lora_layers(model_dirs["llama"], monkeypatch, 0, 1)
    for slot, lora in enumerate(adapters):
        layers.load(slot, layers.image(_read(lora, layers)))
    qkv = layers.layers[0]
    assert qkv.a.stride(0) == layers.buffer.shape[1] and len(qkv.slices) == 3
    gen = torch.Generator().manual_seed(0)
    slots = torch.tensor([0, -1, 1, 2, 0, 1], dtype=torch.int32)
    x = torch.randn(len(slots), qkv.a.shape[2], generator=gen)
    base = torch.randn(len(slots), sum(b.shape[1] for b in qkv.b), generator=gen)
    out, want = base.clone(), base.clone()
    kernels.add_lora_slices(x, qkv.a_slices, qkv.b, slots, out, qkv.offsets)
    reference.add_lora_slices(x, qkv.a_slices, qkv.b, slots, want, qkv.offsets)
    torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-4)
    assert not torch.equal(out[slots == 0], base[slots == 0])


class _Writes(TorchDispatchMode):
    """The in-place ops (copies, fills, zeroings) run inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__  # e.g. copy_.default
        if name.split(".")[0].endswith("_"):
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


def test_a_slot_load_is_one_copy(model_dirs, adapters):
    """However many layers and modules: one copy of the adapter's image per slot load."""
    with LLM(str(model_dirs["llama"]), device="cpu", dtype="float32", enable_lora=True,
             max_loras=2, skip_tokenizer_init=True) as llm:  # fmt: skip
        runner = llm.engine.runner
        for lora in adapters[:2]:
            runner.host_adapter(lora, runner.read_adapter(lora))
        writes = _Writes()
        with writes:
            runner._apply_lora_changes(SlotChanges([(0, adapters[0]), (1, adapters[1])]))
        assert writes.ops == ["copy_.default"] * 2
        assert len(runner.take_lora_load_seconds()) == 2


def test_host_copies_the_host_cannot_hold_are_refused_at_start(model_dirs, monkeypatch):
    """max_cpu_loras slot images (pinned on a GPU) that the memory available cannot hold stop
    the start with the flag to lower; under a container's limit (page cache counted as used)
    only a warning."""
    from kvfleet.engine import model_runner
    from kvfleet.engine.host_memory import Available

    args = {"device": "cpu", "dtype": "float32", "enable_lora": True, "max_loras": 2,
            "max_cpu_loras": 64, "skip_tokenizer_init": True}  # fmt: skip
    monkeypatch.setattr(model_runner, "available_memory", lambda: Available(1 << 16, False))
    with pytest.raises(ValueError, match=r"LoRA adapters' host copies take .* --max-cpu-loras"):
        LLM(str(model_dirs["llama"]), **args)
    monkeypatch.setattr(model_runner, "available_memory", lambda: Available(1 << 16, True))
    with LLM(str(model_dirs["llama"]), **args) as llm:
        assert llm.engine.runner.lora is not None
