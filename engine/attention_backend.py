"""The attention backend interface: write this step's K/V into the paged cache, then attend over
each sequence's paged context. ``torch`` is the reference (CPU, and the oracle); ``triton`` is the
GPU fast path. An FP8 KV cache comes with the layer's k/v scales (fp32 scalars on the device, see
``kernels.reference``); a cache of the model dtype with none."""

from __future__ import annotations

from typing import Protocol

import torch

from kvfleet.engine.attention_metadata import AttentionMetadata
from kvfleet.kernels import reference


class AttentionBackend(Protocol):
    name: str
    # Reads only the metadata's device tensors, so a CUDA graph may capture its kernels.
    supports_cuda_graphs: bool
    # Decode steps may attend a prefix all rows share once for the batch
    # (AttentionMetadata.cascade_prefix_len), in layers without a sliding window.
    supports_cascade: bool

    def warm_up_batches(self, max_num_seqs: int) -> list[int]:
        """Sequence counts of the prefill steps that compile every kernel variant serving can
        meet, for the runner to run once at start-up rather than in someone's request."""
        ...

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
    ) -> None: ...

    def attend(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
        logits_soft_cap: float | None,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
    ) -> torch.Tensor: ...


class TorchAttentionBackend:
    name = "torch"
    supports_cuda_graphs = False
    supports_cascade = False

    def warm_up_batches(self, max_num_seqs: int) -> list[int]:
        return []  # nothing compiles

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
    ) -> None:
        reference.write_kv_cache(key, value, kv_cache, meta.slot_mapping, k_scale, v_scale)

    def attend(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
        logits_soft_cap: float | None,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return reference.paged_attention(
            query,
            kv_cache,
            meta.block_tables,
            meta.seq_lens_cpu,
            meta.query_start_loc_cpu,
            scale,
            sliding_window,
            logits_soft_cap,
            k_scale,
            v_scale,
        )


def get_attention_backend(name: str, max_model_len: int) -> AttentionBackend:
    if name == "torch":
        return TorchAttentionBackend()
    if name == "triton":
        # Imported only here: triton is a GPU dependency the CPU install does not carry.
        from kvfleet.engine.triton_attention import TritonAttentionBackend

        return TritonAttentionBackend(max_model_len=max_model_len)
    raise ValueError(f"unknown attention backend {name!r}; known: torch, triton")
