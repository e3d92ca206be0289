"""Triton kernel: scatter the step's new K/V rows into the paged KV cache.

kv_cache layout is [num_blocks, 2, block_size, num_kv_heads, head_dim] (index 0 = K, 1 = V), see
splitserve/attention/backend.py. Token t goes to slot slot_mapping[t] = block * block_size + offset;
slot -1 marks a padding token (e.g. a CUDA-graph pad row) and is skipped, so those cache rows stay
untouched.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_ckv, stride_cs, stride_ch,
    block_size,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # One program per token: a token's K and V are only NUM_KV_HEADS * HEAD_DIM elements each, so a
    # single [BLOCK_H, BLOCK_D] tile covers the whole row and the grid stays just [T].
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    # int64 arithmetic: block * stride_cb overflows int32 for caches beyond 2^31 elements.
    block = slot // block_size
    offset = slot % block_size

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)

    t64 = t.to(tl.int64)
    k = tl.load(k_ptr + t64 * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(v_ptr + t64 * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)

    dst = cache_ptr + block * stride_cb + offset * stride_cs + offs_h[:, None] * stride_ch + offs_d[None, :]
    elem = cache_ptr.dtype.element_ty
    tl.store(dst, k.to(elem), mask=mask)
    tl.store(dst + stride_ckv, v.to(elem), mask=mask)


def store_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Writes k, v [T, Hkv, D] into kv_cache [num_blocks, 2, block_size, Hkv, D] at slot_mapping [T].

    k and v may be strided views (e.g. slices of a fused qkv projection) as long as head_dim is
    contiguous. Values are cast to kv_cache's dtype. No host sync; grid depends only on T.
    """
    num_tokens, num_kv_heads, head_dim = k.shape
    assert v.shape == k.shape, (k.shape, v.shape)
    assert kv_cache.dim() == 5 and kv_cache.shape[1] == 2, kv_cache.shape
    assert kv_cache.shape[3] == num_kv_heads and kv_cache.shape[4] == head_dim, (kv_cache.shape, k.shape)
    assert slot_mapping.shape[0] >= num_tokens, (slot_mapping.shape, num_tokens)
    if num_tokens == 0:
        return
    # The kernel assumes unit stride on head_dim (vectorised loads); copy only in the rare other case.
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    assert kv_cache.stride(-1) == 1, "kv_cache head_dim must be contiguous"

    _store_kv_kernel[(num_tokens,)](
        k, v, kv_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        kv_cache.shape[2],
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=1 if num_kv_heads * head_dim <= 512 else 4,
    )
