"""Triton kernels of the LoRA delta: a gathered, segmented GEMM indexed by each token's slot.

The step's tokens that have an adapter are listed grouped by slot (`sorted_tokens`, one segment per
slot: `seg_starts`, `seg_slots`; built on the host with the step's layout, lora/ops.py). A program
takes a tile of up to BLOCK_M tokens of one segment and BLOCK_N output features, gathers the tokens'
rows of `x` and multiplies them with its slot's weights:

    shrink:  y[t, :]        = x[t, :] @ A[slot]^T            (A [S, R, in], y fp32 [T, R])
    expand:  out[t, n0:n1] += y[t, r0:r1] @ B[slot, n0:n1]^T  (B [S, out, R], added into the base output)

Shrink has a long K (the hidden size) and a short N (the rank): it splits K over SPLIT_K programs that
add their partials atomically into y (zeroed first). Tokens without an adapter are in no segment and
cost nothing. The torch definition of both is in lora/ops.py (also the CPU path).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _lora_segment_gemm(x_ptr, w_ptr, out_ptr, sorted_ptr, seg_start_ptr, seg_slot_ptr,
                       N, K, K_PER_SPLIT,
                       stride_xm, stride_xk, stride_ws, stride_wn, stride_wk, stride_om, stride_on,
                       ATOMIC: tl.constexpr, ADD: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    seg = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_nk = tl.program_id(2)
    num_n = tl.cdiv(N, BLOCK_N)
    pid_n = pid_nk % num_n
    pid_k = pid_nk // num_n
    start = tl.load(seg_start_ptr + seg)
    end = tl.load(seg_start_ptr + seg + 1)
    m0 = start + pid_m * BLOCK_M
    if m0 < end:
        slot = tl.load(seg_slot_ptr + seg).to(tl.int64)
        offs_m = m0 + tl.arange(0, BLOCK_M)
        mask_m = offs_m < end
        rows = tl.load(sorted_ptr + offs_m, mask=mask_m, other=0).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        k_begin = pid_k * K_PER_SPLIT
        w_base = w_ptr + slot * stride_ws
        for k0 in range(k_begin, k_begin + K_PER_SPLIT, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < K
            xt = tl.load(x_ptr + rows[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                         mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            wt = tl.load(w_base + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk,
                         mask=mask_k[:, None] & mask_n[None, :], other=0.0)
            acc += tl.dot(xt.to(wt.dtype), wt)
        ptrs = out_ptr + rows[:, None] * stride_om + offs_n[None, :] * stride_on
        mask = mask_m[:, None] & mask_n[None, :]
        if ATOMIC:
            tl.atomic_add(ptrs, acc, mask=mask)
        else:
            if ADD:
                acc += tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
            tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _launch(x, w, out, sorted_tokens, seg_starts, seg_slots, num_segs: int, max_seg_len: int,
            split_k: int, add: bool) -> None:
    N, K = w.shape[1], w.shape[2]
    BLOCK_M = 16 if max_seg_len <= 16 else (32 if max_seg_len <= 32 else 64)
    BLOCK_N = max(16, min(64, triton.next_power_of_2(N)))
    BLOCK_K = max(16, min(64, triton.next_power_of_2(K)))
    k_per_split = triton.cdiv(triton.cdiv(K, split_k), BLOCK_K) * BLOCK_K
    split_k = triton.cdiv(K, k_per_split)
    grid = (num_segs, triton.cdiv(max_seg_len, BLOCK_M), triton.cdiv(N, BLOCK_N) * split_k)
    _lora_segment_gemm[grid](x, w, out, sorted_tokens, seg_starts, seg_slots, N, K, k_per_split,
                             x.stride(0), x.stride(1), w.stride(0), w.stride(1), w.stride(2),
                             out.stride(0), out.stride(1), ATOMIC=split_k > 1, ADD=add,
                             BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, sorted_tokens, seg_starts, seg_slots,
                num_segs: int, max_seg_len: int) -> torch.Tensor:
    """y [T, R] fp32 = x @ A[slot]^T per token (zero rows for tokens without an adapter)."""
    y = torch.zeros(x.shape[0], lora_a.shape[1], dtype=torch.float32, device=x.device)
    # K split so that a step of few tokens still spreads over the GPU (the rank alone gives 1 tile).
    split_k = max(1, min(16, lora_a.shape[2] // 512))
    _launch(x, lora_a, y, sorted_tokens, seg_starts, seg_slots, num_segs, max_seg_len, split_k, add=True)
    return y


def lora_expand_(out: torch.Tensor, y: torch.Tensor, lora_b: torch.Tensor, sorted_tokens, seg_starts, seg_slots,
                 num_segs: int, max_seg_len: int) -> None:
    """out[t] += y[t] @ B[slot]^T per token with an adapter (out may be a column slice of a merged
    layer's output, y a column slice of the shrink's)."""
    _launch(y, lora_b, out, sorted_tokens, seg_starts, seg_slots, num_segs, max_seg_len, 1, add=True)
