"""FP8-weight GEMV for decode (1-2 tokens), W8A16: the activations stay bf16/fp16.

    out[m, n] = w_scale[n] * sum_k x[m, k] * float(w[n, k])  (+ bias[n]),  fp32 accumulation

w is float8_e4m3fn [N, K] (K contiguous, as checkpoints and online quantization store it), w_scale
one fp32 per output channel ([N] / [N, 1]) or per tensor ([] / [1]). Block-wise (128x128) scales
are not taken here (fp8_gemm.py's kernel handles them).

Why not fp8_gemm.py's tl.dot kernel at one token: it pads x to 16 rows, quantizes it per 128-group
inside the K loop and stages the weight tile through shared memory for the MMA; at one token that
reached ~2.05 TB/s of weights on the H100 (BENCHMARKS.md). Here nothing goes through shared memory:

- Each program streams a [BLOCK_N, BLOCK_K] weight tile per K step, born 3-D as
  [BLOCK_K // RUN, BLOCK_N, RUN] so that every thread holds whole RUN-byte runs of a row (one load
  per run) and a warp's lanes lie along one row's K, BLOCK_N * BLOCK_K / (RUN * 32 * num_warps)
  runs per thread and step.
- The bytes become fp32 by the hardware conversion (`.to(tl.float32)` of the float8e4nv tile:
  e4m3x2 -> f16x2, then f16 -> f32) and meet x in an FFMA chain per run (the in-thread sum
  over the last axis); one fp32 accumulator per run and row of x, reduced across the K lanes once,
  after the loop.
- x is loaded in the weight tile's own layout (the pointer tensor is broadcast to the tile's shape,
  so Triton's coalescing gives both the same RUN-values-per-thread layout, no layout conversion
  goes through shared memory, and each thread loads its x runs once for all its rows); it is read
  from L1/L2 (the whole x of a layer is <= 28 KiB).
- Loads in flight: several programs per SM (split-K, ~7 resident at 72 registers) and all of a
  step's loads issued before its arithmetic. PREFETCH (the next step's tile loaded into registers
  before this step's arithmetic) is a sweep option only: the carried fp8 tile costs ~2 byte
  shuffles per byte (PRMT/LOP3).
- Cost on sm_90 (SASS of the K loop, 16 x 512 tiles, 4 warps, 64 bytes per thread and step):
  212 instructions per 64 weight bytes at one token (per byte: 0.5 F2FP + 1 HADD2.F32 for the
  conversion, 1 FFMA, the rest loads and addresses), 299 at two; 72 / 96 registers, no spills.
- The weight scale is applied once per output, after the K sum (it does not vary along K).

The grid is N tiles x split-K slices, finished in the same launch by _split_k.py's counters (the
first call must be eager, before CUDA-graph capture). At most GEMV_MAX_ROWS rows of x. Any N and K
are taken, but a K that is not a multiple of 16 leaves the rows unaligned: byte loads, slow (the
sm_90 compile at two rows spills), so fp8_linear only routes K % 16 == 0 here.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.kernels.gemm._split_k import gemv_split_for, num_sms, split_k_buffers, split_k_epilogue  # noqa: F401
from splitserve.kernels.gemm.tiles import TileConfig, fp8_gemv_tiles

FP8_DTYPE = torch.float8_e4m3fn
GEMV_MAX_ROWS = 2  # rows of x one program holds (one accumulator set per row)
# K values of a weight row one thread loads at once: 8 bytes (LDG.64), the 16 bytes of their x in
# bf16/fp16 (LDG.128). With 16-byte weight runs x's load got a different layout (128 bits a load)
# and was converted through shared memory in every K step.
RUN = 8
_RUN_C = tl.constexpr(RUN)


@triton.jit
def _run_dot(w_f32, x_ptrs, x_mask, EVEN: tl.constexpr):
    """sum over each thread's RUN-value runs of w * x: [KV, BLOCK_N] fp32 (x broadcast over rows)."""
    if EVEN:
        x = tl.load(x_ptrs)
    else:
        x = tl.load(x_ptrs, mask=x_mask, other=0.0)
    return tl.sum(w_f32 * x.to(tl.float32), axis=2)


@triton.jit
def _fp8_gemv_kernel(
    x_ptr, w_ptr, ws_ptr, bias_ptr, out_ptr, part_ptr, count_ptr,
    M, N, K, k_per_split, num_splits, stride_xm, stride_wn, stride_om,
    PER_TENSOR: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_SPLIT_K: tl.constexpr, PREFETCH: tl.constexpr,
):
    KV: tl.constexpr = BLOCK_K // _RUN_C  # runs per weight row and K step
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # rows past N read row n % N again (no mask on the hot loads); the epilogue masks the store
    rows = (offs_n % N)[None, :, None]
    # K index of each tile element relative to the step's start, [KV, 1, RUN]: the runs axis first,
    # so that Triton's coalescing puts the lanes of a warp along K (one row's contiguous bytes)
    offs_k = tl.arange(0, KV)[:, None, None] * _RUN_C + tl.arange(0, _RUN_C)[None, None, :]
    k_start = pid_k * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)
    # int32 offsets: the launcher checks that w has fewer than 2**31 elements
    w_ptrs = w_ptr + rows * stride_wn + k_start + offs_k  # [KV, BLOCK_N, RUN]
    # x's pointers broadcast to the weight tile's shape: the same coalesced layout (a [KV, 1, RUN]
    # tile got its own and was converted through shared memory every step); the compiler loads each
    # thread's x run once for all its rows
    x_ptrs = tl.broadcast_to(x_ptr + k_start + offs_k, (KV, BLOCK_N, _RUN_C))
    acc0 = tl.zeros([KV, BLOCK_N], dtype=tl.float32)
    acc1 = tl.zeros([KV, BLOCK_N], dtype=tl.float32)
    if PREFETCH:
        if EVEN_K:
            w_next = tl.load(w_ptrs)
        else:
            w_next = tl.load(w_ptrs, mask=offs_k < k_end - k_start, other=0.0)
    for k0 in range(k_start, k_end, BLOCK_K):
        k_mask = offs_k < k_end - k0
        if PREFETCH:
            # the next step's tile is requested before this step's arithmetic (registers, not
            # shared memory), so the program keeps loads in flight while it computes
            w = w_next
            w_ptrs += BLOCK_K
            w_next = tl.load(w_ptrs, mask=offs_k < k_end - k0 - BLOCK_K, other=0.0)
        else:
            if EVEN_K:
                w = tl.load(w_ptrs)
            else:
                w = tl.load(w_ptrs, mask=k_mask, other=0.0)
            w_ptrs += BLOCK_K
        wf = w.to(tl.float32)
        acc0 += _run_dot(wf, x_ptrs, k_mask, EVEN_K)
        if BLOCK_M == 2:
            acc1 += _run_dot(wf, x_ptrs + stride_xm, k_mask, EVEN_K)
        x_ptrs += BLOCK_K
    if PER_TENSOR:
        scale = tl.load(ws_ptr)
    else:
        scale = tl.load(ws_ptr + offs_n % N)
    offs_m = tl.arange(0, BLOCK_M)
    out0 = tl.sum(acc0, axis=0) * scale
    out1 = tl.sum(acc1, axis=0) * scale
    acc = tl.where(offs_m[:, None] == 0, out0[None, :], out1[None, :])  # [BLOCK_M, BLOCK_N]
    split_k_epilogue(acc, offs_m, offs_n, M, N, out_ptr, stride_om, part_ptr, count_ptr, bias_ptr,
                     pid_n, pid_k, num_splits, HAS_BIAS, USE_SPLIT_K)


def check_fp8_gemv_call(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                        bias: torch.Tensor | None) -> tuple[int, int, int, bool]:
    """(M, K, N, per_tensor) of a valid call, else ValueError."""
    if x.dim() != 2 or w.dim() != 2:
        raise ValueError(f"x and w must be 2-D, got {tuple(x.shape)} and {tuple(w.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"fp8_gemv takes bf16/fp16 activations, got {x.dtype}")
    if w.dtype != FP8_DTYPE:
        raise ValueError(f"w must be {FP8_DTYPE}, got {w.dtype}")
    M, K = x.shape
    N = w.shape[0]
    if w.shape[1] != K:
        raise ValueError(f"x is [{M}, {K}] but w is {list(w.shape)}: K differs")
    if M > GEMV_MAX_ROWS:
        raise ValueError(f"fp8_gemv takes at most {GEMV_MAX_ROWS} rows, got {M}")
    if w_scale.numel() == 1:
        per_tensor = True
    elif w_scale.numel() == N and (w_scale.dim() == 1 or (w_scale.dim() == 2 and w_scale.shape[1] == 1)):
        per_tensor = False
    else:
        raise ValueError(f"fp8_gemv takes per-tensor or per-channel weight scales ([], [1], [{N}], [{N}, 1]), "
                         f"got {tuple(w_scale.shape)}")
    if bias is not None and bias.shape != (N,):
        raise ValueError(f"bias must have shape [{N}], got {tuple(bias.shape)}")
    if w.numel() >= 2**31:
        raise ValueError(f"w has {w.numel()} elements; the GEMV's int32 offsets need fewer than 2**31")
    return M, K, N, per_tensor


def fp8_gemv(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None,
             *, config: TileConfig | None = None) -> torch.Tensor:
    """x bf16/fp16 [M, K] (M <= GEMV_MAX_ROWS) @ (w * w_scale).T + bias -> [M, N] in x's dtype."""
    M, K, N, per_tensor = check_fp8_gemv_call(x, w, w_scale, bias)
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return out
    if K == 0:
        return out.zero_() if bias is None else out.copy_(bias.expand(M, N))
    cfg = config or fp8_gemv_tiles(M, N, K, num_sms(x.device))
    if cfg.block_k % RUN or cfg.block_k & (cfg.block_k - 1) or cfg.block_n & (cfg.block_n - 1) or cfg.split_k < 1:
        raise ValueError(f"block_k={cfg.block_k} must be a power of two >= {RUN}, block_n={cfg.block_n} a power "
                         f"of two and split_k={cfg.split_k} >= 1")
    x = x if x.stride(1) == 1 else x.contiguous()
    w = w if w.stride(1) == 1 else w.contiguous()
    # scales should already be fp32 and contiguous (then these are no-ops, not copies)
    ws = w_scale.reshape(-1).to(torch.float32).contiguous()
    num_tiles = triton.cdiv(N, cfg.block_n)
    k_per_split, num_splits, part, counters = split_k_buffers(K, cfg.split_k, cfg.block_k, num_tiles, out)
    _fp8_gemv_kernel[(num_tiles, num_splits)](
        x, w, ws, bias if bias is not None else out, out, part, counters,
        M, N, K, k_per_split, num_splits, x.stride(0), w.stride(0), out.stride(0),
        PER_TENSOR=per_tensor, HAS_BIAS=bias is not None, EVEN_K=K % cfg.block_k == 0,
        BLOCK_M=triton.next_power_of_2(M), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        USE_SPLIT_K=num_splits > 1, PREFETCH=cfg.prefetch, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out
