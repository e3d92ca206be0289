"""Split-K in one launch, shared by the FP8 and the WNA16 GEMM kernels.

A few-token GEMM has too few output tiles to occupy every SM, so the K dimension is cut into SPLIT_K
slices, one program each. Rather than a second "reduce" launch (a few microseconds each, paid ~128
times per decode step), the programs of one output tile meet through a counter: each writes its fp32
partial to a workspace, then bumps the tile's counter; the program that sees the count reach
SPLIT_K - 1 is the last one, sums the partials, applies the epilogue (bias, dtype) and writes the
output, and sets the counter back to 0, so the next launch (or CUDA-graph replay) finds it zeroed.

The counters live in one persistent int32 buffer per device, allocated outside graph capture (the
first, eager call of a kernel does that). Kernels that use it must not run concurrently on two
streams: their tiles would share counters.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_SPLIT_K_TILES = 1 << 16
_COUNTERS: dict[tuple[str, int | None], torch.Tensor] = {}


def split_k_counters(device: torch.device, num_tiles: int) -> torch.Tensor:
    """The device's zeroed, self-resetting tile counters (at least num_tiles of them)."""
    if num_tiles > MAX_SPLIT_K_TILES:
        raise ValueError(f"split-K over {num_tiles} output tiles exceeds {MAX_SPLIT_K_TILES}; use SPLIT_K=1")
    key = (device.type, device.index)
    buf = _COUNTERS.get(key)
    if buf is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("split-K counters are first allocated during CUDA-graph capture; run the "
                               "quantized GEMM once eagerly before capturing")
        buf = torch.zeros(MAX_SPLIT_K_TILES, dtype=torch.int32, device=device)
        _COUNTERS[key] = buf
    return buf


def split_k_buffers(K: int, split_k: int, block_k: int, num_tiles: int,
                    out: torch.Tensor) -> tuple[int, int, torch.Tensor, torch.Tensor]:
    """(k_per_split, num_splits, part, counters) of a launch over K cut into split_k slices of whole
    block_k tiles: the fp32 partials [num_splits, M, N] and the tile counters when K is split, else
    `out` in both places (the kernel never touches them)."""
    k_per_split = triton.cdiv(triton.cdiv(K, split_k), block_k) * block_k
    num_splits = triton.cdiv(K, k_per_split)
    if num_splits == 1:
        return k_per_split, 1, out, out
    part = torch.empty((num_splits, *out.shape), dtype=torch.float32, device=out.device)
    return k_per_split, num_splits, part, split_k_counters(out.device, num_tiles)


_SM_COUNT: dict[int | None, int] = {}


def num_sms(device: torch.device) -> int:
    """Multiprocessors of the device (132 off CUDA, the H100's, so CPU tests pick the same tiles)."""
    if device.type != "cuda":
        return 132
    if device.index not in _SM_COUNT:
        _SM_COUNT[device.index] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SM_COUNT[device.index]


def split_k_for(M: int, N: int, K: int, block_m: int, block_n: int, block_k: int, num_sms: int,
                programs_per_sm: float = 1.5) -> int:
    """Smallest power-of-two split giving programs_per_sm programs per SM, keeping >= 4 K tiles per
    split (the H100 sweep's best splits on the 8B shapes follow this rule: 1.5 for the FP8 kernel,
    2.9 for the WNA16 kernel at 16-row tiles)."""
    tiles = triton.cdiv(M, block_m) * triton.cdiv(N, block_n)
    k_tiles = triton.cdiv(K, block_k)
    split = 1
    while tiles * split < programs_per_sm * num_sms and split * 2 <= max(1, k_tiles // 4):
        split *= 2
    return split


@triton.jit
def split_k_epilogue(acc, offs_m, offs_n, M, N, out_ptr, stride_om, part_ptr, count_ptr, bias_ptr,
                     tile_id, pid_k, num_splits, HAS_BIAS: tl.constexpr, USE_SPLIT_K: tl.constexpr):
    """Write acc (fp32 [BLOCK_M, BLOCK_N], scales already applied) to out, adding the bias once.

    With USE_SPLIT_K, acc is one K slice's partial: it goes to part[pid_k, M, N] (fp32) and the last
    program of the tile to arrive sums all num_splits partials and writes out."""
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if USE_SPLIT_K:
        part_offs = offs_m[:, None] * N + offs_n[None, :]
        tl.store(part_ptr + pid_k * M * N + part_offs, acc, mask=mask)
        # Every thread's partial must be stored before the counter moves (the atomic is acq_rel at
        # GPU scope, and the barrier orders the other threads' stores before it).
        tl.debug_barrier()
        arrived = tl.atomic_add(count_ptr + tile_id, 1)
        if arrived == num_splits - 1:
            total = tl.zeros(acc.shape, dtype=tl.float32)
            for s in range(0, num_splits):
                # .cg: read through L2, never a stale L1 line
                total += tl.load(part_ptr + s * M * N + part_offs, mask=mask, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                total += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
            tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :],
                     total.to(out_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(count_ptr + tile_id, 0)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=mask)


def gemv_split_for(N: int, K: int, block_n: int, block_k: int, num_sms: int, programs_per_sm: float = 4.0,
                   min_k_tiles: int = 2) -> int:
    """Smallest power-of-two split giving programs_per_sm programs per SM (several resident per SM
    keep enough loads in flight), keeping >= min_k_tiles K tiles per split."""
    tiles = triton.cdiv(N, block_n)
    k_tiles = triton.cdiv(K, block_k)
    split = 1
    while tiles * split < programs_per_sm * num_sms and split * 2 <= max(1, k_tiles // min_k_tiles):
        split *= 2
    return split
