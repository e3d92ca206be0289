"""The fused MoE kernels (Triton) over the flat token stream, and the `splitserve::fused_moe` op.

A token with k routed experts is k token-expert *pairs*, numbered p = t * k + j. One call:

1. align (`align_pairs_by_expert`, one single-program launch): the pairs are sorted by expert and
   each expert's run is padded to a multiple of BLOCK_M, so every BLOCK_M-row block of the sorted
   list belongs to one expert (sorted_pairs [max_padded] with the sentinel T * k in padding slots,
   block_expert [max_blocks], num_padded [1]). Sizes depend only on T, k, E and BLOCK_M (never on
   the routing), and nothing reads the device back, so the op can be captured in a CUDA graph. At
   decode the weights take a few hundred microseconds to stream, so the ~20 launches of the same
   thing in torch ops (reference.align_pairs_ref) would cost a noticeable share.
2. grouped GEMM 1 (`_moe_gemm_kernel`, GATED): each program takes one block of pairs and a BLOCK_N
   slice of the intermediate features; it gathers the pairs' token rows of x and multiplies them by
   the block's expert's gate and up rows of w13 (two accumulators over the same x tile), then stores
   silu(gate) * up into act [T * k, I], row = pair id. The [T * k, 2I] gate/up product never reaches
   memory.
3. grouped GEMM 2 (same kernel, not gated): act rows x w2[e].T, scaled by the pair's routing
   weight, into pair_out [T * k, H].
4. the sum over each token's k pairs: pair_out.view(T, k, H).sum(1) (fp32 accumulation, one rounding).

Padding slots load a valid row (row 0) instead of masking the hot loads, and their stores are
masked; programs whose block lies past num_padded return at once (the grid is sized for the worst
routing). Weights are read as [BLOCK_K, BLOCK_N] tiles of the [N, K] (K contiguous) checkpoint
layout, so no transposed copy is kept.

Decode (few pairs) is bound by reading the active experts' weights: BLOCK_M = 16 (the smallest
MMA), wide BLOCK_K, deep pipelining. Prefill is bound by the MMAs: BLOCK_M 64 to 128 and a grouped
launch order so that programs sharing an expert's weight tiles run together and meet in L2.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from splitserve.kernels.moe.reference import check_moe_args, fused_moe_ref


@dataclass(frozen=True)
class GemmConfig:
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int = 8


@dataclass(frozen=True)
class MoeConfig:
    """Tile sizes of one fused_moe call: BLOCK_M is shared (it is the alignment of the sorted pairs)."""
    block_m: int
    up: GemmConfig      # GEMM 1 (gate and up, BLOCK_N per half)
    down: GemmConfig    # GEMM 2


def default_config(num_pairs: int, num_experts: int) -> MoeConfig:
    """Tiles by the expected rows per expert (pairs / experts). Starting points from the dense
    fused gate/up probe (BENCHMARKS.md) and decode kernels; benchmarks/moe_kernel.py --sweep checks
    them on the GPU."""
    rows_per_expert = num_pairs / max(num_experts, 1)
    if rows_per_expert <= 16:
        # weight-streaming: narrow N tiles so that even the down projection (N = H) has a few
        # hundred programs, long K tiles, deep pipeline
        return MoeConfig(16, GemmConfig(64, 128, 4, 4), GemmConfig(32, 256, 4, 4))
    if rows_per_expert <= 128:
        return MoeConfig(32, GemmConfig(64, 128, 4, 4, 4), GemmConfig(64, 128, 4, 4, 4))
    if rows_per_expert <= 512:
        return MoeConfig(64, GemmConfig(64, 64, 4, 4, 8), GemmConfig(128, 64, 4, 4, 8))
    return MoeConfig(128, GemmConfig(64, 64, 8, 4, 8), GemmConfig(128, 64, 8, 4, 8))


# ---------------------------------------------------------------------------------------------
# alignment
# ---------------------------------------------------------------------------------------------

def max_padded_pairs(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Worst-case length of the aligned pair list: every non-empty expert (at most min(E, pairs))
    pads its run by up to block_m - 1, rounded up to whole blocks."""
    worst = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return triton.cdiv(worst, block_m) * block_m


@triton.jit
def _align_kernel(ids_ptr, sorted_pairs_ptr, block_expert_ptr, num_padded_ptr, num_pairs, max_padded,
                  NUM_EXPERTS: tl.constexpr, E_P2: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr):
    # One program: the pair count is small next to the GEMMs' work, and one program needs no
    # cross-program prefix sum. Pairs are taken CHUNK at a time as a one-hot [CHUNK, experts] matrix.
    experts = tl.arange(0, E_P2)
    counts = tl.zeros([E_P2], dtype=tl.int32)
    for p0 in range(0, num_pairs, CHUNK):
        offs = p0 + tl.arange(0, CHUNK)
        e = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=E_P2)
        counts += tl.sum((e[:, None] == experts[None, :]).to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, axis=0)
    tl.store(num_padded_ptr, tl.sum(padded, axis=0))
    for s0 in range(0, max_padded, CHUNK):
        offs = s0 + tl.arange(0, CHUNK)
        tl.store(sorted_pairs_ptr + offs, tl.zeros([CHUNK], dtype=tl.int32) + num_pairs, mask=offs < max_padded)
    # block b belongs to the first expert whose padded run ends after b * BLOCK_M
    real = (experts < NUM_EXPERTS)[None, :]
    for b0 in range(0, max_padded // BLOCK_M, CHUNK):
        blocks = b0 + tl.arange(0, CHUNK)
        before = tl.sum(((padded_end[None, :] <= (blocks * BLOCK_M)[:, None]) & real).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + blocks, tl.minimum(before, NUM_EXPERTS - 1), mask=blocks < max_padded // BLOCK_M)
    # the sentinels above must land before the pairs below overwrite some of them
    tl.debug_barrier()
    next_slot = padded_end - padded
    for p0 in range(0, num_pairs, CHUNK):
        offs = p0 + tl.arange(0, CHUNK)
        e = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=E_P2)
        onehot = (e[:, None] == experts[None, :]).to(tl.int32)
        rank = tl.cumsum(onehot, axis=0) - onehot  # earlier pairs of the same expert in this chunk
        dest = tl.sum((next_slot[None, :] + rank) * onehot, axis=1)
        tl.store(sorted_pairs_ptr + dest, offs, mask=offs < num_pairs)
        next_slot += tl.sum(onehot, axis=0)


def align_pairs_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """topk_ids [T, k] -> (sorted_pairs int32 [max_padded], block_expert int32 [max_padded / block_m],
    num_padded int32 [1]); one launch, no host sync.

    sorted_pairs lists the pair ids expert by expert (ascending pair id within an expert), each
    expert's run starting at a multiple of block_m; the slots between runs and past the end hold
    the sentinel T * k. block_expert[b] is the expert of block b (meaningful for b * block_m <
    num_padded). reference.align_pairs_ref is the same in torch ops."""
    T, k = topk_ids.shape
    num_pairs = T * k
    max_padded = max_padded_pairs(num_pairs, num_experts, block_m)
    dev = topk_ids.device
    ids = topk_ids.reshape(-1)
    ids = ids if ids.dtype == torch.int32 and ids.is_contiguous() else ids.to(torch.int32).contiguous()
    sorted_pairs = torch.empty(max_padded, dtype=torch.int32, device=dev)
    block_expert = torch.empty(max_padded // block_m, dtype=torch.int32, device=dev)
    num_padded = torch.empty(1, dtype=torch.int32, device=dev)
    e_p2 = triton.next_power_of_2(num_experts)
    chunk = max(16, min(1024, 4096 // e_p2, triton.next_power_of_2(max(max_padded, 1))))
    _align_kernel[(1,)](ids, sorted_pairs, block_expert, num_padded, num_pairs, max_padded,
                        NUM_EXPERTS=num_experts, E_P2=e_p2, BLOCK_M=block_m, CHUNK=chunk, num_warps=4)
    return sorted_pairs, block_expert, num_padded


# ---------------------------------------------------------------------------------------------
# grouped GEMM
# ---------------------------------------------------------------------------------------------

@triton.jit
def _moe_gemm_kernel(
    a_ptr, w_ptr, out_ptr, topk_w_ptr, sorted_pairs_ptr, block_expert_ptr, num_padded_ptr,
    N, K, num_pairs, num_blocks,
    stride_am, stride_we, stride_wn, stride_om,
    ROWS_PER_A: tl.constexpr, GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr, EVEN_K: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    # out[p, n] = f(a[p // ROWS_PER_A] . w[e(p), n]) for the pairs p of one block, where GATED
    # reads the up row at n + N as well and f = silu(gate) * up; MUL_WEIGHT scales by topk_w[p].
    # K is contiguous in a and w (stride 1). fp32 operands multiply in full precision ("ieee"), as
    # the fp32 reference does, not in TF32.
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    # grouped order: GROUP_M consecutive blocks (mostly one expert) sweep the N tiles together, so a
    # weight tile is read from HBM once per group rather than once per block (an expert's weights,
    # 235 MB at the Mixtral shape, are far beyond L2: without it each block would re-read them)
    per_group = GROUP_M * num_pid_n
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum(num_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % size_m
    pid_n = (pid % per_group) // size_m
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pairs_ptr + offs_m)
    row_ok = pairs < num_pairs
    a_rows = tl.where(row_ok, pairs // ROWS_PER_A, 0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    w_rows = (offs_n % N).to(tl.int64)  # past N: a valid row again, masked at the store
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :]
    w_ptrs = w_ptr + expert * stride_we + w_rows[None, :] * stride_wn + offs_k[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if GATED:
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        up_off = N * stride_wn
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)
            w = tl.load(w_ptrs)
        else:
            k_ok = offs_k < K - k0
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None], other=0.0)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
        if GATED:
            if EVEN_K:
                w_up = tl.load(w_ptrs + up_off)
            else:
                w_up = tl.load(w_ptrs + up_off, mask=k_ok[:, None], other=0.0)
            acc_up = tl.dot(a, w_up, acc_up, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if GATED:
        acc = acc * tl.sigmoid(acc) * acc_up
    if MUL_WEIGHT:
        acc = acc * tl.load(topk_w_ptr + pairs, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    out_ptrs = out_ptr + pairs[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_n < N)[None, :])


def _grouped_gemm(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, topk_weights: torch.Tensor | None,
                  sorted_pairs: torch.Tensor, block_expert: torch.Tensor, num_padded: torch.Tensor,
                  num_pairs: int, rows_per_a: int, gated: bool, block_m: int, cfg: GemmConfig) -> None:
    N = out.shape[1]
    K = a.shape[1]
    num_blocks = block_expert.shape[0]
    grid = (num_blocks * triton.cdiv(N, cfg.block_n),)
    _moe_gemm_kernel[grid](
        a, w, out, topk_weights if topk_weights is not None else out, sorted_pairs, block_expert, num_padded,
        N, K, num_pairs, num_blocks,
        a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        ROWS_PER_A=rows_per_a, GATED=gated, MUL_WEIGHT=topk_weights is not None, EVEN_K=K % cfg.block_k == 0,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def fused_moe_triton(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor, config: MoeConfig | None = None) -> torch.Tensor:
    """The Triton path of fused_moe_ref (same arguments, same result up to accumulation order).

    topk_ids must lie in [0, E): they index the weight tensors on the device, unchecked (checking
    would read them back to the host)."""
    check_moe_args(x, w13, w2, topk_weights, topk_ids)
    T, k = topk_ids.shape
    E, two_i, H = w13.shape
    inter = two_i // 2
    if T == 0:
        return x.new_empty((0, H))
    x = x if x.stride(1) == 1 else x.contiguous()
    w13 = w13 if w13.stride(2) == 1 else w13.contiguous()
    w2 = w2 if w2.stride(2) == 1 else w2.contiguous()
    cfg = config or default_config(T * k, E)
    sorted_pairs, block_expert, num_padded = align_pairs_by_expert(topk_ids, E, cfg.block_m)
    act = torch.empty((T * k, inter), dtype=x.dtype, device=x.device)
    _grouped_gemm(x, w13, act, None, sorted_pairs, block_expert, num_padded, T * k, k, True, cfg.block_m, cfg.up)
    pair_out = torch.empty((T * k, H), dtype=x.dtype, device=x.device)
    flat_w = topk_weights.reshape(-1)
    flat_w = flat_w if flat_w.is_contiguous() else flat_w.contiguous()
    _grouped_gemm(act, w2, pair_out, flat_w, sorted_pairs, block_expert, num_padded, T * k, 1, False,
                  cfg.block_m, cfg.down)
    if k == 1:
        return pair_out
    # one reduction kernel: torch accumulates 16-bit inputs in fp32 and rounds once
    return pair_out.view(T, k, H).sum(dim=1)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
    """The routed experts' output [T, H]: the Triton kernels on CUDA, the torch reference elsewhere."""
    if x.is_cuda:
        return fused_moe_triton(x, w13, w2, topk_weights, topk_ids)
    return fused_moe_ref(x, w13, w2, topk_weights, topk_ids)
