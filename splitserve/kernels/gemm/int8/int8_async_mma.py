"""The W8A8 INT8 GEMM of int8_gemm.py with asynchronous MMAs: a Gluon kernel (Hopper only).

int8_gemm() calls launch_async_mma for configurations with async_mma on compute capability 9.x; same
contract and epilogue as the Triton kernels there (both scales, bias and the cast applied before
the single store, or the raw int32 accumulator). In a module of its own so that the experimental
Gluon API (triton.experimental.gluon, Triton 3.6) is imported only where the kernel runs.
"""
from __future__ import annotations

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait


# The async-MMA kernel is written in Gluon (Triton's explicit-layout dialect, in Triton 3.6 as
# triton.experimental.gluon): Triton's pipeliner makes a wgmma asynchronous only for fp32
# accumulators ("Rule 2.1" in WGMMAPipeline.cpp), so every int32 tl.dot above is followed by a
# wait for its own MMAs and the tensor cores idle while each K step drains and the next is issued.
# Here the wait leaves one K tile's MMAs in flight: while the warps wait for K tile i - 1 (whose
# buffers the next TMA load then reuses), the MMAs of K tile i are already queued.

@triton.constexpr_function
def _warps_along_m(block_m, num_warps):
    # A warpgroup (4 warps) covers 64 rows with m16 instructions; further warps go along M while
    # the tile has rows for them (16 a warp), then along N.
    warps_m = 4
    while warps_m * 2 <= num_warps and warps_m * 2 * 16 <= block_m:
        warps_m *= 2
    return warps_m


@triton.constexpr_function
def _wgmma_warps(block_m, num_warps):
    warps_m = _warps_along_m(block_m, num_warps)
    return [warps_m, num_warps // warps_m]


@triton.constexpr_function
def _wgmma_instr_n(block_m, block_n, num_warps):
    # the widest wgmma N that divides one warp column's share of the tile, a multiple of 16 up to
    # 128 (N values every int8 wgmma allows; Triton's own tl.dot picks 128 here too)
    per_warp = block_n // (num_warps // _warps_along_m(block_m, num_warps))
    n = 128
    while n > per_warp or per_warp % n:
        n -= 16
    return n


@gluon.jit
def _int8_gemm_async_mma_kernel(
    a_desc, a_scale_ptr, w_desc, w_scale_ptr, bias_ptr, out_ptr,
    M, N, K, stride_om, stride_as,
    HAS_BIAS: gl.constexpr, RAW_INT32: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
    STAGES: gl.constexpr, num_warps: gl.constexpr,
):
    # grouped tile order, as _tile_coords
    pid = gl.program_id(0)
    num_pid_m = gl.cdiv(M, BLOCK_M)
    num_pid_n = gl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_pid_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = gl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    off_m = pid_m * BLOCK_M
    off_n = pid_n * BLOCK_N

    # STAGES buffers of [BLOCK_M, BLOCK_K] and [BLOCK_N, BLOCK_K] (K-major, 128B-swizzled, as TMA
    # writes them and the int8 wgmma reads them), one "loaded" mbarrier each
    a_bufs = gl.allocate_shared_memory(gl.int8, [STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
    w_bufs = gl.allocate_shared_memory(gl.int8, [STAGES, BLOCK_N, BLOCK_K], w_desc.layout)
    loaded = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(loaded.index(i), count=1)
    tile_bytes: gl.constexpr = a_desc.block_type.nbytes + w_desc.block_type.nbytes
    k_tiles = gl.cdiv(K, BLOCK_K)
    # TMA fills the parts of a box past M, N or K with zeros: no masks, the last K tile adds nothing
    for i in gl.static_range(STAGES - 1):
        pred = i < k_tiles
        mbarrier.expect(loaded.index(i), tile_bytes, pred=pred)
        tma.async_copy_global_to_shared(a_desc, [off_m, i * BLOCK_K], loaded.index(i), a_bufs.index(i), pred=pred)
        tma.async_copy_global_to_shared(w_desc, [off_n, i * BLOCK_K], loaded.index(i), w_bufs.index(i), pred=pred)

    warps: gl.constexpr = _wgmma_warps(BLOCK_M, num_warps)
    instr_n: gl.constexpr = _wgmma_instr_n(BLOCK_M, BLOCK_N, num_warps)
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=warps, instr_shape=[16, instr_n, 32])
    acc = gl.zeros([BLOCK_M, BLOCK_N], dtype=gl.int32, layout=mma)
    for kt in range(k_tiles):
        slot = kt % STAGES
        mbarrier.wait(loaded.index(slot), (kt // STAGES) & 1)
        acc = warpgroup_mma(a_bufs.index(slot), w_bufs.index(slot).permute((1, 0)), acc, is_async=True)
        # K tile kt's MMAs stay in flight; kt - 1's are done, so its buffers can be refilled
        acc, _, _ = warpgroup_mma_wait(num_outstanding=1, deps=(acc, a_bufs.index(slot), w_bufs.index(slot)))
        # every warpgroup has finished reading K tile kt - 1 before one thread overwrites it
        gl.thread_barrier()
        nxt = kt + STAGES - 1
        ns = nxt % STAGES
        pred = nxt < k_tiles
        mbarrier.expect(loaded.index(ns), tile_bytes, pred=pred)
        tma.async_copy_global_to_shared(a_desc, [off_m, nxt * BLOCK_K], loaded.index(ns), a_bufs.index(ns), pred=pred)
        tma.async_copy_global_to_shared(w_desc, [off_n, nxt * BLOCK_K], loaded.index(ns), w_bufs.index(ns), pred=pred)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(loaded.index(i))

    # the epilogue of _scaled_epilogue without split-K, in a layout of 16-byte row pieces (the MMA
    # layout's 4-byte pieces would take four times the store instructions)
    out_dtype: gl.constexpr = gl.int32 if RAW_INT32 else out_ptr.dtype.element_ty
    vec: gl.constexpr = 128 // out_dtype.primitive_bitwidth
    tpw_n: gl.constexpr = min(32, BLOCK_N // vec)
    store_layout: gl.constexpr = gl.BlockedLayout([1, vec], [32 // tpw_n, tpw_n], [num_warps, 1], [1, 0])
    if RAW_INT32:
        res = gl.convert_layout(acc, store_layout)
    else:
        offs_am = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, mma))
        offs_wn = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma))
        sa = gl.load(a_scale_ptr + offs_am * stride_as, mask=offs_am < M, other=0.0)
        sw = gl.load(w_scale_ptr + offs_wn, mask=offs_wn < N, other=0.0)
        accf = acc.to(gl.float32) * sa[:, None] * sw[None, :]
        if HAS_BIAS:
            accf += gl.load(bias_ptr + offs_wn, mask=offs_wn < N, other=0.0).to(gl.float32)[None, :]
        res = gl.convert_layout(accf.to(out_dtype), store_layout)
    offs_m = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, store_layout))
    offs_n = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, store_layout))
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    gl.store(out_ptr + offs_m.to(gl.int64)[:, None] * stride_om + offs_n[None, :], res, mask=mask)


def launch_async_mma(x_q, x_s, w, w_s, bias_arg, out, stride_as, cfg, num_tiles: int, *,
                     has_bias: bool, raw: bool) -> None:
    """_int8_gemm_async_mma_kernel on int8_gemm's prepared arguments (cfg: a TileConfig)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
    a_layout = gl.NVMMASharedLayout.get_default_for([cfg.block_m, cfg.block_k], gl.int8)
    w_layout = gl.NVMMASharedLayout.get_default_for([cfg.block_n, cfg.block_k], gl.int8)
    a_desc = GluonDescriptor.from_tensor(x_q, [cfg.block_m, cfg.block_k], a_layout)
    w_desc = GluonDescriptor.from_tensor(w, [cfg.block_n, cfg.block_k], w_layout)
    M, K = x_q.shape
    _int8_gemm_async_mma_kernel[(num_tiles,)](
        a_desc, x_s, w_desc, w_s, bias_arg, out, M, w.shape[0], K, out.stride(0), stride_as,
        HAS_BIAS=has_bias, RAW_INT32=raw, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m, STAGES=cfg.num_stages, num_warps=cfg.num_warps)
