"""Pure-PyTorch twins of the Triton kernels (paged attention, KV-cache writes, norms, rotary,
activations, a mixture of experts' routing and MLP, fp8 quantization, the grammar mask, batched
LoRA): the CPU path and the oracle the kernels are tested against. Clarity over speed; one
sequence at a time.

KV cache layout, per layer: ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (K then V).
An FP8 cache (e4m3) holds ``clamp(x / scale, -448, 448)``, one fp32 scale per layer for K and
one for V. For the decode kernel's sake it keeps V by dimension within each block
(``cache_values`` gives the usual view: a tensor-core dot needs a dimension's tokens side by
side) and holds no NaN (written as 0; the engine zeroes the cache), so kernels read whole pages
unmasked: slots past a sequence's end get zero weight, and 0 x a finite value is 0.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple

import torch

FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value


def is_fp8(kv_cache: torch.Tensor) -> bool:
    return kv_cache.dtype == FP8_KV_DTYPE


def kv_scales(
    kv_cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The scales an FP8 cache needs (both, or an error); None for a cache of the model dtype."""
    if not is_fp8(kv_cache):
        return None
    if k_scale is None or v_scale is None:
        raise ValueError("an FP8 KV cache needs its k_scale and v_scale")
    return k_scale, v_scale


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale in fp32, saturated to e4m3's finite range, rounded to nearest even; NaN is 0."""
    return (x.float() / scale).nan_to_num(0.0).clamp(-FP8_MAX, FP8_MAX).to(FP8_KV_DTYPE)


def cache_values(kv_cache: torch.Tensor) -> torch.Tensor:
    """The V half as ``[num_blocks, block_size, num_kv_heads, head_dim]``: the tensor itself, or
    for an FP8 cache a strided view of its blocks laid out by head and dimension."""
    if not is_fp8(kv_cache):
        return kv_cache[1]
    num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape[1:]
    by_dim = kv_cache[1].view(num_blocks, num_kv_heads, head_dim, block_size)
    return by_dim.permute(0, 3, 1, 2)


def write_kv_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens], slot = block_id * block_size + offset; < 0: skip
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    block_size = kv_cache.shape[2]
    flat = kv_cache.view(2, -1, *kv_cache.shape[3:])
    assert flat.shape[1] == kv_cache.shape[1] * block_size
    keep = slot_mapping >= 0  # padding rows of a CUDA-graph batch write nothing
    if not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    scales = kv_scales(kv_cache, k_scale, v_scale)
    if scales is None:
        flat[0].index_copy_(0, slot_mapping, key.to(kv_cache.dtype))
        flat[1].index_copy_(0, slot_mapping, value.to(kv_cache.dtype))
        return
    # The CPU has no index_copy_ for fp8: the bytes are copied as uint8.
    flat.view(torch.uint8)[0].index_copy_(
        0, slot_mapping, quantize_fp8(key, scales[0]).view(torch.uint8)
    )
    values = cache_values(kv_cache).view(torch.uint8)
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    values[blocks, offsets] = quantize_fp8(value, scales[1]).view(torch.uint8)


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]: each sequence's newest tokens
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks]
    seq_lens: Sequence[int],  # per sequence: context length including this step's tokens
    query_start_loc: Sequence[int],  # [num_seqs + 1] offsets of each sequence's queries
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its whole paged context.

    The new tokens are the last ``q_len`` positions of a context of ``seq_len`` tokens, so one
    routine serves decode (q_len 1), prefill (q_len == seq_len) and chunked prefill / prefix-cache
    hits (anything between). Computed in fp32, returned in the query's dtype.
    """
    scales = kv_scales(kv_cache, k_scale, v_scale)
    num_heads, head_dim = query.shape[1], query.shape[2]
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    for i, seq_len in enumerate(seq_lens):
        start, end = int(query_start_loc[i]), int(query_start_loc[i + 1])
        q_len = end - start
        if q_len == 0:
            continue
        num_blocks = -(-seq_len // block_size)
        blocks = block_tables[i, :num_blocks].long()
        k = kv_cache[0, blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len].float()
        v = cache_values(kv_cache)[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len].float()
        if scales is not None:
            k, v = k * scales[0], v * scales[1]
        q = query[start:end].float().view(q_len, num_kv_heads, group, head_dim)
        scores = torch.einsum("qhgd,khd->hgqk", q, k) * scale
        if logits_soft_cap is not None:
            scores = logits_soft_cap * torch.tanh(scores / logits_soft_cap)
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)[:, None]
        k_pos = torch.arange(seq_len, device=query.device)[None, :]
        visible = k_pos <= q_pos
        if sliding_window is not None:
            visible &= k_pos > q_pos - sliding_window
        scores.masked_fill_(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        o = torch.einsum("hgqk,khd->qhgd", probs, v)
        out[start:end] = o.reshape(q_len, num_heads, head_dim).to(query.dtype)
    return out


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    zero_centred: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``norm(x)``, or ``(norm(x + residual), x + residual)``; statistics in fp32. Llama-family
    norms round to the input dtype before the weight multiply, as HF's do; Gemma's zero-centred
    ones scale by ``1 + weight`` in fp32 and round once, as HF's Gemma2RMSNorm does."""
    if residual is not None:
        x = x + residual
        residual = x
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = (h * (1.0 + weight.float())).to(dtype) if zero_centred else weight * h.to(dtype)
    return out if residual is None else (out, residual)


class QKNorm(NamedTuple):
    """The per-head RMSNorms of q and k that some families (Qwen3) apply before the rotation:
    each head's head_dim values normalised as ``rms_norm`` does, by its norm's weight."""

    q_weight: torch.Tensor  # [head_dim]
    k_weight: torch.Tensor  # [head_dim]
    eps: float
    zero_centred: bool = False


def apply_rotary(
    q: torch.Tensor,  # [tokens, heads, head_dim]
    k: torch.Tensor,  # [tokens, kv_heads, head_dim]
    positions: torch.Tensor,
    cos: torch.Tensor,  # [max_pos, head_dim] fp32, halves duplicated
    sin: torch.Tensor,
    qk_norm: QKNorm | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half rotary embedding in the activations' dtype, as HF applies it; with
    ``qk_norm``, each head of q and k normalised first (HF's Qwen3 order: q_norm and k_norm on
    the per-head view, then the rotation)."""
    if qk_norm is not None:
        q = _norm_heads(q, qk_norm.q_weight, qk_norm)
        k = _norm_heads(k, qk_norm.k_weight, qk_norm)
    c = cos[positions].unsqueeze(1).to(q.dtype)
    s = sin[positions].unsqueeze(1).to(q.dtype)

    def rotate_half(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    return q * c + rotate_half(q) * s, k * c + rotate_half(k) * s


def _norm_heads(x: torch.Tensor, weight: torch.Tensor, qk_norm: QKNorm) -> torch.Tensor:
    out = rms_norm(x, weight, qk_norm.eps, zero_centred=qk_norm.zero_centred)
    assert isinstance(out, torch.Tensor)  # without a residual, the norm alone
    return out


# Gated MLP activations that have a fused Triton twin (kernels.activation), by HF hidden_act.
GATED_ACTIVATIONS = {
    "silu": torch.nn.functional.silu,
    "gelu_pytorch_tanh": functools.partial(torch.nn.functional.gelu, approximate="tanh"),
}


def act_and_mul(x: torch.Tensor, activation: str) -> torch.Tensor:
    """act(gate) * up for an input holding gate and up side by side, in the input dtype."""
    gate, up = x.chunk(2, dim=-1)
    return GATED_ACTIVATIONS[activation](gate) * up


def route_experts(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights fp32 [tokens, top_k], ids int64 [tokens, top_k]): each token's top_k experts by
    the softmax of its router logits (in fp32), most probable first, their probabilities
    rescaled to sum to 1 when ``renormalize``. The twin of kernels.expert_routing."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def fused_experts(
    x: torch.Tensor,  # [tokens, hidden]
    gate_up: torch.Tensor,  # [experts, 2 * intermediate, hidden]: gate rows, then up rows
    down: torch.Tensor,  # [experts, hidden, intermediate]
    weights: torch.Tensor,  # fp32 [tokens, top_k]: the routing weights
    ids: torch.Tensor,  # int [tokens, top_k]: each slot's expert, -1 for one on another rank
    activation: str,
    gate_up_scale: torch.Tensor | None = None,  # fp32 [experts, 2 * intermediate]
    down_scale: torch.Tensor | None = None,  # fp32 [experts, hidden]
    fp8_activations: bool = False,
) -> torch.Tensor:
    """A mixture of experts' MLP: sum_j weights[t, j] * down[e] @ act_and_mul(gate_up[e] @ x[t])
    over the experts e = ids[t, j] of each token t; a slot whose id is -1 adds nothing (expert
    parallelism: its expert is another rank's). The (token, slot) pairs are sorted by expert, so
    each expert runs once over all its tokens, as the grouped GEMM of kernels.fused_moe does.

    Weights of the model dtype multiply in it. FP8 (e4m3) weights are dequantized by their
    per-expert, per-output-channel scales, and the products accumulate in fp32; the gate/up
    output is rounded to the model dtype as a model-dtype GEMM's would be. The activations stay
    in the model dtype (W8A16), or with ``fp8_activations`` (W8A8) are quantized per row as
    ``quantize_tokens`` does: each token's x before gate/up, each pair's act(gate) * up (a row
    over this rank's whole intermediate slice) before down; a GEMM's fp32 sum of the fp8
    products is then scaled by the row's scale, then the column's. The twin of
    kernels.fused_moe.fused_experts."""
    fp8 = gate_up.dtype == FP8
    if fp8 != (down.dtype == FP8):
        raise ValueError(f"gate_up is {gate_up.dtype} but down is {down.dtype}")
    if fp8 and (gate_up_scale is None or down_scale is None):
        raise ValueError("fp8 expert weights need gate_up_scale and down_scale")
    if fp8_activations and not fp8:
        raise ValueError(f"fp8 activations (W8A8) need fp8 experts, not {gate_up.dtype}")
    num_tokens, top_k = ids.shape
    flat_ids = ids.reshape(-1)
    # Skipped slots (-1) sort first; each expert's pairs follow in token order.
    order = torch.argsort(flat_ids, stable=True)
    token_of = order // top_k
    kept = flat_ids[flat_ids >= 0]
    counts = torch.bincount(kept, minlength=gate_up.shape[0]).tolist()
    sorted_weights = weights.reshape(-1)[order]
    out = torch.zeros(num_tokens, x.shape[-1], dtype=torch.float32, device=x.device)
    start = flat_ids.numel() - kept.numel()
    x_fp8, x_scale = quantize_tokens(x) if fp8_activations else (x, None)
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows = token_of[start : start + count]
        if gate_up_scale is not None and down_scale is not None and x_scale is not None:
            gu = (x_fp8[rows].float() @ gate_up[expert].float().t()) * x_scale[rows]
            h = act_and_mul((gu * gate_up_scale[expert]).to(x.dtype), activation)
            h_fp8, h_scale = quantize_tokens(h)
            y = (h_fp8.float() @ down[expert].float().t()) * h_scale * down_scale[expert]
        elif gate_up_scale is not None and down_scale is not None:
            gu = (x[rows].float() @ gate_up[expert].float().t()) * gate_up_scale[expert]
            h = act_and_mul(gu.to(x.dtype), activation)
            y = (h.float() @ down[expert].float().t()) * down_scale[expert]
        else:
            h = act_and_mul(x[rows] @ gate_up[expert].t(), activation)
            y = (h @ down[expert].t()).float()
        out.index_add_(0, rows, y * sorted_weights[start : start + count, None])
        start += count
    return out.to(x.dtype)


# FP8 (e4m3) activations, as the fp8 linear layers quantize them: the twin of
# kernels.fp8_quant.quantize_tokens.
FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
# The smallest scale: an all-zero row or token quantizes to zeros instead of dividing by zero.
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)


def quantize_tokens(
    x: torch.Tensor, static_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 rows, fp32 scale [M, 1]): each row (token) scaled by its own amax / 448, or by the
    checkpoint's static scale, values beyond the fp8 range clamped."""
    if static_scale is None:
        amax = x.abs().amax(dim=-1, keepdim=True).float()
        scale = (amax / FP8_MAX).clamp_(min=MIN_SCALE)
    else:
        scale = static_scale.reshape(1, 1).expand(x.shape[0], 1).contiguous()
    fp8 = (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    return fp8, scale


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """-inf, in place, into every logit whose bit is clear: logits [rows, vocab], bitmask int32
    [rows, >= vocab / 32] on the logits' device, bit t of a row being bit t % 32 of word t // 32.
    The twin of kernels.grammar_mask.apply_token_bitmask."""
    vocab = logits.shape[-1]
    # Bytes of the little-endian words (on x86 and the GPU): bit t is bit t % 8 of byte t // 8.
    bits = torch.tensor([1 << i for i in range(8)], dtype=torch.uint8, device=logits.device)
    allowed = (bitmask.view(torch.uint8).unsqueeze(-1) & bits).flatten(1)[:, :vocab]
    logits.masked_fill_(allowed == 0, float("-inf"))


# Batched LoRA (the twins of kernels.lora). A batch mixes adapters and the base model: slots[t]
# names the GPU slot of token t's adapter, -1 for the base model. Slots hold each adapter's
# A [R, K] and B [N, R] padded to the largest rank R with zeros (so a smaller rank adds
# nothing beyond its own), B already scaled by lora_alpha / r (or rsLoRA's / sqrt(r)). Both
# loop over the slots, a fixed count, so neither reads the slot map on the host.


def lora_shrink(
    x: torch.Tensor,  # [T, K]
    a: torch.Tensor,  # [S, R, K]
    slots: torch.Tensor,  # [T] int32, in [-1, S)
) -> torch.Tensor:
    """[T, R] in x's dtype: row t is x[t] @ a[slots[t]].T accumulated in fp32, zero where
    slots[t] is -1."""
    xf = x.float()
    y = torch.zeros(x.shape[0], a.shape[1], dtype=torch.float32, device=x.device)
    for s in range(a.shape[0]):
        y = torch.where((slots == s).unsqueeze(1), xf @ a[s].float().T, y)
    return y.to(x.dtype)


def lora_expand(
    y: torch.Tensor,  # [T, R]
    b: torch.Tensor,  # [S, N, R]
    slots: torch.Tensor,  # [T] int32, in [-1, S)
    out: torch.Tensor,  # [T, >= offset + N]
    offset: int = 0,
) -> None:
    """out[t, offset:offset + N] += y[t] @ b[slots[t]].T in place where slots[t] >= 0: the sum
    in fp32, rounded once to out's dtype; rows of the base model and the other columns keep
    their values."""
    yf = y.float()
    n = b.shape[1]
    delta = torch.zeros(y.shape[0], n, dtype=torch.float32, device=y.device)
    for s in range(b.shape[0]):
        delta = torch.where((slots == s).unsqueeze(1), yf @ b[s].float().T, delta)
    target = out[:, offset : offset + n]
    target.copy_(target.float() + delta)


def lora_shrink_slices(
    x: torch.Tensor, a_slices: Sequence[torch.Tensor], slots: torch.Tensor
) -> torch.Tensor:
    """[n_slices, T, R]: lora_shrink of x by each slice's A (q, k, v of a fused qkv)."""
    return torch.stack([lora_shrink(x, a, slots) for a in a_slices])


def lora_expand_slices(
    y: torch.Tensor,  # [n_slices, T, R]
    b_slices: Sequence[torch.Tensor],
    slots: torch.Tensor,
    out: torch.Tensor,
    offsets: Sequence[int],
) -> None:
    """lora_expand of each slice's y by its B into out's columns from that slice's offset."""
    for y_i, b, offset in zip(y, b_slices, offsets, strict=True):
        lora_expand(y_i, b, slots, out, offset)


def add_lora_slices(
    x: torch.Tensor,  # [T, K]
    a_slices: Sequence[torch.Tensor],  # each [S, R, K]
    b_slices: Sequence[torch.Tensor],  # each [S, N_i, R]
    slots: torch.Tensor,  # [T] int32, in [-1, S)
    out: torch.Tensor,
    offsets: Sequence[int],
) -> None:
    """out[:, offsets[i]:offsets[i] + N_i] += (x @ A_i.T) @ B_i.T of each token's slot, in
    place, for every slice i (the shrink rounded to x's dtype in between)."""
    lora_expand_slices(lora_shrink_slices(x, a_slices, slots), b_slices, slots, out, offsets)
