"""Weight-only int4 / int8 GEMV for decode (few tokens): the WNA16 product without tensor cores.

    out[M, N] = x[M, K] @ W.T (+ bias),  W[n, perm[k]] = (q[n, k] - zero[k // G, n]) * scale[k // G, n]

same function and canonical layout as wna16_gemm.py (qweight int32 [K // P, N], P = 32 // bits).

Why a second kernel: at one token the tl.dot kernel pads x to 16 rows and stages both operands
through shared memory, and reaches 0.8-1.24 TB/s of int4 weights on the H100 (BENCHMARKS.md). Here
each program reads a [BLOCK_K // P, BLOCK_N] tile of words straight into registers (16-byte loads
along N), turns every value into an fp32 with integer ops only, and multiplies it by x in FFMAs:

- No int->float conversion instruction (I2F runs at a fraction of the FFMA rate). Value j of a word
  is shifted so that it lands at mantissa bit position p_j and OR-ed into the bits of 2**(23 - p_j):
  the float is then exactly OFF_j + q with OFF_j = 2**(23 - p_j). For 4 bits p_j is 11, 15 or 19
  (three values per shifted copy of the word: 3 shifts + 8 AND-ORs per word); for 8 bits 7 or 15.
  The offsets are removed without per-value work: each word row's FFMA chain starts at
  -sum_j x_j * (OFF_j + zero) (symmetric) or -sum_j x_j * OFF_j (zero points, whose
  zero * sum(x) term is taken off once per tile and column). p_j >= 11 keeps the rounding of
  those large intermediates (at most 4096 * |x|) ~1e-4 relative to the result, well below bf16.
- x is read as 32-bit pairs of 16-bit values (a bf16 becomes an fp32 with one shift or AND), once
  per word row and tile, and shared by all the columns a thread holds; the group scale (and zero
  point) are applied once per tile and column, after the tile's word rows are summed (BLOCK_K
  divides G, so a tile lies in one group). Act-order (perm) gathers x value by value.
- Tiles are 3-D, [BLOCK_M, word rows, BLOCK_N]: with BLOCK_N a multiple of 128 * num_warps every
  thread holds BLOCK_N / (32 * num_warps) whole columns (16-byte loads, 4 columns each) and that
  sum stays inside the thread; other shapes are valid but reduce across warps.
- Cost on sm_90 (SASS of the main loop, int4, one token): ~24-26 instructions per 32-bit word
  with 8-16 columns per thread, of which 8 FFMA, 8 LOP3, 3 shifts, 1 FADD; about +20 per extra
  row of x (the FFMAs are per row, the unpacking is shared), so the tl.dot kernel takes over
  after a few tokens (WNA16_GEMV_MAX_M in wna16_gemm.py).

The grid is N tiles x split-K slices, finished in the same launch by _split_k.py's counters (the
first call must be eager, before CUDA-graph capture). At most GEMV_MAX_ROWS rows of x, all in one
program.
"""
from __future__ import annotations


import torch
import triton
import triton.language as tl

from splitserve.kernels.gemm._split_k import gemv_split_for, num_sms, split_k_buffers, split_k_epilogue  # noqa: F401
from splitserve.kernels.gemm.tiles import TileConfig, wna16_gemv_tiles
from splitserve.kernels.gemm.wna16.wna16_layout import CANONICAL_ORDER, check_wna16_call

GEMV_MAX_ROWS = 8  # rows of x one program holds (registers: every FFMA chain is per row)


@triton.jit
def _x_gather(x_ptr, perm_ptr, offs_m, mask_m, stride_xm, k_idx):
    """x[m, perm[k]] for offs_m [BLOCK_M, 1, 1] and packed K indices k_idx [1, KW, 1]: fp32
    [BLOCK_M, KW, 1], 0 past M (act-order: one 16-bit gather per value)."""
    return tl.load(x_ptr + offs_m * stride_xm + tl.load(perm_ptr + k_idx), mask=mask_m, other=0.0).to(tl.float32)


@triton.jit
def _x_pair(x32_tile, r: tl.constexpr, mask_m, IS_BF16: tl.constexpr):
    """x[m, k + r] and x[m, k + r + 1] (r even) as fp32 [BLOCK_M, KW, 1], from one 32-bit load of the
    pair; x32_tile points at the pair of each word row's first K index k."""
    pair = tl.load(x32_tile + r // 2, mask=mask_m, other=0)
    if IS_BF16:  # a bf16 is the top half of its fp32: no conversion instruction
        lo = (pair << 16).to(tl.float32, bitcast=True)
        hi = (pair & -65536).to(tl.float32, bitcast=True)
    else:
        lo = pair.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        hi = (pair >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def _x_values(x_ptr, perm_ptr, x32_tile, offs_m, mask_m, stride_xm, k_words, r: tl.constexpr,
              HAS_PERM: tl.constexpr, IS_BF16: tl.constexpr):
    """x at K offsets r and r + 1 of each word row (fp32 [BLOCK_M, KW, 1] each): gathered through
    perm (act-order), else one 32-bit load of the pair."""
    if HAS_PERM:
        lo = _x_gather(x_ptr, perm_ptr, offs_m, mask_m, stride_xm, k_words + r)
        hi = _x_gather(x_ptr, perm_ptr, offs_m, mask_m, stride_xm, k_words + r + 1)
    else:
        lo, hi = _x_pair(x32_tile, r, mask_m, IS_BF16)
    return lo, hi


# Value j of a word is placed at mantissa bit position p_j: 11, 15, 19 for 4 bits (three values
# share one shifted copy of the word), 7, 15 for 8 bits (two per copy). Helpers take the K offset r
# within the word; its value position j follows the canonical order of wna16_layout.py (4 bits: K
# offsets 0, 2, 4, 6 in values 0..3, offsets 1, 3, 5, 7 in values 4..7; 8 bits: j = r).

@triton.jit
def _value_as_float(words, r: tl.constexpr, BITS: tl.constexpr, opaque_zero):
    """The value at K offset r of each word as the fp32 OFF + q, integer ops only: one shift per
    shifted copy of the word and one AND-OR per value."""
    J: tl.constexpr = (r // 2 + 4 * (r % 2)) if BITS == 4 else r
    P_J: tl.constexpr = (11 + 4 * (J % 3)) if BITS == 4 else (7 + 8 * (J % 2))
    SHIFT: tl.constexpr = P_J - BITS * J
    MASK: tl.constexpr = ((1 << BITS) - 1) << P_J
    ONE: tl.constexpr = (150 - P_J) << 23  # bits of the fp32 2**(23 - P_J): exponent 127 + 23 - P_J
    # opaque_zero (0 at run time) keeps ONE in a register: a SASS LOP3 takes one immediate, and with
    # MASK and ONE both immediates ptxas made the AND-OR two instructions per value.
    one = opaque_zero + ONE
    if SHIFT >= 0:
        moved = words << SHIFT
    else:
        moved = words >> (-SHIFT)  # arithmetic shift: the sign bits land above MASK
    return ((moved & MASK) | one).to(tl.float32, bitcast=True)


@triton.jit
def _value_offset(r: tl.constexpr, BITS: tl.constexpr):
    """OFF = 2**(23 - p_j), the float _value_as_float adds to the value at K offset r."""
    J: tl.constexpr = (r // 2 + 4 * (r % 2)) if BITS == 4 else r
    P_J: tl.constexpr = (11 + 4 * (J % 3)) if BITS == 4 else (7 + 8 * (J % 2))
    return tl.full([], 1 << (23 - P_J), tl.float32)


@triton.jit(do_not_specialize=["opaque_zero"])
def _wna16_gemv_kernel(
    x_ptr, x32_ptr, perm_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, part_ptr, count_ptr,
    M, N, k_per_split, num_splits, K, stride_xm, stride_om, opaque_zero,
    BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_PERM: tl.constexpr,
    HAS_BIAS: tl.constexpr, IS_BF16: tl.constexpr, EVEN_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, USE_SPLIT_K: tl.constexpr, PREFETCH: tl.constexpr,
):
    P: tl.constexpr = 32 // BITS
    KW: tl.constexpr = BLOCK_K // P  # word rows per tile
    ZERO_SYM: tl.constexpr = 1 << (BITS - 1)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    # Every tile is born 3-D, [BLOCK_M, KW, BLOCK_N] (word rows in the middle), so that the words'
    # coalesced layout (4 columns per thread) is also the layout of the FFMA chains: a 2-D tile
    # expanded to 3-D was converted through shared memory in every K step.
    offs_m = tl.arange(0, BLOCK_M)[:, None, None]
    rows_w = tl.arange(0, KW)[None, :, None]
    # Contiguity capped at 4 columns: the 16-bit scale and 8-bit zero loads then get the words'
    # layout (4 columns per thread, repeated every 128 * num_warps), not 8 or 16 contiguous ones,
    # which converted each tile's sums through shared memory (STS/BAR/LDS in the K loop).
    offs_n = pid_n * BLOCK_N + tl.max_contiguous(tl.arange(0, BLOCK_N), 4)[None, None, :]
    mask_m = offs_m < M
    # without a partial N tile the loads are unmasked (a masked 16-byte load also zeroes its registers)
    mask_n = (offs_n < N) | EVEN_N
    k_start = pid_k * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)
    # int32 offsets: the launcher checks that qweight has fewer than 2**31 words
    w_ptrs = qw_ptr + (k_start // P) * N + rows_w * N + offs_n  # [1, KW, BLOCK_N]
    # x as 32-bit pairs: row m's pair at each word row's first K index, relative to the tile's start
    # (compile-time offsets, so every pair load is one LDG with an immediate offset)
    x32_rows = x32_ptr + offs_m * (stride_xm // 2) + rows_w * (P // 2)  # [BLOCK_M, KW, 1]
    acc = tl.zeros([BLOCK_M, 1, BLOCK_N], dtype=tl.float32)
    if PREFETCH:
        words_next = tl.load(w_ptrs, mask=mask_n, other=0)
    for k0 in range(k_start, k_end, BLOCK_K):
        if PREFETCH:
            # the next tile's words are requested before this tile's arithmetic (in registers, not
            # through shared memory), so a program keeps loads in flight while it computes
            words = words_next
            w_ptrs += KW * N
            words_next = tl.load(w_ptrs, mask=mask_n & (k0 + BLOCK_K < k_end), other=0)
        else:
            words = tl.load(w_ptrs, mask=mask_n, other=0)
            w_ptrs += KW * N
        g_row = (k0 // GROUP) * N
        s = tl.load(s_ptr + g_row + offs_n, mask=mask_n, other=0.0).to(tl.float32)  # [1, 1, BLOCK_N]
        k_words = k0 + rows_w * P  # packed K index of each word row's first value
        x32_tile = x32_rows + (k0 >> 1)
        # Each word row's chain starts at minus the x-weighted offsets (and the symmetric zero), so
        # that it sums x * (q - zero) with no per-value subtraction. Two passes over the K offsets
        # (the start is needed first); the compiler merges their identical x loads.
        start = tl.zeros([BLOCK_M, KW, 1], dtype=tl.float32)
        x_sum = tl.zeros([BLOCK_M, KW, 1], dtype=tl.float32)
        for r in tl.static_range(0, P, 2):
            x_lo, x_hi = _x_values(x_ptr, perm_ptr, x32_tile, offs_m, mask_m, stride_xm, k_words, r, HAS_PERM, IS_BF16)
            off_lo = _value_offset(r, BITS)
            off_hi = _value_offset(r + 1, BITS)
            if HAS_ZERO:
                start -= x_lo * off_lo + x_hi * off_hi
                x_sum += x_lo + x_hi
            else:
                start -= x_lo * (off_lo + ZERO_SYM) + x_hi * (off_hi + ZERO_SYM)
        chain = start
        for r in tl.static_range(0, P, 2):
            x_lo, x_hi = _x_values(x_ptr, perm_ptr, x32_tile, offs_m, mask_m, stride_xm, k_words, r, HAS_PERM, IS_BF16)
            chain = chain + x_lo * _value_as_float(words, r, BITS, opaque_zero)
            chain = chain + x_hi * _value_as_float(words, r + 1, BITS, opaque_zero)
        part = tl.sum(chain, axis=1, keep_dims=True)  # [BLOCK_M, 1, BLOCK_N]: the tile's x * (q - zero)
        if HAS_ZERO:
            z = tl.load(z_ptr + g_row + offs_n, mask=mask_n, other=0).to(tl.float32)
            part -= tl.sum(x_sum, axis=1, keep_dims=True) * z
        acc += part * s
    acc = tl.reshape(acc, (BLOCK_M, BLOCK_N))
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    split_k_epilogue(acc, offs_m, offs_n, M, N, out_ptr, stride_om, part_ptr, count_ptr, bias_ptr,
                     pid_n, pid_k, num_splits, HAS_BIAS, USE_SPLIT_K)


def wna16_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
               *, bits: int, group_size: int, perm: torch.Tensor | None = None, bias: torch.Tensor | None = None,
               config: TileConfig | None = None) -> torch.Tensor:
    """The GEMV kernel: x bf16/fp16 [M, K] (M <= 8) times the canonical weight -> [M, N] in x's dtype."""
    M, K, N = check_wna16_call(x, qweight, scales, zeros, bits, group_size, perm, bias)
    if M > GEMV_MAX_ROWS:
        raise ValueError(f"wna16_gemv takes at most {GEMV_MAX_ROWS} rows, got {M}")
    if qweight.numel() >= 2**31:
        raise ValueError(f"qweight has {qweight.numel()} words; the GEMV's int32 offsets need fewer than 2**31")
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return out
    cfg = config or wna16_gemv_tiles(M, N, K, bits, group_size, zeros is not None, num_sms(x.device))
    P = 32 // bits
    if group_size % cfg.block_k or cfg.block_k % P or cfg.block_k & (cfg.block_k - 1):
        raise ValueError(f"block_k={cfg.block_k} must be a power of two dividing group_size={group_size} "
                         f"and holding whole words of {P} values")
    if cfg.block_n & (cfg.block_n - 1) or cfg.split_k < 1:
        raise ValueError(f"block_n={cfg.block_n} must be a power of two and split_k={cfg.split_k} >= 1")
    # x is also read as 32-bit pairs (x32): its rows must start at even elements of 4-byte alignment
    if x.stride(1) != 1 or x.stride(0) % 2 or x.data_ptr() % 4:
        x = x.clone(memory_format=torch.contiguous_format)
    num_tiles = triton.cdiv(N, cfg.block_n)
    k_per_split, num_splits, part, counters = split_k_buffers(K, cfg.split_k, cfg.block_k, num_tiles, out)
    use_split = num_splits > 1
    _wna16_gemv_kernel[(num_tiles, num_splits)](
        x, x.view(torch.int32), perm if perm is not None else out, qweight, scales, zeros if zeros is not None else out,
        bias if bias is not None else out, out, part, counters,
        M, N, k_per_split, num_splits, K, x.stride(0), out.stride(0), 0,
        BITS=bits, GROUP=group_size, HAS_ZERO=zeros is not None, HAS_PERM=perm is not None,
        HAS_BIAS=bias is not None, IS_BF16=x.dtype == torch.bfloat16,
        EVEN_N=N % cfg.block_n == 0, BLOCK_M=triton.next_power_of_2(M), BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, USE_SPLIT_K=use_split, PREFETCH=cfg.prefetch, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
    return out


assert CANONICAL_ORDER[4] == (0, 2, 4, 6, 1, 3, 5, 7) and CANONICAL_ORDER[8] == (0, 1, 2, 3), \
    "_value_as_float assumes this order"
