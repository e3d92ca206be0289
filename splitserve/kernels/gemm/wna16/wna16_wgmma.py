"""W4A16 / W8A16 GEMM for many tokens on Hopper, written in Gluon so the tensor-core MMA stays
asynchronous while the next weight tile is dequantized.

Same function and numerics as wna16_tiled.py (the weight dequantized to the dequantize kernel's bits,
acc = x @ w accumulated by wgmma only). What Triton's own pipeliner would not do there: a dequantized
tile written to shared memory inside the loop is not an operand it lets a wgmma run asynchronously
on, so every K tile waited for its MMA before the next tile's unpacking began. Here, per K tile i:

    wait for tile i's cp.async group; barrier     (all copies landed; every wgmma <= i-2 finished)
    issue the cp.async of tile i + STAGES - 2 into the stage tile i - 2 used
    words (shared) -> registers -> dequantize -> B buffer i % 2 (shared, K contiguous)
    fence (generic -> async proxy); barrier
    wgmma i on (x stage, B buffer) asynchronously; wait until <= 1 wgmma is in flight (wgmma i-1)

so wgmma i runs while the warps unpack tile i + 1 into the other B buffer. x and the packed words
come through a STAGES-deep cp.async ring; scales and zero points are register loads two K tiles
ahead. Split-K in one launch (_split_k.py's counters) where the output tiles would leave SMs idle
(o and down at 128-256 tokens: 32-64 tiles of 128x128 for 132 SMs). Hopper only (wgmma); not
runnable by the Triton interpreter: the GPU check of benchmarks/wna16_tiled.py is its test.
"""
from __future__ import annotations


import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

from splitserve.kernels.gemm._split_k import num_sms, split_k_buffers, split_k_for
from splitserve.kernels.gemm.tiles import TileConfig, wna16_wgmma_tiles
from splitserve.kernels.gemm.wna16.dequant import F32_MAGIC_BITS as _F32_MAGIC_BITS
from splitserve.kernels.gemm.wna16.dequant import dequant_tile_t as _dequant_tile_t
from splitserve.kernels.gemm.wna16.wna16_layout import check_wna16_call


@gluon.constexpr_function
def _dequant_layout(block_n, kw, num_warps):
    """[BLOCK_N, BLOCK_K // P] words: a thread holds whole words of one column (its values become
    contiguous K in registers), consecutive lanes take consecutive columns (conflict-free reads of
    the N-contiguous words in shared memory); warps past BLOCK_N // 32 split the words."""
    warps_n = min(num_warps, max(1, block_n // 32))
    warps_k = num_warps // warps_n
    return gl.BlockedLayout([1, max(1, kw // warps_k)], [32, 1], [warps_n, warps_k], [1, 0])


@gluon.constexpr_function
def _copy_layout(rows, cols, elems, num_warps):
    """cp.async layout for a [rows, cols] tile, `elems` contiguous elements (16 bytes) per thread."""
    tc = min(32, max(1, cols // elems))
    return gl.BlockedLayout([1, elems], [32 // tc, tc], [num_warps, 1], [1, 0])


@gluon.jit
def _issue_tile(t, kt0, x_smem, w_smem, a_ptr, qw_ptr, rows_x, ks_x, kw_w, cols_w, stride_am, N,
                P: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr):
    """cp.async of the program's K tile t (global tile kt0 + t: x [BLOCK_M, BLOCK_K] and words
    [BLOCK_K // P, BLOCK_N]) into stage t % STAGES."""
    st = t % STAGES
    k0 = (kt0 + t) * BLOCK_K
    async_copy.async_copy_global_to_shared(x_smem.index(st), a_ptr + rows_x[:, None] * stride_am + (k0 + ks_x)[None, :])
    async_copy.async_copy_global_to_shared(w_smem.index(st), qw_ptr + (k0 // P + kw_w)[:, None].to(gl.int64) * N
                                           + cols_w[None, :], mask=(cols_w < N)[None, :])


# M changes every step, the split with M and the shape: one compile for all of them (Triton would
# specialize each on == 1 and % 16)
@gluon.jit(do_not_specialize=["M", "tiles_per_split", "num_splits"])
def _wna16_wgmma_kernel(
    a_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, part_ptr, count_ptr, M, N, K, stride_am, stride_om,
    magic, tiles_per_split, num_splits,
    BITS: gl.constexpr, GROUP: gl.constexpr, HAS_ZERO: gl.constexpr, HAS_BIAS: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
    USE_SPLIT_K: gl.constexpr, num_warps: gl.constexpr,
):
    P: gl.constexpr = 32 // BITS
    KW: gl.constexpr = BLOCK_K // P
    ZERO_SYM: gl.constexpr = 1 << (BITS - 1)
    dtype: gl.constexpr = a_ptr.dtype.element_ty
    x_copy: gl.constexpr = _copy_layout(BLOCK_M, BLOCK_K, 8, num_warps)
    w_copy: gl.constexpr = _copy_layout(KW, BLOCK_N, 4, num_warps)
    deq: gl.constexpr = _dequant_layout(BLOCK_N, KW, num_warps)
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, BLOCK_N, 16])
    x_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_K],
                                       gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], dtype))
    w_smem = gl.allocate_shared_memory(gl.int32, [STAGES, KW, BLOCK_N], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    b_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_K],
                                       gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_K], dtype))

    pid = gl.program_id(0)
    num_pid_m = gl.cdiv(M, BLOCK_M)
    pid_m = pid % num_pid_m   # M tiles fastest: programs running together share the weight tile in L2
    pid_n = pid // num_pid_m
    rows_x = ((pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, x_copy))) % M).to(gl.int64)
    ks_x = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, x_copy))
    kw_w = gl.arange(0, KW, layout=gl.SliceLayout(1, w_copy))
    cols_w = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, w_copy))  # masked past N
    cols = (pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, deq))) % N
    # this program's K tiles: [kt0, kt0 + num_k) (split-K: slice pid_k of num_splits)
    pid_k = gl.program_id(1)
    kt0 = pid_k * tiles_per_split
    num_k = gl.minimum(K // BLOCK_K - kt0, tiles_per_split)
    num_groups = K // GROUP

    for t0 in gl.static_range(STAGES - 2):
        if t0 < num_k:
            _issue_tile(t0, kt0, x_smem, w_smem, a_ptr, qw_ptr, rows_x, ks_x, kw_w, cols_w, stride_am, N, P,
                        BLOCK_K, STAGES)
        async_copy.commit_group()

    g0 = (kt0 * BLOCK_K) // GROUP
    s_cur = gl.load(s_ptr + g0 * N + cols).to(gl.float32)
    s_nxt = gl.load(s_ptr + gl.minimum(((kt0 + 1) * BLOCK_K) // GROUP, num_groups - 1) * N + cols).to(gl.float32)
    if HAS_ZERO:
        z_cur = gl.load(z_ptr + g0 * N + cols).to(gl.float32)
        z_nxt = gl.load(z_ptr + gl.minimum(((kt0 + 1) * BLOCK_K) // GROUP, num_groups - 1) * N + cols).to(gl.float32)
    else:
        z_cur = gl.full([BLOCK_N], ZERO_SYM, gl.float32, layout=gl.SliceLayout(1, deq))
        z_nxt = z_cur
    acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=acc_layout)
    for i in range(num_k):
        async_copy.wait_group(STAGES - 3)
        gl.thread_barrier()
        t = i + STAGES - 2
        if t < num_k:
            _issue_tile(t, kt0, x_smem, w_smem, a_ptr, qw_ptr, rows_x, ks_x, kw_w, cols_w, stride_am, N, P,
                        BLOCK_K, STAGES)
        async_copy.commit_group()  # possibly empty: keeps one group per iteration for wait_group's count
        g_pf = gl.minimum(((kt0 + i + 2) * BLOCK_K) // GROUP, num_groups - 1)
        s_pf = gl.load(s_ptr + g_pf * N + cols).to(gl.float32)
        if HAS_ZERO:
            z_pf = gl.load(z_ptr + g_pf * N + cols).to(gl.float32)
        else:
            z_pf = z_cur
        words = w_smem.index(i % STAGES).permute((1, 0)).load(deq).to(gl.uint32, bitcast=True)
        w_t = _dequant_tile_t(words, s_cur[:, None], z_cur[:, None], magic, BITS, dtype)
        b_buf = b_smem.index(i % 2)
        b_buf.store(w_t)
        fence_async_shared()
        gl.thread_barrier()
        acc = warpgroup_mma(x_smem.index(i % STAGES), b_buf.permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
        s_cur, s_nxt = s_nxt, s_pf
        z_cur, z_nxt = z_nxt, z_pf
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    async_copy.wait_group(0)

    out_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // min(32, BLOCK_N // 8), min(32, BLOCK_N // 8)],
                                                [num_warps, 1], [1, 0])
    res = gl.convert_layout(acc, out_layout)
    offs_m = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, out_layout))
    offs_n = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, out_layout))
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if USE_SPLIT_K:
        # _split_k.py's protocol: fp32 partial to part[pid_k], count the arrivals per output tile;
        # the last program of the tile sums the partials, writes out and re-arms the counter.
        part_offs = offs_m[:, None] * N + offs_n[None, :]
        gl.store(part_ptr + pid_k * M * N + part_offs, res, mask=mask)
        gl.thread_barrier()  # every thread's partial stored before the (acq_rel, GPU scope) atomic
        arrived = gl.atomic_add(count_ptr + pid, 1)
        if arrived == num_splits - 1:
            total = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=out_layout)
            for sk in range(0, num_splits):
                total += gl.load(part_ptr + sk * M * N + part_offs, mask=mask, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                total = total + gl.load(bias_ptr + offs_n % N).to(gl.float32)[None, :]
            gl.store(out_ptr + offs_m.to(gl.int64)[:, None] * stride_om + offs_n[None, :],
                     total.to(out_ptr.dtype.element_ty), mask=mask)
            gl.atomic_xchg(count_ptr + pid, 0)
    else:
        if HAS_BIAS:
            res = res + gl.load(bias_ptr + offs_n % N).to(gl.float32)[None, :]
        gl.store(out_ptr + offs_m.to(gl.int64)[:, None] * stride_om + offs_n[None, :],
                 res.to(out_ptr.dtype.element_ty), mask=mask)


def wna16_wgmma_supported(x: torch.Tensor, N: int, group_size: int) -> bool:
    """Whether wna16_wgmma_gemm takes this call: a Hopper GPU (wgmma), 16-byte aligned rows for
    cp.async (x's row stride a multiple of 8 elements, N of 4 words), groups of whole 32-K tiles."""
    return (x.is_cuda and torch.cuda.get_device_capability(x.device)[0] == 9 and x.stride(0) % 8 == 0
            and x.stride(1) == 1 and N % 4 == 0 and group_size % 32 == 0)


def wna16_wgmma_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                     *, bits: int, group_size: int, bias: torch.Tensor | None = None,
                     config: TileConfig | None = None) -> torch.Tensor:
    """x bf16/fp16 [M, K] times the canonical weight -> [M, N] in x's dtype (no act-order)."""
    M, K, N = check_wna16_call(x, qweight, scales, zeros, bits, group_size, None, bias)
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return out
    x = x if x.stride(1) == 1 else x.contiguous()
    cfg = config or wna16_wgmma_tiles(M, N, K, group_size)
    if group_size % cfg.block_k or cfg.block_k % 32 or cfg.num_stages < 3:
        raise ValueError(f"block_k={cfg.block_k} must be a multiple of 32 dividing group_size={group_size}")
    if N % 4 or x.stride(0) % 8:
        raise ValueError("N must be a multiple of 4 and x's rows 16-byte aligned (cp.async)")
    num_tiles = triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n)
    split = cfg.split_k or split_k_for(M, N, K, cfg.block_m, cfg.block_n, cfg.block_k, num_sms(x.device),
                                       cfg.programs_per_sm)
    k_per_split, num_splits, part, counters = split_k_buffers(K, split, cfg.block_k, num_tiles, out)
    _wna16_wgmma_kernel[(num_tiles, num_splits)](
        x, qweight, scales, zeros if zeros is not None else out, bias if bias is not None else out, out,
        part, counters, M, N, K, x.stride(0), out.stride(0), _F32_MAGIC_BITS, k_per_split // cfg.block_k,
        num_splits, BITS=bits, GROUP=group_size, HAS_ZERO=zeros is not None, HAS_BIAS=bias is not None,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, STAGES=cfg.num_stages,
        USE_SPLIT_K=num_splits > 1, num_warps=cfg.num_warps)
    return out
