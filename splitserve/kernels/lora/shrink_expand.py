"""Triton kernels of the LoRA delta: a gathered GEMM over tiles of tokens that share a slot.

The step's layout (kernels/lora/lora_add.py) lists the tokens that have an adapter grouped by slot, each group
padded to whole tiles of `tile` entries (kernels/lora/lora_add.py TILE) (-1: no token). A program takes one tile and a block of
output features, gathers its tokens' rows and multiplies them with its slot's weights:

    shrink:  y[p, :] = sum_k x[row(p), K-part k] @ A[slot]^T[K-part k]   (A [S, shards*R, in]; y fp32)
    expand:  out[row(p), cols] += y[p, shard's R] @ B[slot, cols]^T          (B [S, out, R])

Both grids are fixed by the padded token count (and the weights' shapes): (output blocks, the most
tiles that many tokens can need). Programs whose tile is past the step's `num_tiles` (read on the
device) return at once, so CUDA graphs capture the launches and replay them with any layout.

Shrink has a long K (the hidden size) and a short N (the rank): K is split over SPLIT_K programs,
which write their fp32 partials apart; the last of them to finish (an atomic counter per block,
re-armed to zero by that program) sums the partials in a fixed order into y, so the result does not
depend on which finished last (the same sums in the same order for a token whatever else the step
holds), and expand reads y once. Expand multiplies on tensor cores in tf32 for bf16 / fp16 weights
(y rounded to a 10-bit mantissa, against bf16's 7 that peft's layers round it to in that dtype; fp32
weights multiply in IEEE fp32) with fp32 accumulation, and adds into the output with one rounding.
A merged layer's shards (q/k/v, gate/up) are one launch, each program inside one shard. The torch
definition of both is in kernels/lora/lora_add.py (also the CPU path). On the H100 at 8B shapes (benchmarks/lora_kernel_sweep.py,
BENCHMARKS.md) the summing program and the tensor-core expand cut the delta of a 256-token step from
3.1 to ~1.5 ms: expand had been bound by its fp32 FMAs, not by memory.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


_NO_SHARD = 1 << 30  # first program of a shard that does not exist


@triton.jit
def _lora_shrink_kernel(x_ptr, a_ptr, part_ptr, y_ptr, counter_ptr, num_tiles_ptr, tile_slots_ptr, token_rows_ptr,
                        N, K, K_PER_SPLIT, stride_xm, stride_as, stride_an, stride_ps, stride_pm,
                        SPLIT_K: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr):
    pid_nk = tl.program_id(0)
    tile = tl.program_id(1)
    if tile < tl.load(num_tiles_ptr):
        num_n = tl.cdiv(N, BLOCK_N)
        pid_n = pid_nk % num_n
        pid_k = pid_nk // num_n
        slot = tl.load(tile_slots_ptr + tile).to(tl.int64)
        offs_p = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        rows = tl.load(token_rows_ptr + offs_p)
        mask_m = rows >= 0
        rows = tl.where(mask_m, rows, 0).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        k_begin = pid_k * K_PER_SPLIT
        a_base = a_ptr + slot * stride_as
        for k0 in range(k_begin, k_begin + K_PER_SPLIT, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < K
            xt = tl.load(x_ptr + rows[:, None] * stride_xm + offs_k[None, :],
                         mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            at = tl.load(a_base + offs_n[None, :] * stride_an + offs_k[:, None],
                         mask=mask_k[:, None] & mask_n[None, :], other=0.0)
            if IEEE:
                acc += tl.dot(xt, at, input_precision="ieee")
            else:
                acc += tl.dot(xt, at)
        block = offs_p[:, None] * stride_pm + offs_n[None, :]
        tl.store(part_ptr + pid_k * stride_ps + block, acc, mask=mask_n[None, :])
        if SPLIT_K > 1:
            # The last of the block's K parts to finish sums all of them, in order k = 0, 1, ...
            # (the same sums whichever finished last), into y, and re-arms the counter for the next
            # launch. The acq_rel atomic orders the other parts' stores before these loads.
            counter = counter_ptr + tile * num_n + pid_n
            if tl.atomic_add(counter, 1, sem="acq_rel") == SPLIT_K - 1:
                y = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for k in tl.static_range(SPLIT_K):  # unrolled: the loads go out together
                    y += tl.load(part_ptr + k * stride_ps + block, mask=mask_n[None, :], other=0.0,
                                 cache_modifier=".cg")
                tl.store(y_ptr + block, y, mask=mask_n[None, :])
                tl.atomic_xchg(counter, 0)


@triton.jit
def _lora_expand_kernel(part_ptr, b_ptr, out_ptr, num_tiles_ptr, tile_slots_ptr, token_rows_ptr,
                        N0, N1, N2, P1, P2, N_ITERS, SPLIT_K, stride_ps, stride_pm, stride_bs, stride_bn,
                        stride_om, RANK: tl.constexpr, R_PAD: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT: tl.constexpr):
    pid = tl.program_id(0)
    tile = tl.program_id(1)
    if tile < tl.load(num_tiles_ptr):
        # which shard this program writes: programs [0, P1) shard 0, [P1, P2) shard 1, [P2, ...) shard 2
        shard = (pid >= P1).to(tl.int32) + (pid >= P2).to(tl.int32)
        first = tl.where(shard == 0, 0, tl.where(shard == 1, P1, P2))
        col0 = tl.where(shard == 0, 0, tl.where(shard == 1, N0, N0 + N1))
        n_size = tl.where(shard == 0, N0, tl.where(shard == 1, N1, N2))
        n_start = (pid - first) * (BLOCK_N * N_ITERS)
        slot = tl.load(tile_slots_ptr + tile).to(tl.int64)
        offs_p = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        rows = tl.load(token_rows_ptr + offs_p)
        mask_m = rows >= 0
        rows = tl.where(mask_m, rows, 0).to(tl.int64)
        offs_r = tl.arange(0, R_PAD)
        mask_r = offs_r < RANK
        y = tl.zeros((BLOCK_M, R_PAD), dtype=tl.float32)
        for k in range(SPLIT_K):  # a runtime count: one compiled variant for every split
            y += tl.load(part_ptr + k * stride_ps + offs_p[:, None] * stride_pm + (shard * RANK + offs_r)[None, :],
                         mask=mask_r[None, :], other=0.0)
        b_base = b_ptr + slot * stride_bs
        for it in range(N_ITERS):
            offs_n = n_start + it * BLOCK_N + tl.arange(0, BLOCK_N)
            mask_n = offs_n < n_size
            cols = col0 + offs_n
            bt = tl.load(b_base + cols[None, :] * stride_bn + offs_r[:, None],
                         mask=mask_r[:, None] & mask_n[None, :], other=0.0)
            if DOT == "low":  # y rounded to the weights' dtype, tensor cores (fp32 accumulation)
                delta = tl.dot(y.to(bt.dtype), bt)
            else:  # "tf32": y rounded to tf32 (10-bit mantissa), tensor cores; "ieee": fp32 FMAs
                delta = tl.dot(y, bt.to(tl.float32), input_precision=DOT)
            ptrs = out_ptr + rows[:, None] * stride_om + cols[None, :]
            mask = mask_m[:, None] & mask_n[None, :]
            cur = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
            tl.store(ptrs, (cur + delta).to(out_ptr.dtype.element_ty), mask=mask)


def shrink_split(K: int, grid_tiles: int) -> int:
    """K parts of the shrink: its rank gives one output block per tile, so without a split a step
    has one program per 16 tokens; parts of 512 (8 for the 8B's 4096, 16 for its 14336) keep the GPU
    busy (benchmarks/lora_kernel_sweep.py on the H100: 8-16 parts fastest at 32 and 256 tokens). Large
    steps take fewer, as their partials' round trip grows with the tokens while x's read does not."""
    return max(1, min(16, K // 512, 4096 // grid_tiles))


_counters: dict[torch.device, torch.Tensor] = {}


def split_counters(device: torch.device, n: int) -> torch.Tensor:
    """Zeroed int32 counters, one per (tile, output block) of a shrink launch: each launch leaves them
    at zero again, so every launch (and every op of a step, one after the other on the stream) shares
    one buffer, allocated once outside graph capture (the first call is always an eager warm-up)."""
    buf = _counters.get(device)
    if buf is None or buf.numel() < n:
        buf = torch.zeros(max(n, 1 << 14), dtype=torch.int32, device=device)
        _counters[device] = buf
    return buf


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, num_tiles: torch.Tensor, tile_slots: torch.Tensor,
                token_rows: torch.Tensor, grid_tiles: int, tile: int, split_k: int | None = None,
                block_k: int = 256, num_warps: int = 4) -> torch.Tensor:
    """y = x A[slot]^T by layout entry, fp32, as [1, grid_tiles * tile, N] (rows of unused entries are
    left unwritten). K is split over split_k programs whose partials the last of them sums.
    split_k / block_k / num_warps: launch choices (benchmarks/lora_kernel_sweep.py sweeps them)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    N, K = lora_a.shape[1], lora_a.shape[2]
    split_k = shrink_split(K, grid_tiles) if split_k is None else split_k
    BLOCK_N = max(16, min(64, triton.next_power_of_2(N)))
    BLOCK_K = max(16, min(block_k, triton.next_power_of_2(K)))
    k_per_split = triton.cdiv(triton.cdiv(K, split_k), BLOCK_K) * BLOCK_K
    split_k = triton.cdiv(K, k_per_split)
    # parts 0..split_k-1, then y (with one part, the part is y)
    part = torch.empty(split_k + (split_k > 1), grid_tiles * tile, N, dtype=torch.float32, device=x.device)
    num_n = triton.cdiv(N, BLOCK_N)
    counters = split_counters(x.device, grid_tiles * num_n) if split_k > 1 else part
    grid = (num_n * split_k, grid_tiles)
    _lora_shrink_kernel[grid](x, lora_a, part, part[-1], counters, num_tiles, tile_slots, token_rows, N, K,
                              k_per_split, x.stride(0), lora_a.stride(0), lora_a.stride(1),
                              part.stride(0), part.stride(1), SPLIT_K=split_k, IEEE=x.dtype == torch.float32, BLOCK_M=tile,
                              BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=num_warps)
    return part[-1:]


def lora_expand_(out: torch.Tensor, part: torch.Tensor, lora_b: torch.Tensor, num_tiles: torch.Tensor,
                 tile_slots: torch.Tensor, token_rows: torch.Tensor, grid_tiles: int, shard_sizes: list[int],
                 rank: int, tile: int, block_n: int = 256, n_iters: int = 1, num_warps: int = 4,
                 dot: str = "tf32") -> None:
    """out[row] += y[row] @ B[slot]^T per token with an adapter, every shard of a merged layer in one
    launch (shard i reads y's columns [i*rank, (i+1)*rank) and writes its own output columns).
    block_n / n_iters (column blocks per program) / num_warps: launch choices (benchmarks sweep them).
    dot: how y @ B^T multiplies for bf16/fp16 weights: "tf32" (y rounded to tf32, tensor cores),
    "low" (y rounded to the weights' dtype), "ieee" (fp32 FMAs); fp32 weights always "ieee"."""
    if len(shard_sizes) > 3:
        raise ValueError(f"at most 3 merged shards, got {len(shard_sizes)}")
    assert out.stride(-1) == 1 and lora_b.stride(-1) == 1, "out and lora_b need contiguous rows"
    BLOCK_N = block_n
    split_k = part.shape[0]
    per_program = BLOCK_N * n_iters
    programs = [triton.cdiv(n, per_program) for n in shard_sizes]
    sizes = list(shard_sizes) + [0] * (3 - len(shard_sizes))
    p1 = programs[0] if len(programs) > 1 else _NO_SHARD
    p2 = programs[0] + programs[1] if len(programs) > 2 else _NO_SHARD
    grid = (sum(programs), grid_tiles)
    _lora_expand_kernel[grid](part, lora_b, out, num_tiles, tile_slots, token_rows, sizes[0], sizes[1], sizes[2],
                              p1, p2, n_iters, split_k, part.stride(0), part.stride(1), lora_b.stride(0),
                              lora_b.stride(1), out.stride(0), RANK=rank, R_PAD=max(16, triton.next_power_of_2(rank)),
                              BLOCK_M=tile, BLOCK_N=BLOCK_N, DOT="ieee" if lora_b.dtype == torch.float32 else dot,
                              num_warps=num_warps)
