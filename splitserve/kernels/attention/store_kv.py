"""Triton kernel: scatter the step's new K/V rows into the paged KV cache, rotating q and k first.

kv_cache layout is [num_blocks, 2, block_size, num_kv_heads, head_dim] (index 0 = K, 1 = V), see
splitserve/attention/backend.py. Token t goes to slot slot_mapping[t] = block * block_size + offset;
slot -1 marks a padding token (e.g. a CUDA-graph pad row) and is skipped, so those cache rows stay
untouched.

With a rotary table the same pass applies the rotary embedding (NeoX half-split style, the first
rot_dim of each head, in fp32) to k before storing it and to q, which it writes out: q, k and v are
then read straight from the fused QKV projection's output, and no separate rotary pass over them is
needed. The reference is layers/rotary.apply_rotary.

An FP8 (e4m3) cache stores k / k_scale and v / v_scale, computed in fp32 and saturated at +-448 (the
largest finite e4m3 value); the scales are one-element fp32 device tensors, so the launch reads no
host value. The reference is torch_ref.store_kv_ref.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate(ptr, rows, offs_d, mask, partner, sign, cos, sin):
    # out[d] = x[d] * cos[d] + sign[d] * x[partner(d)] * sin[d]; cos = 1, sin = 0 past rot_dim
    x = tl.load(ptr + rows[:, None] + offs_d[None, :], mask=mask).to(tl.float32)
    xp = tl.load(ptr + rows[:, None] + partner[None, :], mask=mask).to(tl.float32)
    return x * cos[None, :] + sign[None, :] * xp * sin[None, :]


_FP8_MAX = tl.constexpr(448.0)  # largest finite e4m3 value


@triton.jit
def _to_fp8(x, scale_ptr, elem):
    x = x.to(tl.float32) / tl.load(scale_ptr)
    return tl.minimum(tl.maximum(x, -_FP8_MAX), _FP8_MAX).to(elem)


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, cache_ptr, slot_ptr, q_ptr, q_out_ptr, pos_ptr, cos_sin_ptr, k_scale_ptr, v_scale_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_qt, stride_qh, stride_ot, stride_oh, stride_cos,
    stride_cb, stride_ckv, stride_cs, stride_ch,
    block_size,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    NUM_HEADS: tl.constexpr, BLOCK_HQ: tl.constexpr, ROT_DIM: tl.constexpr, FP8: tl.constexpr,
):
    # One program per token: a token's K and V are only NUM_KV_HEADS * HEAD_DIM elements each (and q
    # NUM_HEADS * HEAD_DIM), so one tile per tensor covers the row and the grid stays just [T].
    t = tl.program_id(0)
    t64 = t.to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    k_rows = t64 * stride_kt + offs_h * stride_kh

    if ROT_DIM > 0:
        HALF: tl.constexpr = ROT_DIM // 2
        pos = tl.load(pos_ptr + t).to(tl.int64)
        lower = offs_d < HALF
        in_rot = offs_d < ROT_DIM
        partner = tl.where(lower, offs_d + HALF, offs_d - HALF)
        partner = tl.where(in_rot, partner, offs_d)
        sign = tl.where(lower, -1.0, 1.0)
        freq = tl.where(lower, offs_d, offs_d - HALF)
        cos = tl.load(cos_sin_ptr + pos * stride_cos + freq, mask=in_rot, other=1.0)
        sin = tl.load(cos_sin_ptr + pos * stride_cos + HALF + freq, mask=in_rot, other=0.0)
        # q is rotated for every row, padding included (attention ignores those rows).
        offs_hq = tl.arange(0, BLOCK_HQ)
        mask_q = (offs_hq[:, None] < NUM_HEADS) & (offs_d[None, :] < HEAD_DIM)
        q = _rotate(q_ptr, t64 * stride_qt + offs_hq * stride_qh, offs_d, mask_q, partner, sign, cos, sin)
        q_dst = q_out_ptr + t64 * stride_ot + offs_hq[:, None] * stride_oh + offs_d[None, :]
        tl.store(q_dst, q.to(q_out_ptr.dtype.element_ty), mask=mask_q)
        if slot < 0:
            return
        k = _rotate(k_ptr, k_rows, offs_d, mask, partner, sign, cos, sin)
    else:
        if slot < 0:
            return
        k = tl.load(k_ptr + k_rows[:, None] + offs_d[None, :], mask=mask)
    v = tl.load(v_ptr + t64 * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)

    # int64 arithmetic: block * stride_cb overflows int32 for caches beyond 2^31 elements.
    block = slot // block_size
    offset = slot % block_size
    dst = cache_ptr + block * stride_cb + offset * stride_cs + offs_h[:, None] * stride_ch + offs_d[None, :]
    elem = cache_ptr.dtype.element_ty
    if FP8:
        tl.store(dst, _to_fp8(k, k_scale_ptr, elem), mask=mask)
        tl.store(dst + stride_ckv, _to_fp8(v, v_scale_ptr, elem), mask=mask)
    else:
        tl.store(dst, k.to(elem), mask=mask)
        tl.store(dst + stride_ckv, v.to(elem), mask=mask)


def store_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
             q: torch.Tensor | None = None, positions: torch.Tensor | None = None,
             cos_sin: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None) -> torch.Tensor | None:
    """Writes k, v [T, Hkv, D] into kv_cache [num_blocks, 2, block_size, Hkv, D] at slot_mapping [T].

    With cos_sin (fp32 [max_position, rot_dim], cos | sin halves), positions [T] and q [T, Hq, D],
    k is rotated before it is stored and the rotated q is returned (a new contiguous tensor).
    q, k and v may be strided views (e.g. slices of a fused qkv projection) as long as head_dim is
    contiguous. Values are cast to kv_cache's dtype; into an FP8 cache (torch.float8_e4m3fn) as
    k / k_scale and v / v_scale (one-element fp32 tensors; None: 1.0), saturated. No host sync; grid
    depends only on T.
    """
    num_tokens, num_kv_heads, head_dim = k.shape
    assert v.shape == k.shape, (k.shape, v.shape)
    assert kv_cache.dim() == 5 and kv_cache.shape[1] == 2, kv_cache.shape
    assert kv_cache.shape[3] == num_kv_heads and kv_cache.shape[4] == head_dim, (kv_cache.shape, k.shape)
    assert slot_mapping.shape[0] >= num_tokens, (slot_mapping.shape, num_tokens)
    rotary = cos_sin is not None
    if rotary:
        assert q is not None and positions is not None and q.shape[0] == num_tokens and q.shape[2] == head_dim
        assert cos_sin.dtype == torch.float32 and cos_sin.stride(-1) == 1 and cos_sin.shape[-1] % 2 == 0
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if rotary else None
    if num_tokens == 0:
        return q_out
    # The kernel assumes unit stride on head_dim (vectorised loads); copy only in the rare other case.
    k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (k, v))
    if rotary and q.stride(-1) != 1:
        q = q.contiguous()
    assert kv_cache.stride(-1) == 1, "kv_cache head_dim must be contiguous"
    # Without rotary the q-side arguments are unused: stand-ins keep the signature.
    q_in, q_dst, pos, table = (q, q_out, positions, cos_sin) if rotary else (k, k, slot_mapping, k)
    fp8, k_scale, v_scale = fp8_scales(kv_cache, k_scale, v_scale)
    num_heads = q_in.shape[1]
    # Warps by the elements a program moves: K and V rows, plus q with rotary.
    if rotary:
        num_warps = 2 if num_heads * head_dim <= 2048 else 4
    else:
        num_warps = 1 if num_kv_heads * head_dim <= 512 else 4
    _store_kv_kernel[(num_tokens,)](
        k, v, kv_cache, slot_mapping, q_in, q_dst, pos, table, k_scale, v_scale,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), q_in.stride(0), q_in.stride(1),
        q_dst.stride(0), q_dst.stride(1), table.stride(0) if rotary else 0,
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        kv_cache.shape[2],
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        NUM_HEADS=num_heads, BLOCK_HQ=triton.next_power_of_2(num_heads), ROT_DIM=cos_sin.shape[-1] if rotary else 0,
        FP8=fp8, num_warps=num_warps,
    )
    return q_out


def fp8_scales(kv_cache: torch.Tensor, k_scale: torch.Tensor | None,
               v_scale: torch.Tensor | None) -> tuple[bool, torch.Tensor, torch.Tensor]:
    """(whether kv_cache is FP8, the k and v scale arguments of a kernel launch). For an FP8 cache the
    scales (None: 1.0) as one-element fp32 tensors; for any other cache the kernels never read them,
    and the cache stands in for both, so the kernel's signature (and Triton's cache key) does not
    depend on whether a caller passed scales."""
    if kv_cache.dtype != torch.float8_e4m3fn:
        return False, kv_cache, kv_cache
    one = None
    scales = []
    for s in (k_scale, v_scale):
        if s is None:
            one = torch.ones(1, dtype=torch.float32, device=kv_cache.device) if one is None else one
            s = one
        assert s.dtype == torch.float32 and s.numel() == 1, (s.dtype, s.shape)
        scales.append(s)
    return True, scales[0], scales[1]
