"""The ``triton`` attention backend: the GPU fast path behind ``engine.attention_backend``'s
Protocol. Decode-only steps use the split-KV decode kernel; any step with a longer query chunk
(prefill, chunked prefill, prefix-cache hits, mixed batches) uses the prefill kernel. Decode
steps whose sequences share a cached prompt prefix attend to it once for the batch (cascade), in
layers without a sliding window."""

from __future__ import annotations

import torch

from kvfleet.engine.attention_metadata import AttentionMetadata
from kvfleet.kernels.cache_write import write_kv_cache
from kvfleet.kernels.paged_attention import (
    choose_num_splits,
    choose_prefix_splits,
    paged_decode_attention,
    paged_prefill_attention,
    prefill_seq_bucket,
)
from kvfleet.kernels.reference import is_fp8

# H100 SXM; used when no CUDA device is visible (the interpreter, tests).
_DEFAULT_NUM_SMS = 132


class TritonAttentionBackend:
    name = "triton"
    supports_cuda_graphs = True
    supports_cascade = True

    def __init__(self, max_model_len: int, num_sms: int | None = None) -> None:
        self.max_model_len = max_model_len
        if num_sms is None:
            num_sms = (
                torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
                if torch.cuda.is_available()
                else _DEFAULT_NUM_SMS
            )
        self.num_sms = num_sms

    def num_splits(self, batch_size: int, kv_cache: torch.Tensor) -> int:
        """Decode splits for one batch shape: fixed by static sizes only, so a CUDA graph
        captured for a batch size keeps its grid on replay."""
        return choose_num_splits(
            self.max_model_len, batch_size, kv_cache.shape[3], self.num_sms, is_fp8(kv_cache)
        )

    def warm_up_batches(self, max_num_seqs: int) -> list[int]:
        """One batch per width of the prefill kernel's sequence table (prefill_seq_bucket)."""
        counts = []
        bucket = prefill_seq_bucket(1)
        while True:
            count = min(max_num_seqs, bucket)
            assert prefill_seq_bucket(count) == bucket
            counts.append(count)
            if count == max_num_seqs:
                return counts
            bucket *= 2

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
    ) -> None:
        write_kv_cache(key, value, kv_cache, meta.slot_mapping, k_scale, v_scale)

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
        if meta.max_query_len == 1:
            batch, num_heads, num_kv_heads = query.shape[0], query.shape[1], kv_cache.shape[3]
            prefix = meta.cascade_prefix_len if sliding_window is None else None
            return paged_decode_attention(
                query,
                kv_cache,
                meta.block_tables,
                meta.seq_lens,
                scale,
                sliding_window,
                logits_soft_cap,
                num_splits=self.num_splits(batch, kv_cache),
                prefix_len=prefix,
                prefix_splits=1
                if prefix is None
                else choose_prefix_splits(
                    self.max_model_len, batch, num_heads, num_kv_heads, self.num_sms
                ),
                k_scale=k_scale,
                v_scale=v_scale,
            )
        return paged_prefill_attention(
            query,
            kv_cache,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            meta.max_query_len,
            scale,
            sliding_window,
            logits_soft_cap,
            k_scale=k_scale,
            v_scale=v_scale,
        )
