"""Triton attention over the paged KV cache.

Layouts are those of splitserve/attention/backend.py:
  q        [T, Hq, D]                 (Hq = G * Hkv, GQA group size G)
  kv_cache [num_blocks, 2, block_size, Hkv, D]
Sequence i owns query rows query_start_loc[i]:query_start_loc[i+1]; they are the LAST q_len_i tokens
of a context of seq_lens[i] tokens, read through block_tables[i], and attend causally.

Two kernels:
  * ragged_paged_attention: one launch for any mixed batch (prefill chunks with prefix-cache hits,
    decode tokens). A program owns one block of BLOCK_Q query tokens of one sequence and one KV head,
    and processes all G query heads of that KV head together, so each K/V tile loaded from the cache
    is reused by BLOCK_Q * G query rows (tile rows are (token, head) pairs).
  * paged_decode_attention: pure-decode batches (one query token per sequence). Split-K: each
    program covers one slice of a sequence's context for one KV head (all G query heads), writes a
    partial output plus its log-sum-exp, and a reduce kernel merges the slices. With long contexts
    and small batches this keeps all SMs busy where one program per (seq, head) would not.

Sliding windows (a query at position p sees keys p - W < n <= p) skip whole K/V tiles before the
window in the loops, and mask only the tiles that straddle its edge. A logit soft cap c (Gemma 2:
s -> c * tanh(s / c)) is applied in the log2 domain, with c * log2(e) as the cap, which is the same
function of the natural-domain logits. Head dims that are not a power of two (80, 96, ...) run on
tiles padded to the next power of two: the padding columns are masked on load (zeros), so they add
nothing to q . k or to the output, and are never stored; the cache itself is never padded.

A relative position bias (T5: pos_bias [Hq, max_len] fp32, the entry of distance
clamp(p - n, 0, max_len - 1) added to the scaled logit of a query at p and a key at n) is gathered
per tile from the table (a few KB, cache-resident) and added in the log2 domain; USE_BIAS is a
constexpr, so a launch without one compiles to the same code as before the bias existed. The ragged
kernel's CAUSAL=False (cross-attention, ops/cross_attention.py) lets every query of a sequence see
all its seq_len keys.

Both use an online softmax in the log2 domain (exp2 is cheaper than exp; scale * log2(e) is folded
into the logits) with fp32 accumulation.

An FP8 (e4m3) cache holds K / k_scale and V / v_scale (see store_kv.py). Tiles are widened to q's
dtype as they load (exact: every e4m3 value is a bf16/fp16 value), and the scales are applied in
fp32 where they cost one multiply per program: k_scale joins the logits' scale (q . (k8 * s) =
(q . k8) * s) and v_scale multiplies the normalised output (the softmax-weighted sum is linear in
V). That is the dequantize-on-load maths, without rounding k8 * s to bf16 per element. Launch grids depend only on host ints and tensor shapes, and
the wrappers never read device tensors on the host, so they can be captured in CUDA graphs.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from splitserve.kernels.attention.store_kv import fp8_scales

_LOG2E = 1.4426950408889634
# Finite "minus infinity" for the running max: a row whose every logit is masked then yields
# exp2(-inf - (-1e30)) = 0 instead of the NaN of exp2(-inf - (-inf)).
_NEG_BIG = tl.constexpr(-1.0e30)  # constexpr: jit code may only read constexpr globals


def _check_common(q: torch.Tensor, kv_cache: torch.Tensor) -> tuple[int, int, int, int]:
    num_tokens, num_heads, head_dim = q.shape
    assert kv_cache.dim() == 5 and kv_cache.shape[1] == 2, kv_cache.shape
    num_kv_heads = kv_cache.shape[3]
    assert kv_cache.shape[4] == head_dim, (kv_cache.shape, q.shape)
    assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
    assert head_dim >= 16 and head_dim % 16 == 0, f"head_dim must be a multiple of 16, got {head_dim}"
    assert q.stride(-1) == 1 and kv_cache.stride(-1) == 1, "head_dim must be contiguous"
    return num_tokens, num_heads, num_kv_heads, head_dim


# Window stand-in for layers without one: larger than any context, so window bounds never cut (and
# q_pos - window stays far from int32 overflow).
_NO_WINDOW = 1 << 30


def _window_args(sliding_window: int | None, soft_cap: float | None) -> dict:
    """The kernels' window and soft-cap arguments (the soft cap in the log2 domain, see above)."""
    assert sliding_window is None or sliding_window >= 1, sliding_window
    assert soft_cap is None or soft_cap > 0, soft_cap
    return dict(window=sliding_window or _NO_WINDOW, soft_cap=(soft_cap or 0.0) * _LOG2E,
                USE_WINDOW=sliding_window is not None, USE_SOFT_CAP=soft_cap is not None)


def _bias_args(pos_bias: torch.Tensor | None, num_heads: int, soft_cap: float | None,
               stand_in: torch.Tensor) -> dict:
    """The kernels' position-bias arguments. Without a bias, `stand_in` (a tensor the launch passes
    anyway) fills the pointer and USE_BIAS=False compiles the bias out: the kernel's signature and
    code are those of a launch without one."""
    if pos_bias is None:
        return dict(bias_ptr=stand_in, bias_max=0, stride_bias=0, USE_BIAS=False)
    if soft_cap is not None:
        raise ValueError("a relative position bias together with a logit soft cap is not supported")
    if pos_bias.dim() != 2 or pos_bias.shape[0] != num_heads or pos_bias.shape[1] < 1:
        raise ValueError(f"pos_bias must be [num_heads={num_heads}, max_len >= 1], got {tuple(pos_bias.shape)}")
    if pos_bias.dtype != torch.float32 or pos_bias.stride(1) != 1:
        raise ValueError(f"pos_bias must be fp32 with contiguous rows, got {pos_bias.dtype}, strides "
                         f"{pos_bias.stride()}")
    return dict(bias_ptr=pos_bias, bias_max=pos_bias.shape[1] - 1, stride_bias=pos_bias.stride(0), USE_BIAS=True)


@triton.jit
def _tanh(x):
    # tanh via exp2, exact enough in fp32 and saturating cleanly: exp2 -> inf gives 1, -> 0 gives -1.
    return 1.0 - 2.0 / (tl.exp2(x * 2.8853900817779268) + 1.0)  # 2 * log2(e)


# --------------------------------------------------------------------------------------------------
# Ragged (mixed prefill + decode) kernel
# --------------------------------------------------------------------------------------------------

@triton.jit
def _ragged_tile(
    acc, m_i, l_i, q, cache_ptr, bt_row_ptr, kv_h_off, n_start, kv_lo, kv_end, q_pos,
    stride_cb, stride_ckv, stride_cs, BLOCK_SIZE: tl.constexpr, qk_scale, window, soft_cap,
    offs_n, offs_d, d_ok, bias_rows, bias_max, MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr,
    USE_WINDOW: tl.constexpr, USE_SOFT_CAP: tl.constexpr, PAD_D: tl.constexpr, USE_BIAS: tl.constexpr,
):
    """One BLOCK_N tile of context positions: gather K/V through the block table, update softmax.
    MASKED tiles may hold positions past kv_end, after a row's own position or before its window.
    Positions outside [kv_lo, kv_end) are not loaded at all, not even their block-table entries: a
    block wholly before kv_lo (the first row's window) may have been freed (stale table entry).
    USE_BIAS: bias_rows [rows] points at each row's head's row of the position-bias table, whose
    last entry is bias_max; the entry of distance clamp(q_pos - n, 0, bias_max) joins the logit."""
    offs = n_start + offs_n
    if MASKED:
        n_ok = offs < kv_end
        if USE_WINDOW:
            n_ok = n_ok & (offs >= kv_lo)
        blk = tl.load(bt_row_ptr + offs // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
    else:
        blk = tl.load(bt_row_ptr + offs // BLOCK_SIZE).to(tl.int64)
    row = blk * stride_cb + (offs % BLOCK_SIZE) * stride_cs + kv_h_off
    k_ptrs = cache_ptr + row[:, None] + offs_d[None, :]
    if MASKED:
        if PAD_D:
            ld_ok = n_ok[:, None] & d_ok[None, :]
        else:
            ld_ok = n_ok[:, None]
        k = tl.load(k_ptrs, mask=ld_ok, other=0.0)
        v = tl.load(k_ptrs + stride_ckv, mask=ld_ok, other=0.0)
    elif PAD_D:
        k = tl.load(k_ptrs, mask=d_ok[None, :], other=0.0)
        v = tl.load(k_ptrs + stride_ckv, mask=d_ok[None, :], other=0.0)
    else:
        k = tl.load(k_ptrs)
        v = tl.load(k_ptrs + stride_ckv)
    k = k.to(q.dtype)
    v = v.to(q.dtype)

    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    if USE_SOFT_CAP:
        s = soft_cap * _tanh(s / soft_cap)
    if USE_BIAS:
        # The table is in the natural domain, added to the scaled logit: times log2(e) here. Every
        # distance is clamped into the table, so masked positions load a valid entry (then -inf).
        # (A literal, not a global constexpr: Triton 3.6 leaves a callee's globals out of its
        # caller's cache key when the caller's key is computed first, so the decode kernel's key
        # would depend on which kernel a process compiled first, and precompiled kernels would miss.)
        dist = tl.minimum(tl.maximum(q_pos[:, None] - offs[None, :], 0), bias_max)
        s += tl.load(bias_rows[:, None] + dist) * 1.4426950408889634
    if MASKED:
        # Causal and bounds in one: position n is visible to a row iff n <= its own position; the
        # bound n < kv_end matters only for rows past the sequence's last query token.
        ok = (offs[None, :] <= q_pos[:, None]) & n_ok[None, :]
        if USE_WINDOW:
            ok = ok & (offs[None, :] > q_pos[:, None] - window)
        s = tl.where(ok, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


# Triton specializes integer arguments on divisibility by 16; these change from step to step (batch
# size, block-table width), so specializing them would recompile the kernel mid-serving. The bias
# table's length is the model's: unspecialized, so the precompile need not know it.
@triton.jit(do_not_specialize=["num_seqs", "stride_bt", "bias_max", "stride_bias"])
def _ragged_paged_attn_kernel(
    q_ptr, o_ptr, cache_ptr, qsl_ptr, seq_lens_ptr, bt_ptr, k_scale_ptr, v_scale_ptr, bias_ptr,
    num_seqs, qk_scale, window, soft_cap, bias_max,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_ckv, stride_cs, stride_ch, stride_bt, stride_bias,
    BLOCK_SIZE: tl.constexpr,  # KV block size: constexpr so position -> (block, offset) is shift/mask
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, DOT_PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SOFT_CAP: tl.constexpr,
    USE_BIAS: tl.constexpr = False, CAUSAL: tl.constexpr = True,
):
    PAD_D: tl.constexpr = HEAD_DIM_PAD != HEAD_DIM
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    # The KV heads of one query block are neighbouring programs: they run together and read the
    # same cache rows (a token's heads are adjacent), which DRAM serves better than scattered rows.
    pid = tl.program_id(0) // NUM_KV_HEADS
    kv_h = tl.program_id(0) % NUM_KV_HEADS

    # Map the flat program id to (sequence, query block) without a host-side table: sequence i's
    # query blocks are numbered from qsl[i] // BLOCK_Q + i. That start is non-decreasing in i and
    # leaves room for cdiv(q_len_i, BLOCK_Q) blocks, so the grid needs at most T // BLOCK_Q + B
    # programs; binary-search the last sequence whose start is <= pid.
    lo = pid * 0
    hi = lo + num_seqs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        start = tl.load(qsl_ptr + mid) // BLOCK_Q + mid
        go_right = start <= pid
        lo = tl.where(go_right, mid, lo)
        hi = tl.where(go_right, hi, mid)
    seq = lo
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    q_block = pid - (q_start // BLOCK_Q + seq)
    if q_block * BLOCK_Q >= q_len:
        return  # spare program (grid is an upper bound) or empty sequence
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_start = seq_len - q_len  # context position of the sequence's first query token
    if not CAUSAL:
        ctx_start = 0  # (cross-attention: every query sees all seq_len keys, whatever q_len is)

    # Tile row r = (token r // GROUP_PAD of this block, query head r % GROUP_PAD of this KV head).
    offs_m = tl.arange(0, BLOCK_M)
    tok = q_block * BLOCK_Q + offs_m // GROUP_PAD
    head = kv_h * GROUP + offs_m % GROUP_PAD
    row_ok = (tok < q_len) & (offs_m % GROUP_PAD < GROUP)
    q_pos = ctx_start + tok
    if not CAUSAL:
        q_pos = tok * 0 + (seq_len - 1)  # the causal test n <= q_pos becomes the bound n < seq_len
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = offs_d < HEAD_DIM
    q_rows = (q_start + tok).to(tl.int64) * stride_qt + head * stride_qh
    q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], _NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if KV_FP8:
        qk_scale = qk_scale * tl.load(k_scale_ptr)
    offs_n = tl.arange(0, BLOCK_N)
    bt_row_ptr = bt_ptr + seq.to(tl.int64) * stride_bt
    kv_h_off = kv_h * stride_ch
    bias_rows = bias_ptr + tl.where(row_ok, head, 0) * stride_bias  # read only with USE_BIAS

    # Positions <= the block's first query position are visible to every row (causally): whole
    # tiles there skip all masking. With a window, tiles wholly before the first row's window are
    # skipped, and those not wholly inside the last row's window are masked too. So the loops run
    # [lo, full_lo) masked (window edge), [full_lo, full_end) unmasked, [.., kv_end) masked (diagonal).
    first_pos = ctx_start + q_block * BLOCK_Q
    kv_end = tl.minimum(seq_len, first_pos + BLOCK_Q)  # one past the block's last query position
    full_end = ((first_pos + 1) // BLOCK_N) * BLOCK_N
    if not CAUSAL:  # no diagonal: whole tiles up to seq_len unmasked, the last one masked
        kv_end = seq_len
        full_end = (seq_len // BLOCK_N) * BLOCK_N
    # (all operands kept >= 0: integer division of negatives differs between Triton and Python)
    lo_pos = tl.maximum(first_pos - window + 1, 0)  # the first row's first visible key
    lo = (lo_pos // BLOCK_N) * BLOCK_N
    full_lo = tl.cdiv(tl.maximum(kv_end - window, 0), BLOCK_N) * BLOCK_N  # kv_end - 1: the last row
    for n_start in range(lo, tl.minimum(full_lo, kv_end), BLOCK_N):
        acc, m_i, l_i = _ragged_tile(acc, m_i, l_i, q, cache_ptr, bt_row_ptr, kv_h_off, n_start, lo_pos, kv_end,
                                     q_pos, stride_cb, stride_ckv, stride_cs, BLOCK_SIZE, qk_scale, window, soft_cap,
                                     offs_n, offs_d, d_ok, bias_rows, bias_max, True, DOT_PRECISION, USE_WINDOW,
                                     USE_SOFT_CAP, PAD_D, USE_BIAS)
    for n_start in range(full_lo, full_end, BLOCK_N):
        acc, m_i, l_i = _ragged_tile(acc, m_i, l_i, q, cache_ptr, bt_row_ptr, kv_h_off, n_start, lo_pos, kv_end,
                                     q_pos, stride_cb, stride_ckv, stride_cs, BLOCK_SIZE, qk_scale, window, soft_cap,
                                     offs_n, offs_d, d_ok, bias_rows, bias_max, False, DOT_PRECISION, USE_WINDOW,
                                     USE_SOFT_CAP, PAD_D, USE_BIAS)
    for n_start in range(tl.maximum(full_end, full_lo), kv_end, BLOCK_N):
        acc, m_i, l_i = _ragged_tile(acc, m_i, l_i, q, cache_ptr, bt_row_ptr, kv_h_off, n_start, lo_pos, kv_end,
                                     q_pos, stride_cb, stride_ckv, stride_cs, BLOCK_SIZE, qk_scale, window, soft_cap,
                                     offs_n, offs_d, d_ok, bias_rows, bias_max, True, DOT_PRECISION, USE_WINDOW,
                                     USE_SOFT_CAP, PAD_D, USE_BIAS)

    l_i = tl.where(l_i == 0.0, 1.0, l_i)  # only padded rows can have l == 0; they are not stored
    out = acc / l_i[:, None]
    if KV_FP8:
        out = out * tl.load(v_scale_ptr)
    o_rows = (q_start + tok).to(tl.int64) * stride_ot + head * stride_oh
    tl.store(o_ptr + o_rows[:, None] + offs_d[None, :], out.to(o_ptr.dtype.element_ty),
             mask=row_ok[:, None] & d_ok[None, :])


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs are for accuracy (tests, debugging): keep true fp32 dots, not TF32.
    return "ieee" if dtype == torch.float32 else "tf32"


def _ragged_config(group_pad: int, head_dim: int, max_query_len: int, mixed: bool = False) -> tuple[int, int, int, int]:
    """(BLOCK_Q, BLOCK_N, num_warps, num_stages) for the ragged kernel. `mixed`: the step's sequences
    read context beyond their own queries (prefix hits, decode rows, chunks after the first)."""
    # ~BLOCK_M tile rows (tokens x heads) per program: enough rows to amortise each K/V tile, and
    # tl.dot needs >= 16. Short query chunks (decode-heavy batches) shrink the block so the rows
    # are not mostly padding.
    block_m = 64
    block_q = max(1, min(block_m // group_pad, triton.next_power_of_2(max(1, max_query_len))))
    block_q = max(block_q, triton.cdiv(16, group_pad))
    # Tuned on H100 (bf16, D=128, G=4, block_size 16) over long prefill, 16x512 prefill, a 2k chunk
    # on a 4k prefix and 1k prefill + 64 decodes: 64 rows / BLOCK_N 32 / 4 warps / 2 stages was best
    # or within 5% everywhere; 128-row tiles waste too much on the decode rows of mixed batches.
    # Re-measured with benchmarks/attn_tune.py (H100, bf16, D=128, G=4): when queries read more
    # context than their own chunk, 64-wide K/V tiles are 9% (2k chunk on a 4k prefix) to 16% (1k
    # prefill + 64 decodes) faster; on fresh prefills 32 stays best (by 2% at 8 x 2k, 13% at 16 x 512).
    block_n = 64 if head_dim <= 64 or mixed else 32
    return block_q, block_n, 4, 2


def ragged_variant(num_tokens: int, num_seqs: int, max_query_len: int, max_seq_len: int, num_heads: int,
                   num_kv_heads: int, head_dim: int) -> tuple[int, int, int, int]:
    """The ragged kernel's compile-time configuration for a step's layout (see _ragged_config)."""
    group_pad = triton.next_power_of_2(num_heads // num_kv_heads)
    mixed = max_seq_len > max_query_len or num_seqs * max_query_len > 2 * num_tokens
    return _ragged_config(group_pad, head_dim, max_query_len, mixed)


def ragged_paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, query_start_loc: torch.Tensor,
                           seq_lens: torch.Tensor, block_tables: torch.Tensor, max_query_len: int,
                           max_seq_len: int, scale: float, out: torch.Tensor | None = None,
                           k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                           sliding_window: int | None = None, soft_cap: float | None = None,
                           pos_bias: torch.Tensor | None = None, causal: bool = True) -> torch.Tensor:
    """Causal attention of q [T, Hq, D] over the paged cache for a ragged mixed batch; returns [T, Hq, D].

    query_start_loc [B+1] int32, seq_lens [B] int32, block_tables [B, max_blocks] int32 (device).
    max_query_len / max_seq_len are host ints: max_query_len picks the query block size (and so the
    grid, T // BLOCK_Q + B programs per KV head); with max_seq_len they pick the K/V tile width.
    Rows of q not owned by any sequence (index >= query_start_loc[B], e.g. graph padding) are left
    unwritten in out. An FP8 cache is read with k_scale / v_scale (one-element fp32; None: 1.0).
    sliding_window / soft_cap: the layer's window and logit cap (module docstring); None: none.
    pos_bias: [Hq, max_len] fp32 relative position bias (module docstring); None: none.
    causal=False: cross-attention, every query of sequence i over all seq_lens[i] keys (no window).
    """
    num_tokens, num_heads, num_kv_heads, head_dim = _check_common(q, kv_cache)
    num_seqs = seq_lens.shape[0]
    if not causal and sliding_window is not None:
        raise ValueError("non-causal attention with a sliding window is not supported")
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.stride(-1) == 1
    if num_tokens == 0 or num_seqs == 0:
        return out
    assert block_tables.stride(-1) == 1
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    block_q, block_n, num_warps, num_stages = ragged_variant(num_tokens, num_seqs, max_query_len, max_seq_len,
                                                             num_heads, num_kv_heads, head_dim)
    grid = ((num_tokens // block_q + num_seqs) * num_kv_heads,)
    fp8, k_scale, v_scale = fp8_scales(kv_cache, k_scale, v_scale)
    _ragged_paged_attn_kernel[grid](
        q, out, kv_cache, query_start_loc, seq_lens, block_tables, k_scale, v_scale,
        num_seqs=num_seqs, qk_scale=scale * _LOG2E, **_window_args(sliding_window, soft_cap),
        **_bias_args(pos_bias, num_heads, soft_cap, kv_cache),
        stride_qt=q.stride(0), stride_qh=q.stride(1), stride_ot=out.stride(0), stride_oh=out.stride(1),
        stride_cb=kv_cache.stride(0), stride_ckv=kv_cache.stride(1), stride_cs=kv_cache.stride(2),
        stride_ch=kv_cache.stride(3), stride_bt=block_tables.stride(0), CAUSAL=causal,
        BLOCK_SIZE=kv_cache.shape[2], NUM_KV_HEADS=num_kv_heads,
        GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q, BLOCK_N=block_n, HEAD_DIM=head_dim,
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim), DOT_PRECISION=_dot_precision(q.dtype), KV_FP8=fp8,
        num_warps=num_warps, num_stages=num_stages,
    )
    return out


# --------------------------------------------------------------------------------------------------
# Split-K decode kernels
# --------------------------------------------------------------------------------------------------

@triton.jit(do_not_specialize=["stride_bt", "bias_max", "stride_bias"])
def _decode_split_kernel(
    q_ptr, o_ptr, part_o_ptr, part_lse_ptr, cache_ptr, seq_lens_ptr, bt_ptr, k_scale_ptr, v_scale_ptr, bias_ptr,
    qk_scale, window, soft_cap, bias_max,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_ckv, stride_cs, stride_ch, stride_bt, stride_bias,
    num_heads, BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr, SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr, KV_FP8: tl.constexpr,
    USE_WINDOW: tl.constexpr, USE_SOFT_CAP: tl.constexpr, USE_BIAS: tl.constexpr = False,
):
    PAD_D: tl.constexpr = HEAD_DIM_PAD != HEAD_DIM
    NUM_SPLITS = tl.num_programs(2)
    kv_h = tl.program_id(0)  # fastest: a sequence's KV heads read adjacent cache rows together
    seq = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    # The query (position seq_len - 1) sees [ctx_lo, seq_len): everything, or its window. Each split
    # gets a BLOCK_N-multiple slice of that range, sized from this sequence's own length, so short
    # sequences in a batch with long ones do not leave most splits idle with tiny slices; positions
    # before the window are never visited.
    ctx_lo = tl.maximum(seq_len - window, 0)
    chunk = tl.cdiv(tl.cdiv(seq_len - ctx_lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
    n_lo = ctx_lo + split * chunk
    n_hi = tl.minimum(n_lo + chunk, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    head = kv_h * GROUP + offs_h
    h_ok = offs_h < GROUP
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = offs_d < HEAD_DIM
    q = tl.load(q_ptr + seq.to(tl.int64) * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=h_ok[:, None] & d_ok[None, :], other=0.0)

    acc = tl.zeros([BLOCK_H, HEAD_DIM_PAD], dtype=tl.float32)
    m_i = tl.full([BLOCK_H], _NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    if KV_FP8:
        qk_scale = qk_scale * tl.load(k_scale_ptr)
    offs_n = tl.arange(0, BLOCK_N)
    bt_row_ptr = bt_ptr + seq.to(tl.int64) * stride_bt
    kv_h_off = kv_h * stride_ch
    # The only query token sits at position seq_len - 1, so the causal mask is no mask, and the slices
    # start inside the window: the bound n < n_hi is all that cuts a tile (USE_WINDOW=False).
    q_pos = tl.zeros([BLOCK_H], dtype=tl.int32) + (seq_len - 1)
    bias_rows = bias_ptr + tl.where(h_ok, head, 0) * stride_bias  # read only with USE_BIAS
    for n_start in range(n_lo, n_hi, BLOCK_N):
        acc, m_i, l_i = _ragged_tile(acc, m_i, l_i, q, cache_ptr, bt_row_ptr, kv_h_off, n_start, n_lo, n_hi,
                                     q_pos, stride_cb, stride_ckv, stride_cs, BLOCK_SIZE, qk_scale, window, soft_cap,
                                     offs_n, offs_d, d_ok, bias_rows, bias_max, True, DOT_PRECISION, False,
                                     USE_SOFT_CAP, PAD_D, USE_BIAS)

    empty = l_i == 0.0  # split past the end of this sequence (or seq_len == 0: a padding slot)
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    if KV_FP8:
        out = out * tl.load(v_scale_ptr)  # before the merge, which is linear in the outputs
    if not SPLIT:
        # Nothing to merge: write the final output directly and skip the reduce launch.
        o_ptrs = o_ptr + seq.to(tl.int64) * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=h_ok[:, None] & d_ok[None, :])
    else:
        # part_o [B, Hq, NUM_SPLITS, D] fp32, part_lse [B, Hq, NUM_SPLITS] fp32 (log2 domain).
        lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
        base = (seq.to(tl.int64) * num_heads + head) * NUM_SPLITS + split
        tl.store(part_lse_ptr + base, lse, mask=h_ok)
        tl.store(part_o_ptr + base[:, None] * HEAD_DIM + offs_d[None, :], out, mask=h_ok[:, None] & d_ok[None, :])


# The split count is a run-time value (the grid's third dimension in the split kernel, an argument
# here) so one compiled kernel serves every count: fewer compilations at start-up.
@triton.jit(do_not_specialize=["num_splits"])
def _decode_reduce_kernel(
    o_ptr, part_o_ptr, part_lse_ptr, stride_ot, stride_oh, num_heads, num_splits,
    SPLITS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
):
    NUM_SPLITS = num_splits
    # Merge the splits of one (sequence, query head): out = sum_s 2^(lse_s - max) * o_s / sum_s 2^(lse_s - max).
    head = tl.program_id(0)
    seq = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = offs_d < HEAD_DIM
    s_ok = offs_s < NUM_SPLITS
    base = (seq.to(tl.int64) * num_heads + head) * NUM_SPLITS
    lse = tl.load(part_lse_ptr + base + offs_s, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)  # all splits empty (seq_len == 0): output zeros
    w = tl.exp2(lse - m)
    denom = tl.sum(w, axis=0)
    part = tl.load(part_o_ptr + (base + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
                   mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    out = tl.sum(part * w[:, None], axis=0) / tl.where(denom == 0.0, 1.0, denom)
    tl.store(o_ptr + seq.to(tl.int64) * stride_ot + head * stride_oh + offs_d,
             out.to(o_ptr.dtype.element_ty), mask=d_ok)


MAX_SPLITS = 32


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(device_index).multi_processor_count
    return 132  # H100 SXM; only reached on CPU (interpreter), where it just picks a split count


def default_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device | None = None,
                       num_sms: int | None = None) -> int:
    """Split count for the decode kernel: enough (seq, head, split) programs to fill the GPU about
    twice over, but never slices shorter than 256 positions (the merge would cost more than it
    saves), capped at 32. Rounded to a power of two so a graph captured per batch size sees few
    distinct values. num_sms: the GPU's SM count when known without asking CUDA (the precompile
    children); otherwise that of `device`."""
    if num_sms is None:
        cuda_index = device is not None and device.type == "cuda" and device.index is not None
        num_sms = _num_sms(device.index if cuda_index else 0)
    want = triton.cdiv(2 * num_sms, max(1, num_seqs * num_kv_heads))
    by_len = triton.cdiv(max(1, max_seq_len), 256)
    n = max(1, min(want, by_len, MAX_SPLITS))
    return 1 << (n - 1).bit_length() if n & (n - 1) else n


def _decode_config(head_dim: int) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) for the decode split kernel."""
    # Tuned on H100 (bf16, D=128, block_size 16): BLOCK_N 64 with 3 stages keeps ~2.8-2.9 TB/s from
    # B=1 x 32k (32 splits) to B=128 x 1k; BLOCK_N 32 lost up to 20% on large batches.
    return 64, 4, 3


def paged_decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, seq_lens: torch.Tensor,
                           block_tables: torch.Tensor, max_seq_len: int, scale: float,
                           num_splits: int | None = None, out: torch.Tensor | None = None,
                           k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                           sliding_window: int | None = None, soft_cap: float | None = None,
                           pos_bias: torch.Tensor | None = None) -> torch.Tensor:
    """Decode attention, one query token per sequence: q [B, Hq, D] (row b belongs to sequence b,
    the token at position seq_lens[b] - 1); returns [B, Hq, D]. Split-K over the context with
    num_splits slices (default from default_num_splits; pass a fixed value for CUDA-graph capture).
    Sequences with seq_len == 0 (padding) produce zeros. An FP8 cache is read with k_scale / v_scale
    (one-element fp32; None: 1.0). sliding_window / soft_cap: the layer's window and logit cap (module
    docstring); the splits then divide only the window, and None is no window / no cap. pos_bias:
    [Hq, max_len] fp32 relative position bias (module docstring). With seq_lens holding encoder
    lengths this is also cross-attention's decode step: the one query sees all seq_lens[b] keys.
    """
    num_seqs, num_heads, num_kv_heads, head_dim = _check_common(q, kv_cache)
    assert seq_lens.shape[0] == num_seqs, (seq_lens.shape, q.shape)
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.stride(-1) == 1
    if num_seqs == 0:
        return out
    assert block_tables.stride(-1) == 1
    if num_splits is None:
        # A window bounds what each query reads: split for that length, not the whole context.
        num_splits = default_num_splits(num_seqs, num_kv_heads, min(max_seq_len, sliding_window or max_seq_len),
                                        q.device)
    assert 1 <= num_splits <= MAX_SPLITS
    group = num_heads // num_kv_heads
    block_h = max(16, triton.next_power_of_2(group))  # tl.dot needs >= 16 rows; extra rows are masked
    block_n, num_warps, num_stages = _decode_config(head_dim)
    if num_splits > 1:
        part_o = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=q.device)
    else:
        part_o = part_lse = out  # unused by the kernel when NUM_SPLITS == 1
    assert num_seqs < 65536, "the grid's second dimension holds the sequences"
    fp8, k_scale, v_scale = fp8_scales(kv_cache, k_scale, v_scale)
    _decode_split_kernel[(num_kv_heads, num_seqs, num_splits)](
        q, out, part_o, part_lse, kv_cache, seq_lens, block_tables, k_scale, v_scale,
        qk_scale=scale * _LOG2E, **_window_args(sliding_window, soft_cap),
        **_bias_args(pos_bias, num_heads, soft_cap, kv_cache),
        stride_qt=q.stride(0), stride_qh=q.stride(1), stride_ot=out.stride(0), stride_oh=out.stride(1),
        stride_cb=kv_cache.stride(0), stride_ckv=kv_cache.stride(1), stride_cs=kv_cache.stride(2),
        stride_ch=kv_cache.stride(3), stride_bt=block_tables.stride(0),
        num_heads=num_heads, BLOCK_SIZE=kv_cache.shape[2],
        GROUP=group, BLOCK_H=block_h, BLOCK_N=block_n, HEAD_DIM=head_dim,
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        SPLIT=num_splits > 1, DOT_PRECISION=_dot_precision(q.dtype), KV_FP8=fp8,
        num_warps=num_warps, num_stages=num_stages,
    )
    if num_splits > 1:
        _decode_reduce_kernel[(num_heads, num_seqs)](
            out, part_o, part_lse, out.stride(0), out.stride(1), num_heads, num_splits,
            SPLITS_PAD=MAX_SPLITS, HEAD_DIM=head_dim, HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
            num_warps=1 if head_dim <= 64 else 2,
        )
    return out
