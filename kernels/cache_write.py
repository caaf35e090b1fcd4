"""Triton kernel that scatters this step's K/V into the paged KV cache (twin of
``reference.write_kv_cache``).

Cache layout, per layer: ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (K then V).
A slot is ``block_id * block_size + offset``. A negative slot means "skip this token": CUDA-graph
batches are padded to a captured size, and the padding tokens must not overwrite any block.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ckv,
    stride_cblk,
    stride_ctok,
    stride_chead,
    NUM_KV_HEADS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, HEAD_DIM)
    # A skipped token writes zero heads: masking keeps it a no-op without an early return.
    num_heads = tl.where(slot >= 0, NUM_KV_HEADS, 0)
    mask = (heads[:, None] < num_heads) & (dims[None, :] < HEAD_DIM)
    block = slot // PAGE_SIZE
    offset = slot % PAGE_SIZE
    dst = block * stride_cblk + offset * stride_ctok + heads[:, None] * stride_chead + dims[None, :]
    k = tl.load(key_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    v = tl.load(
        value_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask
    )
    elem = cache_ptr.dtype.element_ty
    tl.store(cache_ptr + dst, k.to(elem), mask=mask)
    tl.store(cache_ptr + stride_ckv + dst, v.to(elem), mask=mask)


def write_kv_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64; < 0 skips the token
) -> None:
    num_tokens, num_kv_heads, head_dim = key.shape
    assert value.shape == key.shape, (key.shape, value.shape)
    assert kv_cache.shape[3:] == (num_kv_heads, head_dim), (kv_cache.shape, key.shape)
    assert slot_mapping.shape == (num_tokens,), (slot_mapping.shape, num_tokens)
    assert head_dim & (head_dim - 1) == 0, f"head_dim must be a power of two, got {head_dim}"
    if num_tokens == 0:
        return
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    assert kv_cache.stride(-1) == 1, "the KV cache's head_dim must be contiguous"
    _write_kv_kernel[(num_tokens,)](
        key,
        value,
        kv_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        NUM_KV_HEADS=num_kv_heads,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim,
        PAGE_SIZE=kv_cache.shape[2],
        num_warps=4,
    )
