"""Weights into a model: HF safetensors (one file or sharded with an index, fp8 ones with their
scales included), a GGUF file, or random ("dummy") weights of the architecture for benchmarks."""

from __future__ import annotations

import json
import logging
import time
import zlib
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

from kvfleet.engine.checkpoint_path import GGUF_SUFFIX
from kvfleet.engine.layers.fp8 import FP8, dequantize_blocks
from kvfleet.engine.layers.layernorm import LayerNorm, RMSNorm
from kvfleet.engine.models import gguf_checkpoint

logger = logging.getLogger(__name__)

_INDEX = "model.safetensors.index.json"


def safetensors_files(path: Path) -> list[Path]:
    index = path / _INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({path / name for name in weight_map.values()})
    else:
        files = sorted(path.glob("*.safetensors"))
    missing = [f for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"checkpoint shards missing: {', '.join(map(str, missing))}")
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path}")
    return files


# Threads that read a safetensors checkpoint at once: one reader leaves most of a fast disk's
# (or a network volume's) bandwidth unused, since each read waits for its pages in turn.
READ_THREADS = 8
# Tensors are read in groups of about this many bytes, at most READ_THREADS groups ahead of
# the model's loading: the memory the readers hold at a time is bounded by about their product
# (plus one tensor larger than a group), whatever the checkpoint's size.
READ_GROUP_BYTES = 128 << 20
# safetensors' own bound on a file's header.
_MAX_HEADER_BYTES = 100 << 20


@dataclass(frozen=True)
class _ReadGroup:
    file: Path
    names: list[str]
    nbytes: int


def _tensor_sizes(file: Path) -> list[tuple[str, int]]:
    """Each tensor of a safetensors file and its bytes, from the header alone."""
    with file.open("rb") as f:
        size = int.from_bytes(f.read(8), "little")
        if not 0 < size <= _MAX_HEADER_BYTES:
            raise ValueError(f"{file}: a safetensors header of {size} bytes")
        header = json.loads(f.read(size))
    sizes = []
    for name, meta in header.items():
        if name != "__metadata__":
            begin, end = meta["data_offsets"]
            sizes.append((name, end - begin))
    return sizes


def _read_groups(
    files: list[Path], skip: Callable[[str], bool] | None
) -> tuple[list[_ReadGroup], int]:
    """The checkpoint's tensors to read, in order, in groups of about READ_GROUP_BYTES; and
    the number of tensors, those skipped included (the bar counts them)."""
    groups: list[_ReadGroup] = []
    total = 0
    for file in files:
        names: list[str] = []
        nbytes = 0
        for name, size in _tensor_sizes(file):
            total += 1
            if skip is not None and skip(name):
                continue
            names.append(name)
            nbytes += size
            if nbytes >= READ_GROUP_BYTES:
                groups.append(_ReadGroup(file, names, nbytes))
                names, nbytes = [], 0
        if names:
            groups.append(_ReadGroup(file, names, nbytes))
    return groups, total


def _read(group: _ReadGroup, device: str) -> list[tuple[str, torch.Tensor]]:
    with safe_open(group.file, framework="pt", device=device) as f:
        return [(name, f.get_tensor(name)) for name in group.names]


def _read_safetensors(
    files: list[Path], progress: bool, skip: Callable[[str], bool] | None, device: str
) -> Iterator[tuple[str, torch.Tensor]]:
    """The files' tensors in their order, read by READ_THREADS threads a bounded number of
    groups ahead; the bandwidth is logged at the end."""
    groups, total = _read_groups(files, skip)
    threads = max(min(READ_THREADS, len(groups)), 1)
    started = time.perf_counter()
    read = 0
    todo = iter(groups)
    ahead: deque[tuple[_ReadGroup, Future[list[tuple[str, torch.Tensor]]]]] = deque()
    with (
        ThreadPoolExecutor(threads, thread_name_prefix="kvfleet-read") as pool,
        tqdm(
            total=total,
            desc="Loading safetensors weights",
            unit="tensor",
            disable=None if progress else True,
        ) as bar,
    ):

        def submit() -> None:
            group = next(todo, None)
            if group is not None:
                ahead.append((group, pool.submit(_read, group, device)))

        for _ in range(threads):
            submit()
        try:
            while ahead:
                group, future = ahead.popleft()
                tensors = future.result()
                submit()
                for name, tensor in tensors:
                    yield name, tensor
                    bar.update()
                read += group.nbytes
            bar.update(total - bar.n)  # the skipped tensors
        finally:
            # A load that failed midway: the groups not started are dropped; those being
            # read finish (one group each) before the pool closes.
            for _, future in ahead:
                future.cancel()
    seconds = time.perf_counter() - started
    logger.info(
        "read %.2f GiB of weights in %.2f s (%.2f GiB/s, %d threads, to %s)",
        read / 2**30,
        seconds,
        read / 2**30 / max(seconds, 1e-9),
        threads,
        device,
    )


def iter_checkpoint(
    path: Path,
    *,
    progress: bool = True,
    skip: Callable[[str], bool] | None = None,
    device: torch.device | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of a checkpoint. progress: a bar on stderr when it is a terminal
    (tqdm's disable=None); False for none at all (tensor-parallel ranks other than the first).
    skip: names whose tensors are left out, unread where the format allows (safetensors).
    device: where a safetensors checkpoint's tensors are read to (default: the host), by
    several threads at once."""
    if path.suffix == GGUF_SUFFIX:
        tensors = gguf_checkpoint.iter_tensors(path, progress=progress)
        yield from (t for t in tensors if skip is None or not skip(t[0]))
        return
    files = safetensors_files(path)
    yield from _read_safetensors(files, progress, skip, str(device or "cpu"))


_SCALE_INV = ".weight_scale_inv"


def multiply_out_blocks(
    tensors: Iterable[tuple[str, torch.Tensor]], block: tuple[int, int]
) -> Iterator[tuple[str, torch.Tensor]]:
    """A block-scaled fp8 checkpoint's stream with each fp8 ``weight`` and its
    ``weight_scale_inv`` replaced by the weight multiplied out in fp32 (the layers quantize it
    per channel as they load). The two arrive in either order, usually one after the other;
    the first waits for its partner."""
    weights: dict[str, torch.Tensor] = {}
    scales: dict[str, torch.Tensor] = {}
    for name, tensor in tensors:
        if name.endswith(_SCALE_INV):
            prefix = name.removesuffix(_SCALE_INV)
            if prefix in weights:
                yield (
                    f"{prefix}.weight",
                    dequantize_blocks(weights.pop(prefix), tensor, block, prefix),
                )
            else:
                scales[prefix] = tensor
        elif name.endswith(".weight") and tensor.dtype == FP8:
            prefix = name.removesuffix(".weight")
            if prefix in scales:
                yield name, dequantize_blocks(tensor, scales.pop(prefix), block, prefix)
            else:
                weights[prefix] = tensor
        else:
            yield name, tensor
    unpaired = sorted(f"{p}.weight" for p in weights) + sorted(p + _SCALE_INV for p in scales)
    if unpaired:
        raise ValueError(
            "block-quantized fp8 checkpoint: weights and weight_scale_inv tensors without their "
            f"partner: {', '.join(unpaired[:8])}"
        )


def _packed_target(name: str, packed: dict[str, tuple[str, str]]) -> tuple[str, str | None]:
    """The parameter (and shard of it) a checkpoint tensor goes into, fused or not."""
    for piece, (fused, shard) in packed.items():
        if f".{piece}." in name:
            return name.replace(f".{piece}.", f".{fused}."), shard
    return name, None


def load_weights(
    model: nn.Module,
    path: Path,
    *,
    progress: bool = True,
    weight_block_size: tuple[int, int] | None = None,
    device: torch.device | None = None,
) -> None:
    """Copy every checkpoint tensor into its (possibly fused, possibly sharded) parameter.
    Unknown tensors and parameters left unloaded are errors, not silent random weights.
    progress: as for iter_checkpoint. weight_block_size: the checkpoint's fp8 weights are
    block-scaled (multiply_out_blocks). device: where the checkpoint's tensors are read to
    (iter_checkpoint), the model's own device when each rank holds whole tensors.

    A model whose checkpoint layout differs from its parameters (GPT-2: transposed Conv1D
    matrices, q/k/v in one tensor) defines ``checkpoint_tensors`` to rewrite the stream of
    (name, tensor) pairs first. One whose tensors go into stacked parameters (a mixture of
    experts' per-expert matrices) defines ``checkpoint_shard``: a name -> (parameter, shard), or
    None for the usual placement; such a parameter lists its shards in ``checkpoint_shards``.
    One that holds only some of a checkpoint's tensors (a rank's experts) names the others in
    ``checkpoint_skip``: they are never read."""
    params = dict(model.named_parameters())
    packed: dict[str, tuple[str, str]] = getattr(model, "packed_modules", {})
    tied = getattr(model, "tie_word_embeddings", False)
    rewrite: Callable[[Iterable[tuple[str, torch.Tensor]]], Iterable[tuple[str, torch.Tensor]]]
    rewrite = getattr(model, "checkpoint_tensors", lambda tensors: tensors)
    locate: Callable[[str], tuple[str, str] | None]
    locate = getattr(model, "checkpoint_shard", lambda name: None)
    skip: Callable[[str], bool] | None = getattr(model, "checkpoint_skip", None)
    stream = iter_checkpoint(path, progress=progress, skip=skip, device=device)
    if weight_block_size is not None:
        stream = multiply_out_blocks(stream, weight_block_size)
    loaded: set[str] = set()
    for name, tensor in rewrite(stream):
        if "rotary_emb.inv_freq" in name or (tied and name == "lm_head.weight"):
            continue
        placed = locate(name)
        target, shard = placed or _packed_target(name, packed)
        param = params.get(target)
        if param is None:
            raise ValueError(f"checkpoint tensor {name!r} has no place in {type(model).__name__}")
        loader = getattr(param, "weight_loader", None)
        if loader is None:
            if param.shape != tensor.shape:
                raise ValueError(f"{name}: shape {tuple(tensor.shape)} != {tuple(param.shape)}")
            param.data.copy_(tensor)
        else:
            # The loader narrows to this rank's slice first; copy_ converts the dtype after.
            loader(param, tensor, shard)
        loaded.add(target if shard is None else f"{target}#{shard}")
        derived = getattr(param, "quantizes_into", None)
        if derived is not None and tensor.dtype != FP8:
            # A higher-precision weight loaded into an fp8 layer brought its scales with it.
            sibling = f"{target.rsplit('.', 1)[0]}.{derived}"
            loaded.add(sibling if shard is None else f"{sibling}#{shard}")
    expected = set()
    for name, param in params.items():
        module = name.rsplit(".", 1)[0].rsplit(".", 1)[-1]
        shards = getattr(param, "checkpoint_shards", None) or [
            s for (fused, s) in packed.values() if fused == module
        ]
        expected.update(f"{name}#{s}" for s in shards) if shards else expected.add(name)
    if tied:
        expected.discard("lm_head.weight")
    missing = sorted(expected - loaded)
    if missing:
        raise ValueError(f"checkpoint {path} lacks weights for: {', '.join(missing[:8])}")


def init_dummy_weights(model: nn.Module, seed: int) -> None:
    """Random weights of the right shapes: fast and deterministic, for benchmarks only. Each
    checkpoint tensor is generated whole from a seed of its own name and handed to the
    parameter's loader, so a tensor-parallel rank holds exactly its slice of the model one rank
    would hold: the model does not depend on the tensor-parallel size. Norm weights are their
    identity (1, or 0 for Gemma's zero-centred ones) and LayerNorm biases 0, so activations keep
    a sane scale through deep models."""
    identity: dict[int, float] = {}
    for module in model.modules():
        if isinstance(module, RMSNorm):
            identity[id(module.weight)] = 0.0 if module.zero_centred else 1.0
        if isinstance(module, LayerNorm):
            identity[id(module.weight)] = 1.0
            identity[id(module.bias)] = 0.0
    for name, param in model.named_parameters():
        if id(param) in identity:
            param.data.fill_(identity[id(param)])
            continue
        if getattr(param, "quantized_at_load", False):
            continue  # fp8 scales: filled when their weights are quantized
        shapes = getattr(param, "checkpoint_shapes", {None: tuple(param.shape)})
        dtype = getattr(param, "checkpoint_dtype", param.dtype)
        for shard, shape in shapes.items():
            # Generated where the parameter lives: a 13B model filled on the host takes minutes.
            key = zlib.crc32(f"{seed}:{name}:{shard}".encode())
            gen = torch.Generator(device=param.device).manual_seed(key)
            whole = torch.empty(shape, dtype=dtype, device=param.device)
            whole.uniform_(-1e-2, 1e-2, generator=gen)
            loader = getattr(param, "weight_loader", None)
            if loader is None:
                param.data.copy_(whole)
            else:
                loader(param, whole, shard)
