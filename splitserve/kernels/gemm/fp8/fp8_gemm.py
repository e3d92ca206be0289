"""FP8 (e4m3) GEMM kernels for few-token (decode) shapes, activation quantization, and a dispatcher.

    out[M, N] = (a[M, K] * a_scale) @ (w[N, K] * w_scale).T  (+ bias)

Weights are float8_e4m3fn [N, K] (K contiguous, as checkpoints store them). Weight scales: one per
tensor ([] or [1]), one per output channel ([N] or [N, 1]), or one per 128x128 block
([ceil(N/128), ceil(K/128)], block-wise checkpoints). Scales are fp32 and dequantize: w ~= w_fp8 * s.

Activations reach the kernel in one of four modes (`A_MODE`):
  0  fp8 with one scale per token ([M, 1]) or per tensor (static), applied in the epilogue;
  1  fp8 with one scale per token and group of 128 along K ([M, ceil(K/128)]), applied per K tile;
  2  bf16/fp16, quantized inside the kernel per token and group of 128 (same numerics as mode 1 after
     quantize_fp8_per_group, without its launch and without writing the fp8 copy);
  3  bf16/fp16 kept as is: the fp8 weight tile is widened to the activation dtype (W8A16).
Decode is bound by reading the weights, so each program streams BLOCK_N weight rows along a K slice
(split-K, finished in the same launch, see _split_k.py) and the MMA is padded to BLOCK_M >= 16 rows.

fp8_linear() is the entry the linear layers call: the W8A16 GEMV of fp8_gemv.py up to FP8_GEMV_MAX_M
tokens (per-tensor / per-channel weight scales, dynamic activations), the Triton kernel up to FP8_TRITON_MAX_M tokens
(quantizing in the kernel up to FP8_GROUP_MAX_M), per-token quantization + torch._scaled_mm above,
the torch reference off CUDA. References live in
kernels/gemm/reference.py.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.kernels.gemm._split_k import num_sms, split_k_buffers, split_k_epilogue
from splitserve.kernels.gemm.fp8.fp8_gemv import GEMV_MAX_ROWS, fp8_gemv
from splitserve.kernels.gemm.quant import FP8_DTYPE, FP8_MAX, FP8_SCALE_EPS, quantize_per_token
from splitserve.kernels.gemm.tiles import TileConfig, fp8_gemm_tiles

GROUP_K = 128       # activation groups and weight blocks along K (DeepSeek-style block-wise FP8)
GROUP_N = 128       # weight blocks along N
SCALE_EPS = FP8_SCALE_EPS  # an all-zero row gets this amax, so its scale is never 0
# the same constants as the kernels see them (a jitted function reads globals only as constexprs)
_FP8_MAX_C = tl.constexpr(FP8_MAX)
_GROUP_K_C = tl.constexpr(GROUP_K)
_GROUP_N_C = tl.constexpr(GROUP_N)
_SCALE_EPS_C = tl.constexpr(SCALE_EPS)

# fp8_linear's policy, from the H100 sweep and step table (BENCHMARKS.md): up to FP8_GROUP_MAX_M
# tokens the kernel quantizes the activations itself (A_MODE 2: no extra launch; its per-tile
# quantization work grows with the rows); up to FP8_TRITON_MAX_M a per-token quantization launch +
# the kernel (A_MODE 0, the cheapest GEMM); above, per-token quantization + torch._scaled_mm.
FP8_GROUP_MAX_M = 16
FP8_TRITON_MAX_M = 64
# torch._scaled_mm's fast accumulation: Hopper's FP8 MMA keeps fewer accumulator bits, and without it
# the library promotes the partial sums to fp32 every few K steps, which costs throughput. Serving
# engines run FP8 GEMMs with fast accumulation on Hopper; measured in BENCHMARKS.md (fifteenth session).
SCALED_MM_FAST_ACCUM = True
# Up to this many tokens, with per-tensor / per-channel weight scales and no static input scale,
# fp8_linear runs the W8A16 GEMV (fp8_gemv.py: x kept in bf16/fp16, no tensor cores, no padding).
# On the H100 sweep (benchmarks/fp8_gemv.py) the 8B layers took 2.75 ms at one token against 3.44
# for the tl.dot kernel below, 2.98 against 3.34 at two; it also avoids quantizing x.
FP8_GEMV_MAX_M = 2


def fp8_route(M: int, w_mode: int, input_scale: torch.Tensor | None) -> str:
    """"gemv" where fp8_linear takes the W8A16 GEMV for M tokens (w_mode: _weight_scale_mode's
    0 per tensor, 1 per channel, 2 blocks), else "gemm" (fp8_gemm / torch._scaled_mm)."""
    if 1 <= M <= min(FP8_GEMV_MAX_M, GEMV_MAX_ROWS) and w_mode in (0, 1) and input_scale is None:
        return "gemv"
    return "gemm"


def fp8_small_m_act(M: int) -> str:
    """The activation handling fp8_linear uses for M tokens on the Triton path."""
    return "group" if M <= FP8_GROUP_MAX_M else "token"


# ---------------------------------------------------------------------------------------------
# activation quantization
# ---------------------------------------------------------------------------------------------

@triton.jit
def _quant_per_group_kernel(x_ptr, q_ptr, s_ptr, K, num_groups, stride_xm, stride_qm, stride_sm,
                            GROUP: tl.constexpr, GROUPS_PER_PROG: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1) * GROUPS_PER_PROG + tl.arange(0, GROUPS_PER_PROG)
    offs = g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    mask = offs < K
    x = tl.load(x_ptr + row * stride_xm + offs, mask=mask, other=0.0).to(tl.float32)
    amax_c = tl.maximum(tl.max(tl.abs(x), axis=1), _SCALE_EPS_C)
    s = tl.div_rn(amax_c, _FP8_MAX_C)
    q = tl.clamp(x * tl.div_rn(tl.full(amax_c.shape, _FP8_MAX_C, tl.float32), amax_c)[:, None],
                 -_FP8_MAX_C, _FP8_MAX_C)
    tl.store(q_ptr + row * stride_qm + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row * stride_sm + g, s, mask=g < num_groups)


def quantize_fp8_per_token(x: torch.Tensor, scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (bf16/fp16/fp32) -> (q float8_e4m3fn [M, K], scales fp32 [M, 1]) with x ~= q * s.

    Dynamic: s = max(|x_row|, 1e-10) / 448. With a static per-tensor `scale` (a checkpoint's
    input_scale), that one scale is used for every row and returned as given ([1, 1]).
    quant.quantize_per_token for FP8: the one per-token quantization of FP8 and INT8."""
    return quantize_per_token(x, FP8_DTYPE, scale)


def quantize_fp8_per_group(x: torch.Tensor, group: int = GROUP_K) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q float8_e4m3fn [M, K], scales fp32 [M, ceil(K/group)]), one scale per token and
    group of `group` consecutive K (the last group may be partial)."""
    _check_2d("x", x)
    if group <= 0 or group & (group - 1):
        raise ValueError(f"group must be a power of two, got {group}")
    M, K = x.shape
    x = x if x.stride(1) == 1 else x.contiguous()
    num_groups = triton.cdiv(K, group)
    q = torch.empty((M, K), dtype=FP8_DTYPE, device=x.device)
    s = torch.empty((M, num_groups), dtype=torch.float32, device=x.device)
    if M:
        gpp = min(triton.next_power_of_2(num_groups), max(1, 2048 // group))
        _quant_per_group_kernel[(M, triton.cdiv(num_groups, gpp))](
            x, q, s, K, num_groups, x.stride(0), q.stride(0), s.stride(0), GROUP=group, GROUPS_PER_PROG=gpp)
    return q, s


# ---------------------------------------------------------------------------------------------
# GEMM
# ---------------------------------------------------------------------------------------------

@triton.jit
def _fp8_gemm_kernel(
    a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, bias_ptr, out_ptr, part_ptr, count_ptr,
    M, N, K, k_per_split, num_splits,
    stride_am, stride_wn, stride_om, stride_asm, stride_wsn,
    A_MODE: tl.constexpr, W_MODE: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_SPLIT_K: tl.constexpr,
):
    # W_MODE: 0 one weight scale, 1 per output channel, 2 per 128x128 block.
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    # M tiles of one N tile are neighbours in launch order, so a weight tile read by several M
    # tiles (M > BLOCK_M) is served from L2 the second time.
    pid_m = pid % num_pid_m
    pid_n = pid // num_pid_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Rows past M / N load a valid row again (no mask on the hot loads); the store masks them.
    rows_a = (offs_m % M).to(tl.int64)
    rows_w = (offs_n % N).to(tl.int64)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)
    # Per-tile scales (token groups, weight blocks) are plain loads that Triton's pipeliner leaves
    # synchronous, so they are fetched two K tiles ahead (see wna16_gemm.py).
    last_g = tl.cdiv(K, _GROUP_K_C) - 1
    if A_MODE == 1:
        sa_cur = tl.load(a_scale_ptr + rows_a * stride_asm + tl.minimum(k_start // _GROUP_K_C, last_g))
        sa_nxt = tl.load(a_scale_ptr + rows_a * stride_asm + tl.minimum((k_start + BLOCK_K) // _GROUP_K_C, last_g))
    else:
        sa_cur = tl.zeros([BLOCK_M], tl.float32)
        sa_nxt = sa_cur
    if W_MODE == 2:
        sw_rows = w_scale_ptr + (rows_w // _GROUP_N_C) * stride_wsn
        sw_cur = tl.load(sw_rows + tl.minimum(k_start // _GROUP_K_C, last_g))
        sw_nxt = tl.load(sw_rows + tl.minimum((k_start + BLOCK_K) // _GROUP_K_C, last_g))
    else:
        sw_rows = w_scale_ptr
        sw_cur = tl.zeros([BLOCK_N], tl.float32)
        sw_nxt = sw_cur
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        g_pf = tl.minimum((k0 + 2 * BLOCK_K) // _GROUP_K_C, last_g)
        if A_MODE == 1:
            sa_pf = tl.load(a_scale_ptr + rows_a * stride_asm + g_pf)
        else:
            sa_pf = sa_cur
        if W_MODE == 2:
            sw_pf = tl.load(sw_rows + g_pf)
        else:
            sw_pf = sw_cur
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + rows_a[:, None] * stride_am + offs_k[None, :]
        w_ptrs = w_ptr + rows_w[:, None] * stride_wn + offs_k[None, :]
        if EVEN_K:
            a = tl.load(a_ptrs)
            w = tl.load(w_ptrs)
        else:
            a = tl.load(a_ptrs, mask=offs_k[None, :] < k_end, other=0.0)
            w = tl.load(w_ptrs, mask=offs_k[None, :] < k_end, other=0.0)
        if A_MODE == 3:
            part = tl.dot(a, tl.trans(w.to(a.dtype)))
        elif A_MODE == 2:
            af = a.to(tl.float32)
            amax_c = tl.maximum(tl.max(tl.abs(af), axis=1), _SCALE_EPS_C)
            s_a = tl.div_rn(amax_c, _FP8_MAX_C)
            inv_a = tl.div_rn(tl.full(amax_c.shape, _FP8_MAX_C, tl.float32), amax_c)
            aq = tl.clamp(af * inv_a[:, None], -_FP8_MAX_C, _FP8_MAX_C).to(w.dtype)
            part = tl.dot(aq, tl.trans(w)) * s_a[:, None]
        elif A_MODE == 1:
            part = tl.dot(a, tl.trans(w)) * sa_cur[:, None]
        else:
            part = tl.dot(a, tl.trans(w))
        if W_MODE == 2:
            part = part * sw_cur[None, :]
        acc += part
        sa_cur, sa_nxt = sa_nxt, sa_pf
        sw_cur, sw_nxt = sw_nxt, sw_pf
    # Scales that do not vary along K are applied once; they are linear, so before the split-K sum.
    if A_MODE == 0:
        acc *= tl.load(a_scale_ptr + rows_a * stride_asm)[:, None]
    if W_MODE == 0:
        acc *= tl.load(w_scale_ptr)
    elif W_MODE == 1:
        acc *= tl.load(w_scale_ptr + rows_w)[None, :]
    split_k_epilogue(acc, offs_m, offs_n, M, N, out_ptr, stride_om, part_ptr, count_ptr, bias_ptr,
                     pid, pid_k, num_splits, HAS_BIAS, USE_SPLIT_K)


def _weight_scale_mode(w_scale: torch.Tensor, N: int, K: int) -> int:
    if w_scale.numel() == 1:
        return 0
    if w_scale.dim() == 2 and tuple(w_scale.shape) == (triton.cdiv(N, GROUP_N), triton.cdiv(K, GROUP_K)) \
            and w_scale.shape[1] != 1:
        return 2
    if w_scale.numel() == N and (w_scale.dim() == 1 or w_scale.shape[-1] == 1):
        return 1
    raise ValueError(f"weight scale of shape {tuple(w_scale.shape)} fits no layout for a [{N}, {K}] weight: "
                     f"expected [], [1], [{N}], [{N}, 1] or [{triton.cdiv(N, GROUP_N)}, {triton.cdiv(K, GROUP_K)}]")


def fp8_gemm(a: torch.Tensor, a_scale: torch.Tensor | None, w: torch.Tensor, w_scale: torch.Tensor,
             bias: torch.Tensor | None = None, *, out_dtype: torch.dtype | None = None,
             act: str = "group", config: TileConfig | None = None) -> torch.Tensor:
    """The Triton FP8 GEMM, every activation mode (see the module docstring).

    a: float8_e4m3fn [M, K] with a_scale [M, 1] / [1] (A_MODE 0) or [M, ceil(K/128)] (A_MODE 1); or
    bf16/fp16 [M, K] with a_scale None and act "group" (A_MODE 2) or "none" (A_MODE 3).
    out_dtype defaults to bf16 for fp8 input and to a's dtype otherwise."""
    _check_2d("a", a)
    _check_2d("w", w)
    M, K = a.shape
    N = w.shape[0]
    if w.dtype != FP8_DTYPE:
        raise ValueError(f"w must be {FP8_DTYPE}, got {w.dtype}")
    if w.shape[1] != K:
        raise ValueError(f"a is [{M}, {K}] but w is {list(w.shape)}: K differs")
    if a.dtype == FP8_DTYPE:
        if a_scale is None:
            raise ValueError("fp8 activations need a_scale")
        if a_scale.numel() == 1 or tuple(a_scale.shape) == (M, 1):
            a_mode = 0
        elif tuple(a_scale.shape) == (M, triton.cdiv(K, GROUP_K)):
            a_mode = 1
        else:
            raise ValueError(f"a_scale of shape {tuple(a_scale.shape)} fits neither [M, 1] nor "
                             f"[M, ceil(K/{GROUP_K})] for M={M}, K={K}")
        out_dtype = out_dtype or torch.bfloat16
    elif a.dtype in (torch.bfloat16, torch.float16):
        if act not in ("group", "none"):
            raise ValueError(f"act must be 'group' or 'none' for {a.dtype} activations, got {act!r}")
        a_mode = 2 if act == "group" else 3
        out_dtype = out_dtype or a.dtype
    else:
        raise ValueError(f"activations must be float8_e4m3fn, bfloat16 or float16, got {a.dtype}")
    w_mode = _weight_scale_mode(w_scale, N, K)
    if bias is not None and bias.shape != (N,):
        raise ValueError(f"bias must have shape [{N}], got {tuple(bias.shape)}")
    out = torch.empty((M, N), dtype=out_dtype, device=a.device)
    if M == 0 or N == 0:
        return out
    if K == 0:
        return out.zero_() if bias is None else out.copy_(bias.expand(M, N))

    a = a if a.stride(1) == 1 else a.contiguous()
    w = w if w.stride(1) == 1 else w.contiguous()
    grouped = a_mode in (1, 2) or w_mode == 2
    cfg = config or fp8_gemm_tiles(M, N, K, a_mode, grouped, num_sms(a.device))
    if grouped and GROUP_K % cfg.block_k:
        raise ValueError(f"block_k={cfg.block_k} must divide {GROUP_K} for group or block scales")
    if a_mode == 2 and cfg.block_k != GROUP_K:
        raise ValueError(f"in-kernel group quantization needs block_k={GROUP_K}, got {cfg.block_k}")
    num_tiles = triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n)
    k_per_split, num_splits, part, counters = split_k_buffers(K, cfg.split_k, cfg.block_k, num_tiles, out)
    use_split = num_splits > 1
    # Scales should already be fp32 and contiguous (then these are no-ops, not copies).
    if a_mode == 0:
        a_s = a_scale.reshape(-1).to(torch.float32).contiguous()
        stride_asm = 0 if a_s.numel() == 1 else 1
    elif a_mode == 1:
        a_s = a_scale.to(torch.float32).contiguous()
        stride_asm = a_s.stride(0)
    else:
        a_s, stride_asm = out, 0
    w_s = (w_scale if w_mode == 2 else w_scale.reshape(-1)).to(torch.float32).contiguous()
    _fp8_gemm_kernel[(num_tiles, num_splits)](
        a, a_s, w, w_s, bias if bias is not None else out, out, part, counters,
        M, N, K, k_per_split, num_splits,
        a.stride(0), w.stride(0), out.stride(0), stride_asm, w_s.stride(0) if w_mode == 2 else 0,
        A_MODE=a_mode, W_MODE=w_mode, HAS_BIAS=bias is not None,
        EVEN_K=K % cfg.block_k == 0 and k_per_split % cfg.block_k == 0,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, USE_SPLIT_K=use_split,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out


# ---------------------------------------------------------------------------------------------
# dispatcher
# ---------------------------------------------------------------------------------------------

def fp8_linear(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None,
               *, input_scale: torch.Tensor | None = None, small_m_act: str | None = None,
               triton_max_m: int | None = None) -> torch.Tensor:
    """y = x @ dequant(w).T + bias for bf16/fp16 x [..., K], w float8_e4m3fn [N, K] (see module doc).

    Up to FP8_GEMV_MAX_M tokens (fp8_route) the W8A16 GEMV, x unquantized (unless small_m_act is given).
    Activations are quantized dynamically: up to FP8_GROUP_MAX_M tokens per token and 128-group
    inside the kernel, above that per token (small_m_act overrides the small-M choice: "group",
    "token" or "none" = W8A16). A static per-tensor `input_scale` (a checkpoint's) is used as given.
    Block scales ([ceil(N/128), ceil(K/128)]) always quantize per token and 128-group. Off CUDA (CPU
    tests) the torch reference computes the same function."""
    from splitserve.kernels.gemm import reference

    if x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"fp8_linear takes bf16/fp16 activations, got {x.dtype}")
    lead, K = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, K)
    M, N = x2.shape[0], w.shape[0]
    w_mode = _weight_scale_mode(w_scale, N, K) if w.dim() == 2 else -1
    # K % 16: 16-byte aligned weight rows (every model layer; others would load byte by byte)
    if small_m_act is None and K % 16 == 0 and fp8_route(M, w_mode, input_scale) == "gemv":
        # W8A16: x is not quantized (more accurate than the W8A8 paths); off CUDA the same function
        out = reference.fp8_gemv_ref(x2, w, w_scale, bias) if x.device.type != "cuda" else fp8_gemv(x2, w, w_scale, bias)
        return out.reshape(*lead, N)
    max_m = FP8_TRITON_MAX_M if triton_max_m is None else triton_max_m
    if w_mode == 2:
        act = "group"
    elif input_scale is not None or M > max_m:
        act = "token"
    else:
        act = small_m_act or fp8_small_m_act(M)
    if x.device.type != "cuda":
        out = reference.fp8_linear_ref(x2, w, w_scale, bias, act=act, input_scale=input_scale)
    elif act in ("group", "none") and M <= max_m:
        out = fp8_gemm(x2, None, w, w_scale, bias, act=act)
    elif act == "group":  # block scales, many tokens
        q, s = quantize_fp8_per_group(x2)
        out = fp8_gemm(q, s, w, w_scale, bias, out_dtype=x.dtype)
    elif M <= max_m:
        q, s = quantize_fp8_per_token(x2, input_scale)
        out = fp8_gemm(q, s, w, w_scale, bias, out_dtype=x.dtype)
    else:
        q, s = quantize_fp8_per_token(x2, input_scale)
        out = scaled_mm_linear(q, s, w, w_scale, bias, x.dtype)
    return out.reshape(*lead, N)


def scaled_mm_linear(q: torch.Tensor, s: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                     bias: torch.Tensor | None, out_dtype: torch.dtype, fast_accum: bool | None = None) -> torch.Tensor:
    """torch._scaled_mm with row-wise scales; M is padded to a multiple of 16 if needed. fast_accum:
    None takes SCALED_MM_FAST_ACCUM."""
    M, N = q.shape[0], w.shape[0]
    pad = -M % 16
    if pad:
        q = torch.cat([q, q.new_zeros((pad, q.shape[1]))])
    scale_a = s.expand(M, 1) if s.numel() == 1 else s
    if pad:
        scale_a = torch.cat([scale_a, scale_a.new_ones((pad, 1))])
    scale_b = w_scale.reshape(1, -1).to(torch.float32).expand(1, N).contiguous()
    fast = SCALED_MM_FAST_ACCUM if fast_accum is None else fast_accum
    out = torch._scaled_mm(q, w.t(), scale_a=scale_a.contiguous(), scale_b=scale_b, out_dtype=out_dtype,
                           use_fast_accum=fast)
    out = out[:M] if pad else out
    return out + bias if bias is not None else out


def _check_2d(name: str, t: torch.Tensor) -> None:
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D, got shape {tuple(t.shape)}")
