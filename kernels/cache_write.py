"""Triton kernel that scatters this step's K/V into the paged KV cache (twin of
``reference.write_kv_cache``).

Cache layout, per layer: ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (K then V; an
FP8 cache's V by head and dimension within each block, see ``reference``). A slot is
``block_id * block_size + offset``. A negative slot means "skip this token": CUDA-graph batches
are padded to a captured size, and the padding tokens must not overwrite any block. An FP8 cache
stores ``clamp(x / scale, -448, 448)`` rounded to e4m3, NaN as 0 (see ``reference``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvfleet.kernels.dependent_launch import enter, pdl_args
from kvfleet.kernels.launch import kernel
from kvfleet.kernels.reference import FP8_MAX, cache_values, kv_scales

_FP8_MAX = tl.constexpr(FP8_MAX)


@triton.jit
def _quantize_e4m3(x, scale):
    """clamp(x / scale, +-448) (NaN as 0) rounded to the nearest e4m3 value (ties to even) in fp32
    arithmetic, so the cast to fp8 that follows is exact. A GPU's own cast rounds the same way,
    but Triton's CPU interpreter does not (it rounds ties up and drops a carry into the exponent:
    126.4 becomes 64), and the kernels are tested there."""
    # div_rn: Triton's `/` on fp32 is the approximate division, whose quotient, a unit off in
    # the last place now and then, rounded to a neighbouring e4m3 value (fp32 K/V on an H100).
    x = tl.math.div_rn(x.to(tl.float32), scale)
    # No NaN in the cache: the attention kernels read V slots they then weight by 0.
    x = tl.clamp(tl.where(x == x, x, 0.0), -_FP8_MAX, _FP8_MAX)
    bits = x.to(tl.int32, bitcast=True)
    # e4m3's spacing is 2**(E - 3) for |x| in [2**E, 2**(E + 1)), E >= -6, and 2**-9 below
    # (subnormals). Adding 2**23 times that spacing to |x| makes fp32 round |x| to a multiple
    # of it; subtracting it back is exact. Biased fp32 exponent 121 is 2**-6.
    biased = tl.maximum((bits >> 23) & 0xFF, 121)
    magic = ((biased + 20) << 23).to(tl.float32, bitcast=True)
    rounded = (tl.abs(x) + magic) - magic
    sign = (bits >> 31) << 31
    return (rounded.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@kernel
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    cache_ptr,
    slot_ptr,
    k_scale_ptr,
    v_scale_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ckv,
    stride_cblk,
    stride_ctok,
    stride_chead,
    stride_vblk,
    stride_vtok,
    stride_vhead,
    stride_vdim,
    NUM_KV_HEADS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    FP8: tl.constexpr,
    PDL: tl.constexpr,
):
    enter(PDL)
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
    if FP8:
        k = _quantize_e4m3(k, tl.load(k_scale_ptr))
        v = _quantize_e4m3(v, tl.load(v_scale_ptr))
    v_dst = (
        block * stride_vblk
        + offset * stride_vtok
        + heads[:, None] * stride_vhead
        + dims[None, :] * stride_vdim
    )
    tl.store(cache_ptr + dst, k.to(elem), mask=mask)
    tl.store(cache_ptr + stride_ckv + v_dst, v.to(elem), mask=mask)


def write_kv_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64; < 0 skips the token
    k_scale: torch.Tensor | None = None,  # fp32 scalars on the device: an FP8 cache only
    v_scale: torch.Tensor | None = None,
) -> None:
    num_tokens, num_kv_heads, head_dim = key.shape
    assert value.shape == key.shape, (key.shape, value.shape)
    assert kv_cache.shape[3:] == (num_kv_heads, head_dim), (kv_cache.shape, key.shape)
    assert slot_mapping.shape == (num_tokens,), (slot_mapping.shape, num_tokens)
    assert head_dim & (head_dim - 1) == 0, f"head_dim must be a power of two, got {head_dim}"
    scales = kv_scales(kv_cache, k_scale, v_scale)
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
        *(scales or (slot_mapping, slot_mapping)),  # read only with FP8
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        *cache_values(kv_cache).stride(),
        NUM_KV_HEADS=num_kv_heads,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim,
        PAGE_SIZE=kv_cache.shape[2],
        FP8=scales is not None,
        num_warps=4,
        **pdl_args(key.device),
    )
