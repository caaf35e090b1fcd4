"""GGUF checkpoints (llama.cpp's single-file format): the HF config and tokenizer built by
transformers from the file's metadata, and the tensors dequantized at load with the `gguf`
package, renamed to HF's names and with llama.cpp's rope permutation of q/k undone."""

from __future__ import annotations

import copy
import functools
import logging
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

logger = logging.getLogger(__name__)


# GGUF's general.architecture -> the HF architecture that serves it.
ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
# llama.cpp's converter interleaves q/k rows for its rope layout for these architectures only;
# Qwen's GGUFs keep HF's (NeoX) layout.
_PERMUTED = frozenset({"llama", "mistral"})

QUANT_TYPES = (
    "F32",
    "F16",
    "BF16",
    "Q8_0",
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q2_K",
    "Q3_K",
    "Q4_K",
    "Q5_K",
    "Q6_K",
)

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Precomputed rope frequencies (Llama 3): HF derives them from the config instead.
_SKIPPED = frozenset({"rope_freqs.weight"})


def _reader(file: Path) -> Any:
    """The file's reader, shared by the config, the tokenizer check and the tensor table of one
    load: GGUFReader parses every metadata field up front, ~5 s for the default model's
    49k-token vocabulary on a busy 2-core machine. The tensor table lets it go."""
    _, mtime_ns, size = _file_key(file)
    return _open_reader(file.resolve(), mtime_ns, size)


@functools.lru_cache(maxsize=1)
def _open_reader(file: Path, mtime_ns: int, size: int) -> Any:
    from gguf import GGUFReader

    try:
        return GGUFReader(file)
    except (ValueError, IndexError) as e:
        # What numpy says of a header or tensor table cut short ("When changing to a larger
        # dtype...", "cannot reshape array...") names neither the file nor the problem.
        logger.debug("GGUFReader(%s): %r", file, e)
        raise ValueError(
            f"{file} is a truncated or corrupt GGUF file ({size:,} bytes): download or convert "
            "it again"
        ) from None


def _field(reader: Any, key: str) -> Any:
    field = reader.get_field(key)
    return None if field is None else field.contents()


def _gguf_architecture(reader: Any, file: Path) -> str:
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"{file.name}: GGUF architecture {arch!r} is not supported; supported: "
            f"{', '.join(ARCHITECTURES)}"
        )
    return arch


def _check_quant_types(reader: Any, file: Path) -> None:
    unsupported = sorted({t.tensor_type.name for t in reader.tensors} - set(QUANT_TYPES))
    if unsupported:
        raise ValueError(
            f"{file.name}: GGUF tensor type(s) {', '.join(unsupported)} not supported; "
            f"supported: {', '.join(QUANT_TYPES)}"
        )


def _file_key(file: Path) -> tuple[Path, int, int]:
    # mtime and size in the key: a file replaced at the same path is read anew. The path as
    # given, not resolved: a hub cache's link names the file its messages speak of.
    stat = file.stat()
    return file.absolute(), stat.st_mtime_ns, stat.st_size


def load_config(file: Path) -> Any:
    """The HF config of a GGUF checkpoint, after checking its architecture and tensor types.
    A copy of the one built at this file's first load in the process: transformers parses every
    metadata field again for it (~4 s for the default model), and the perplexity benchmark and
    the tests load one file many times."""
    return copy.deepcopy(_loaded_config(*_file_key(file)))


@functools.lru_cache(maxsize=1)
def _loaded_config(file: Path, mtime_ns: int, size: int) -> Any:
    from transformers import AutoConfig

    reader = _reader(file)
    arch = _gguf_architecture(reader, file)
    _check_quant_types(reader, file)
    config = AutoConfig.from_pretrained(file.parent, gguf_file=file.name)
    config.architectures = [ARCHITECTURES[arch]]
    # transformers reads no head size for some architectures (Qwen3) and falls back to its
    # class default; the file's key length is the one the weights have.
    key_length = _field(reader, f"{arch}.attention.key_length")
    if key_length is not None:
        config.head_dim = int(key_length)
    return config


def load_tokenizer(file: Path) -> Any:
    """The tokenizer the GGUF metadata carries; a file without one needs --tokenizer. A copy of
    the one built at this file's first load in the process, as load_config's (a server sets its
    chat template on it)."""
    return copy.deepcopy(_loaded_tokenizer(*_file_key(file)))


@functools.lru_cache(maxsize=1)
def _loaded_tokenizer(file: Path, mtime_ns: int, size: int) -> Any:
    from transformers import AutoTokenizer

    if _field(_reader(file), "tokenizer.ggml.model") is None:
        raise ValueError(
            f"{file.name} carries no tokenizer: pass --tokenizer (an HF tokenizer directory)"
        )
    return AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)


def _unpermute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's convert_hf_to_gguf `permute`: per head, its rows were reordered
    from HF's two rotary halves to interleaved pairs."""
    w = weights.reshape(n_head, weights.shape[0] // n_head // 2, 2, *weights.shape[1:])
    return w.swapaxes(1, 2).reshape(weights.shape)


def _hf_name(name: str) -> str | None:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    match = _BLOCK.fullmatch(name)
    if match is None or match.group(2) not in _BLOCK_NAMES:
        return None
    layer, kind, suffix = match.groups()
    return f"model.layers.{layer}.{_BLOCK_NAMES[kind]}.{suffix}"


@dataclass(frozen=True)
class _TensorEntry:
    name: str  # GGUF's
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # the tensor's, slowest-first as numpy's
    offset: int  # of its data in the file
    dtype: np.dtype  # of its stored data (bytes for a quantized type), and that data's shape
    data_shape: tuple[int, ...]


@dataclass(frozen=True)
class _TensorTable:
    arch: str
    n_head: int
    n_kv_head: int
    tensors: tuple[_TensorEntry, ...]


@functools.lru_cache(maxsize=1)
def _tensor_table(file: Path, mtime_ns: int, size: int) -> _TensorTable:
    """Where each tensor lies in the file, kept for the process's later loads of it: finding
    them means parsing every metadata field again (GGUFReader has no other way). The reader
    itself, and the mapping its fields hold, go once this is taken from it."""
    reader = _reader(file)
    arch = _gguf_architecture(reader, file)
    _check_quant_types(reader, file)
    n_head = int(_field(reader, f"{arch}.attention.head_count"))
    n_kv_head = int(_field(reader, f"{arch}.attention.head_count_kv") or n_head)
    tensors = tuple(
        # GGUF lists dimensions fastest-first; numpy (and torch) want them slowest-first.
        _TensorEntry(
            t.name,
            t.tensor_type,
            tuple(int(d) for d in reversed(t.shape)),
            t.data_offset,
            t.data.dtype,
            t.data.shape,
        )
        for t in reader.tensors
    )
    _open_reader.cache_clear()
    return _TensorTable(arch, n_head, n_kv_head, tensors)


def iter_tensors(file: Path, *, progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, float32 tensor) for every tensor of the file, dequantized one at a time.
    progress: a bar on stderr when it is a terminal; False for none."""
    from gguf.quants import dequantize

    table = _tensor_table(*_file_key(file))
    mapped = np.memmap(file, mode="r")
    tensors = tqdm(
        table.tensors,
        desc=f"Dequantizing {file.name}",
        unit="tensor",
        disable=None if progress else True,
    )
    for tensor in tensors:
        if tensor.name in _SKIPPED:
            continue
        name = _hf_name(tensor.name)
        if name is None:
            raise ValueError(f"{file.name}: GGUF tensor {tensor.name!r} has no HF counterpart")
        end = tensor.offset + math.prod(tensor.data_shape) * tensor.dtype.itemsize
        data = mapped[tensor.offset : end].view(tensor.dtype).reshape(tensor.data_shape)
        values = dequantize(data, tensor.tensor_type).reshape(tensor.shape)
        if table.arch in _PERMUTED and ".q_proj." in name:
            values = _unpermute(values, table.n_head)
        elif table.arch in _PERMUTED and ".k_proj." in name:
            values = _unpermute(values, table.n_kv_head)
        # A copy: F32 tensors come back as read-only views of the memory-mapped file.
        yield name, torch.from_numpy(np.array(values, dtype=np.float32))
