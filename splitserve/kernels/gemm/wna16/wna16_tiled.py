"""W4A16 / W8A16 GEMM for many tokens (decode batches, prefill): the weight tile is dequantized in
registers, scale and zero point applied, and multiplied by the tensor cores as a bf16/fp16 operand.

    out[M, N] = x[M, K] @ W.T (+ bias),  W[n, k] = (q[n, k] - zero[k // G, n]) * scale[k // G, n]

Canonical packed layout (wna16_layout.py); act-order weights (perm) are not taken here (wna16_linear
keeps them on the dequantize + cuBLAS path).

What it is for now: the Triton twin of wna16_wgmma.py (same numerics), which the interpreter runs,
so the CPU tests cover the arithmetic the Gluon kernel copies. On the H100 Triton kept this loop's
MMAs synchronous as well, and it measured slower than dequantize + cuBLAS (BENCHMARKS.md, sixteenth
session), so no route of wna16_linear runs it.

Why a second tiled kernel: wna16_gemm.py's kernel multiplies the raw OFFSET + q values and corrects
each K tile's product afterwards (acc += (part - rowsum(x) * (OFFSET + z)) * s). That touches the
accumulator between two K tiles, so each tile's MMA must finish before the next is issued: at 256
tokens it took 31.4 ms for the 8B step where dequantizing to a temporary bf16 weight and calling
cuBLAS took 14.9 and bf16 7.1 (BENCHMARKS.md). Here the accumulator is only ever the dot's own
accumulator (acc = dot(x, w, acc)); the per-element work is

    w = bf16(((2**23 + q) - (2**23 + z)) * s)      in fp32: q OR-ed into the mantissa of 2**23,

which is the dequantize path's ((q - z) * s, fp32, one rounding) bit for bit: q - z is exact, so the
product is rounded once to fp32 and once to the activation dtype in both. Outputs therefore differ
from today's large-M path only by the accumulation order of the matmul.

Two orientations (SWAP_AB):
- off: acc[BLOCK_M, BLOCK_N] = dot(x tile, w tile [BLOCK_K, BLOCK_N]); the dequantized tile goes to
  shared memory for the wgmma B operand.
- on: acc^T[BLOCK_N, BLOCK_M] = dot(w^T tile [BLOCK_N, BLOCK_K], x^T tile): the weight is the A
  operand, which Hopper's wgmma reads from registers (Triton still moves the tile through shared
  memory into that register layout); the tokens are the wgmma N dimension, so token tiles below 64
  do not waste the 64-row M granularity.

Per-element work in SASS (benchmarks/wna16_tiled.py --cpu-compile, sm_90a): one LOP3 (mask the
value in place, OR the exponent), FADD, FMUL, half an F2FP (pack two), 16-byte shared stores: ~385
instructions per 64x128 int4 tile per warpgroup, against ~550 for the first version that unpacked
through a [words, 8, N] broadcast (16-bit stores, shift + bit-field extract per value). Triton keeps
the MMA synchronous here either way (the dequantized tile is written to shared memory inside the
loop, which its wgmma pipelining does not accept as an async operand); the tiles are sized so two
programs share an SM and one dequantizes while the other multiplies. wna16_wgmma.py is the same
kernel in Gluon with the MMA asynchronous.
"""
from __future__ import annotations


import torch
import triton
import triton.language as tl

from splitserve.kernels.gemm.tiles import TileConfig, wna16_tiled_tiles
from splitserve.kernels.gemm.wna16.dequant import F32_MAGIC_BITS as _F32_MAGIC_BITS
from splitserve.kernels.gemm.wna16.dequant import dequant_tile_t as _dequant_tile_t
from splitserve.kernels.gemm.wna16.wna16_layout import check_wna16_call


# M changes every step: one compile for all token counts (it is only used in % and masks)
@triton.jit(do_not_specialize=["M"])
def _wna16_tiled_kernel(
    a_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, M, N, K, stride_am, stride_om, magic,
    BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_BIAS: tl.constexpr,
    SWAP_AB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    P: tl.constexpr = 32 // BITS
    ZERO_SYM: tl.constexpr = 1 << (BITS - 1)
    pid = tl.program_id(0)
    # consecutive programs share a weight tile (M tiles fastest): it is read from DRAM once and
    # served from L2 to the others; x (a few MB at these token counts) stays in L2 throughout
    num_pid_m = tl.cdiv(M, BLOCK_M)
    pid_m = pid % num_pid_m
    pid_n = pid // num_pid_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = (offs_m % M).to(tl.int64)   # past M / N: valid rows / columns again; the store masks them
    cols = offs_n % N
    a_dtype = a_ptr.dtype.element_ty
    num_groups = K // GROUP
    qw_ptr = qw_ptr.to(tl.pointer_type(tl.uint32))  # logical shifts
    # The scale row is loaded in the loop where Triton's pipeliner stages it like x and the words
    # (fp32 scales, 32 bits per thread; a loop-carried prefetch made it give up on the whole loop).
    # uint8 zero points are too narrow for it: they are fetched one K tile ahead by hand.
    if HAS_ZERO:
        z_cur = tl.load(z_ptr + cols).to(tl.float32)
    else:
        z_cur = tl.full([BLOCK_N], ZERO_SYM, tl.float32)
    if SWAP_AB:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if HAS_ZERO:
            z_nxt = tl.load(z_ptr + tl.minimum((k0 + BLOCK_K) // GROUP, num_groups - 1) * N + cols).to(tl.float32)
        else:
            z_nxt = z_cur
        s = tl.load(s_ptr + (k0 // GROUP) * N + cols).to(tl.float32)
        offs_k = k0 + tl.arange(0, BLOCK_K)
        offs_w = (k0 // P + tl.arange(0, BLOCK_K // P)).to(tl.int64)
        words = tl.load(qw_ptr + offs_w[None, :] * N + cols[:, None])              # [BLOCK_N, BLOCK_K // P]
        w_t = _dequant_tile_t(words, s[:, None], z_cur[:, None], magic, BITS, a_dtype)  # [BLOCK_N, BLOCK_K]
        if SWAP_AB:
            x_t = tl.load(a_ptr + rows[None, :] * stride_am + offs_k[:, None])     # [BLOCK_K, BLOCK_M]
            acc = tl.dot(w_t, x_t, acc)
        else:
            x = tl.load(a_ptr + rows[:, None] * stride_am + offs_k[None, :])       # [BLOCK_M, BLOCK_K]
            acc = tl.dot(x, tl.trans(w_t), acc)
        z_cur = z_nxt
    if SWAP_AB:
        acc = tl.trans(acc)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols).to(tl.float32)[None, :]
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=mask)


def wna16_tiled_supports(N: int, group_size: int, has_perm: bool) -> bool:
    """Whether wna16_tiled_gemm takes this weight: no act-order, K tiles inside one group, and N a
    multiple of 16 (otherwise Triton 3.6 fails to compile the kernel for sm_90: "Illegal shared
    layout" in TritonGPUOptimizeDotOperands, found with benchmarks/wna16_tiled.py --cpu-compile)."""
    return not has_perm and group_size % 16 == 0 and N % 16 == 0


def wna16_tiled_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                     *, bits: int, group_size: int, bias: torch.Tensor | None = None,
                     config: TileConfig | None = None) -> torch.Tensor:
    """x bf16/fp16 [M, K] times the canonical weight -> [M, N] in x's dtype (module docstring)."""
    M, K, N = check_wna16_call(x, qweight, scales, zeros, bits, group_size, None, bias)
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return out
    x = x if x.stride(1) == 1 else x.contiguous()
    cfg = config or wna16_tiled_tiles(M, N, K, group_size)
    P = 32 // bits
    if not wna16_tiled_supports(N, group_size, False):
        raise ValueError(f"N={N} must be a multiple of 16 and group_size={group_size} of 16")
    if group_size % cfg.block_k or cfg.block_k % P or cfg.block_k < 16:
        raise ValueError(f"block_k={cfg.block_k} must divide group_size={group_size}, hold whole words, be >= 16")
    grid = (triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n),)
    _wna16_tiled_kernel[grid](
        x, qweight, scales, zeros if zeros is not None else out, bias if bias is not None else out, out,
        M, N, K, x.stride(0), out.stride(0), _F32_MAGIC_BITS,
        BITS=bits, GROUP=group_size, HAS_ZERO=zeros is not None, HAS_BIAS=bias is not None,
        SWAP_AB=cfg.swap_ab, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out
