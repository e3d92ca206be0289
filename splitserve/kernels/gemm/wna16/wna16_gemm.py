"""Weight-only int4 / int8 GEMM (W4A16, W8A16) with group-wise scales and optional zero points.

    out[M, N] = x[M, K] @ W.T (+ bias),  W[n, perm[k]] = (q[n, k] - zero[k // G, n]) * scale[k // G, n]

with the weight in the canonical packed layout of wna16_layout.py (qweight int32 [K // P, N]).

The kernel dequantizes inside the K loop and keeps the per-element work to unpacking: the unsigned
value q is turned into a 16-bit float by OR-ing it into the mantissa of a power of two (0x4300 is
bf16 128.0, so q | 0x4300 is exactly 128 + q; fp16 uses 1024.0), and that tile goes to the tensor
cores as it is. For 4 bits the canonical value order lets one AND-OR make two such floats at once
in a 32-bit word ((w >> 4s) & 0x000F000F | 0x43004300); in SASS the tile then stays in registers
(~260 instructions per KB of int4 weights per warp against ~355 unpacking value by value, which
stored each value to shared memory; compiled with benchmarks/quant_kernels_compile.py). The offset, the zero point and the scale are constant over a K tile (BLOCK_K divides
G), so they are applied to the tile's [BLOCK_M, BLOCK_N] product instead of to every weight:

    sum_k x[m, k] * (q - z) * s = s * (dot(x, 128 + q) - rowsum(x) * (128 + z))

For few tokens the grid is N tiles x split-K slices (finished in one launch, _split_k.py); up to
WNA16_GEMV_MAX_M tokens wna16_linear uses the GEMV kernel of wna16_gemv.py instead. The
same kernel runs prefill sizes with large M tiles, but measured slower than dequantizing the weight
to a temporary dense matrix for cuBLAS, which wna16_linear does past WNA16_SPLIT_K_MAX_M tokens.
For that range wna16_tiled.py (Triton) and wna16_wgmma.py (Gluon) dequantize each weight tile in
registers to the dequantize path's bits instead (route "tiled": the Gluon kernel on Hopper up to
WNA16_TILED_MAX_M tokens).
"""
from __future__ import annotations


import torch
import triton
import triton.language as tl

from splitserve.kernels.gemm._split_k import num_sms, split_k_buffers, split_k_epilogue
from splitserve.kernels.gemm.tiles import WNA16_SPLIT_K_MAX_M, TileConfig, wna16_gemm_tiles  # noqa: F401
from splitserve.kernels.gemm.wna16.wna16_gemv import wna16_gemv
from splitserve.kernels.gemm.wna16.wna16_layout import check_canonical, check_wna16_call, largest_pow2_divisor
from splitserve.kernels.gemm.wna16.wna16_tiled import wna16_tiled_gemm, wna16_tiled_supports

# wna16_linear's policy: the split-K kernel up to WNA16_SPLIT_K_MAX_M tokens; from
# WNA16_DEQUANT_MIN_M on, the weight is dequantized to a temporary bf16 matrix for cuBLAS. On the
# H100 that beat the kernel's large-tile path (14.9 against 31.4 ms for the 8B step at 256 tokens,
# 53 against 164 ms at 2048, BENCHMARKS.md), so the tiled path is only reachable through
# wna16_gemm(config=...) until it is made faster.
WNA16_DEQUANT_MIN_M = 65
# From WNA16_DEQUANT_MIN_M up to WNA16_TILED_MAX_M tokens (no act-order, on Hopper), wna16_wgmma.py's
# kernel instead of the dequantize path: it dequantizes each weight tile in registers to the same bits and
# keeps the tensor-core accumulator free of per-tile corrections. The H100 sweep
# (benchmarks/wna16_tiled.py --check --sweep, BENCHMARKS.md sixteenth session), 8B layers, ms per
# step: 7.2 against 13.8 for dequantize + cuBLAS at 128 tokens, 11.1 against 14.7 at 256; at 512
# only gate_up still wins, and from 1024 on the dequantize path is faster (bf16: 5.7 / 6.4 ms).
WNA16_TILED_MAX_M = 256
# Up to WNA16_GEMV_MAX_M tokens wna16_linear takes the GEMV kernel (wna16_gemv.py: no tensor cores,
# no padding of x to 16 rows). Its FFMAs grow with the token count while the dot kernel's work does
# not: on the H100 sweep (best tiles per shape, 8B layers) the GEMV took 2.12 / 2.61 / 4.31 ms at
# 1 / 2 / 4 tokens against ~3.2-3.4 ms for the dot kernel, so it stops at 2.
WNA16_GEMV_MAX_M = 2

# 16-bit float whose mantissa holds q exactly when q is OR-ed into its low bits: (bit pattern, value)
_MAGIC = {torch.bfloat16: (0x4300, 128.0), torch.float16: (0x6400, 1024.0)}


@triton.jit
def _group_row(ptr, k, num_groups, N, cols, GROUP: tl.constexpr):
    """Row [K // G, N] of the group holding K index k (clamped to the last group), as fp32."""
    return tl.load(ptr + tl.minimum(k // GROUP, num_groups - 1) * N + cols).to(tl.float32)


@triton.jit
def _wna16_kernel(
    a_ptr, perm_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, part_ptr, count_ptr,
    M, N, k_per_split, num_splits, K, stride_am, stride_om,
    BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_PERM: tl.constexpr,
    HAS_BIAS: tl.constexpr, MAGIC: tl.constexpr, OFFSET: tl.constexpr, UNPACK_BCAST: tl.constexpr,
    PAIRS: tl.constexpr, MAGIC2: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_SPLIT_K: tl.constexpr,
):
    P: tl.constexpr = 32 // BITS
    QMASK: tl.constexpr = (1 << BITS) - 1
    ZERO_SYM: tl.constexpr = 1 << (BITS - 1)
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    pid_m = pid % num_pid_m
    pid_n = pid // num_pid_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_a = (offs_m % M).to(tl.int64)
    cols = offs_n % N  # past N: a valid column again; the store masks it
    k_start = pid_k * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)
    a_dtype = a_ptr.dtype.element_ty
    num_groups = K // GROUP
    # Scales and zero points are plain loads (not tensor-core operands), which Triton's pipeliner
    # leaves synchronous: each K step would wait a full memory latency for them (measured: 0.5-0.75
    # TB/s). They are fetched two K tiles ahead instead.
    s_cur = _group_row(s_ptr, k_start, num_groups, N, cols, GROUP)
    s_nxt = _group_row(s_ptr, k_start + BLOCK_K, num_groups, N, cols, GROUP)
    if HAS_ZERO:
        z_cur = _group_row(z_ptr, k_start, num_groups, N, cols, GROUP)
        z_nxt = _group_row(z_ptr, k_start + BLOCK_K, num_groups, N, cols, GROUP)
    else:
        z_cur = tl.full([BLOCK_N], ZERO_SYM, tl.float32)
        z_nxt = z_cur
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        s_pf = _group_row(s_ptr, k0 + 2 * BLOCK_K, num_groups, N, cols, GROUP)
        if HAS_ZERO:
            z_pf = _group_row(z_ptr, k0 + 2 * BLOCK_K, num_groups, N, cols, GROUP)
        else:
            z_pf = z_cur
        offs_k = k0 + tl.arange(0, BLOCK_K)
        if PAIRS:
            # 4-bit canonical order: (w >> 4s) & 0x000F000F holds K offsets 2s and 2s + 1, and one
            # OR makes them two 16-bit floats (OFFSET + q); the halves are split and interleaved
            # back into K order. Everything stays in registers (no per-value shared-memory store).
            offs_w = (k0 // P + tl.arange(0, BLOCK_K // P)).to(tl.int64)
            words = tl.load(qw_ptr + offs_w[:, None] * N + cols[None, :])
            pairs = ((words[:, None, :] >> (tl.arange(0, 4) * 4)[None, :, None]) & 0x000F000F) | MAGIC2
            lo = pairs.to(tl.int16)
            hi = (pairs >> 16).to(tl.int16)
            b = tl.reshape(tl.permute(tl.join(lo, hi), (0, 1, 3, 2)), (BLOCK_K, BLOCK_N))
            b = b.to(a_dtype, bitcast=True)
        else:
            if UNPACK_BCAST:
                # each element loads its own word (the L1 serves the repeats)
                r = offs_k % P
                pos = (r // 2 + (r % 2) * 4) if BITS == 4 else r  # value position of K offset r
                words = tl.load(qw_ptr + (offs_k // P).to(tl.int64)[:, None] * N + cols[None, :])
                q = (words >> (pos * BITS)[:, None]) & QMASK
            else:  # 8-bit, natural order
                offs_w = (k0 // P + tl.arange(0, BLOCK_K // P)).to(tl.int64)
                words = tl.load(qw_ptr + offs_w[:, None] * N + cols[None, :])
                q = (words[:, None, :] >> (tl.arange(0, P) * BITS)[None, :, None]) & QMASK
                q = tl.reshape(q, (BLOCK_K, BLOCK_N))
            if MAGIC != 0:
                b = (q | MAGIC).to(tl.int16).to(a_dtype, bitcast=True)  # exactly OFFSET + q
            else:
                b = q.to(tl.float32).to(a_dtype)                      # exactly q (OFFSET is 0)
        if HAS_PERM:
            cols_a = tl.load(perm_ptr + offs_k)
        else:
            cols_a = offs_k
        a = tl.load(a_ptr + rows_a[:, None] * stride_am + cols_a[None, :])
        part = tl.dot(a, b)
        a_sum = tl.sum(a.to(tl.float32), axis=1)
        acc += (part - a_sum[:, None] * (z_cur + OFFSET)[None, :]) * s_cur[None, :]
        s_cur, s_nxt = s_nxt, s_pf
        z_cur, z_nxt = z_nxt, z_pf
    split_k_epilogue(acc, offs_m, offs_n, M, N, out_ptr, stride_om, part_ptr, count_ptr, bias_ptr,
                     pid, pid_k, num_splits, HAS_BIAS, USE_SPLIT_K)


@triton.jit
def _wna16_dequant_kernel(qw_ptr, s_ptr, z_ptr, out_ptr, N, BITS: tl.constexpr, GROUP: tl.constexpr,
                          HAS_ZERO: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    # out [K, N] (N contiguous, like qweight) = (q - zero) * scale
    P: tl.constexpr = 32 // BITS
    ZERO_SYM: tl.constexpr = 1 << (BITS - 1)
    offs_k = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = offs_n[None, :] < N
    words = tl.load(qw_ptr + (offs_k // P).to(tl.int64)[:, None] * N + offs_n[None, :], mask=mask)
    r = offs_k % P
    pos = (r // 2 + (r % 2) * 4) if BITS == 4 else r  # value position of K offset r (canonical order)
    q = ((words >> (pos * BITS)[:, None]) & ((1 << BITS) - 1)).to(tl.float32)
    g = (offs_k // GROUP)[:, None] * N + offs_n[None, :]
    s = tl.load(s_ptr + g, mask=mask).to(tl.float32)
    if HAS_ZERO:
        z = tl.load(z_ptr + g, mask=mask).to(tl.float32)
    else:
        z = tl.full([BLOCK_K, BLOCK_N], ZERO_SYM, tl.float32)
    tl.store(out_ptr + offs_k.to(tl.int64)[:, None] * N + offs_n[None, :],
             ((q - z) * s).to(out_ptr.dtype.element_ty), mask=mask)


def wna16_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
               *, bits: int, group_size: int, perm: torch.Tensor | None = None, bias: torch.Tensor | None = None,
               config: TileConfig | None = None) -> torch.Tensor:
    """The Triton kernel: x bf16/fp16 [M, K] times the canonical weight -> [M, N] in x's dtype."""
    M, K, N = check_wna16_call(x, qweight, scales, zeros, bits, group_size, perm, bias)
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return out
    x = x if x.stride(1) == 1 else x.contiguous()
    cfg = config or wna16_gemm_tiles(M, N, K, group_size, num_sms(x.device))
    if group_size % cfg.block_k or cfg.block_k % (32 // bits):
        raise ValueError(f"block_k={cfg.block_k} must divide group_size={group_size} and hold whole words")
    # 8-bit values do not fit bf16's mantissa above 128 + 127: they convert through fp32 instead.
    magic, offset = _MAGIC[x.dtype] if (bits == 4 or x.dtype == torch.float16) else (0, 0.0)
    num_tiles = triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n)
    k_per_split, num_splits, part, counters = split_k_buffers(K, cfg.split_k, cfg.block_k, num_tiles, out)
    use_split = num_splits > 1
    _wna16_kernel[(num_tiles, num_splits)](
        x, perm if perm is not None else out, qweight, scales, zeros if zeros is not None else out,
        bias if bias is not None else out, out, part, counters,
        M, N, k_per_split, num_splits, K, x.stride(0), out.stride(0),
        BITS=bits, GROUP=group_size, HAS_ZERO=zeros is not None, HAS_PERM=perm is not None,
        HAS_BIAS=bias is not None, MAGIC=magic, OFFSET=offset, UNPACK_BCAST=cfg.unpack_bcast,
        PAIRS=bits == 4 and magic != 0 and not cfg.unpack_bcast, MAGIC2=magic | (magic << 16),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, USE_SPLIT_K=use_split,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out


def wna16_dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, *, bits: int,
                     group_size: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The dense weight transposed, [K, N] in packed K order (Triton)."""
    check_canonical(qweight, scales, zeros, bits, group_size)
    K, N = qweight.shape[0] * (32 // bits), qweight.shape[1]
    out = torch.empty((K, N), dtype=dtype, device=qweight.device)
    block_k = largest_pow2_divisor(K, 64) if K % 16 == 0 else None
    if block_k is None:
        raise ValueError(f"K={K} must be a multiple of 16")
    _wna16_dequant_kernel[(K // block_k, triton.cdiv(N, 128))](
        qweight, scales, zeros if zeros is not None else out, out, N, BITS=bits, GROUP=group_size,
        HAS_ZERO=zeros is not None, BLOCK_K=block_k, BLOCK_N=128)
    return out


def wna16_route(M: int, *, bits: int = 4, has_zeros: bool = False, has_perm: bool = False, N: int = 16,
                group_size: int = 128) -> str:
    """Which path wna16_linear takes on CUDA for M tokens: "gemv", "split_k", "tiled" or "dequant".
    The GEMV only for symmetric int4, the case its tiles were swept for: with zero points its default
    tiles made the 8B decode slower than the split-K kernel (5.20 against 4.42 ms/token,
    BENCHMARKS.md). Act-order weights (perm) never take the tiled kernel (wna16_tiled_supports)."""
    if M <= WNA16_GEMV_MAX_M and bits == 4 and not has_zeros:
        return "gemv"
    if M < WNA16_DEQUANT_MIN_M:
        return "split_k"
    return "tiled" if M <= WNA16_TILED_MAX_M and wna16_tiled_supports(N, group_size, has_perm) else "dequant"


def _tiled(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, *,
           bits: int, group_size: int, bias: torch.Tensor | None) -> torch.Tensor | None:
    """The tiled route: wna16_wgmma.py's Gluon kernel (async wgmma overlapping the next tile's
    dequantization), on Hopper only; None where it cannot run. wna16_tiled.py's Triton twin (same
    numerics, runnable in the interpreter) measured slower than dequantize + cuBLAS on the H100
    sweep, so it is not a fallback here."""
    try:
        from splitserve.kernels.gemm.wna16 import wna16_wgmma  # Gluon: imported only where used
    except ImportError:  # a Triton without the experimental Gluon API
        return None
    if not wna16_wgmma.wna16_wgmma_supported(x, qweight.shape[1], group_size):
        return None
    return wna16_wgmma.wna16_wgmma_gemm(x, qweight, scales, zeros, bits=bits, group_size=group_size, bias=bias)


def wna16_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                 *, bits: int, group_size: int, perm: torch.Tensor | None = None,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ W.T + bias for x [..., K]: the entry the linear layers call (module docstring).
    Off CUDA (CPU tests) the torch reference computes the same function."""
    from splitserve.kernels.gemm import reference

    lead, K = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, K)
    M, N = x2.shape[0], qweight.shape[1]
    if x.device.type != "cuda":
        out = reference.wna16_gemm_ref(x2, qweight, scales, zeros, bits=bits, group_size=group_size,
                                       perm=perm, bias=bias).to(x.dtype)
    elif (route := wna16_route(M, bits=bits, has_zeros=zeros is not None, has_perm=perm is not None, N=N,
                               group_size=group_size)) == "gemv":
        out = wna16_gemv(x2, qweight, scales, zeros, bits=bits, group_size=group_size, perm=perm, bias=bias)
    elif route == "split_k":
        out = wna16_gemm(x2, qweight, scales, zeros, bits=bits, group_size=group_size, perm=perm, bias=bias)
    else:
        out = _tiled(x2, qweight, scales, zeros, bits=bits, group_size=group_size, bias=bias) \
            if route == "tiled" else None
        if out is None:  # dequantize to a temporary dense weight for cuBLAS
            w_kn = wna16_dequantize(qweight, scales, zeros, bits=bits, group_size=group_size, dtype=x.dtype)
            xp = x2 if perm is None else x2.index_select(1, perm)
            out = torch.mm(xp, w_kn) if bias is None else torch.addmm(bias, xp, w_kn)
    return out.reshape(*lead, N)
