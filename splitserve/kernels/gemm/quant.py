"""Per-token activation quantization for the W8A8 GEMMs, FP8 (e4m3) and INT8 alike: one kernel, one
function, the target dtype a parameter.

    FP8:  s = max(amax, 1e-10) / 448,          q = clamp(x * (448 / max(amax, 1e-10)), -448, 448)
    INT8: s = amax / 127.5 (the fp32 eps if 0), q = clamp(round_half_even(x / s), -128, 127)

with every division rounded once (div_rn): the definitions of reference.fp8_quantize_ref and
reference.int8_quantize_ref, which the tests compare with bit for bit. A static per-tensor scale s
(a checkpoint's input_scale) replaces the row's: FP8 multiplies by 1 / s, INT8 divides by s.

`_scale` and `_quantize` are the same rules as jitted helpers: act_quant.py's fused
silu-mul-quantize kernel calls them too, so the two quantizations agree by construction.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
FP8_SCALE_EPS = 1e-10   # an all-zero row gets this amax, so its scale is never 0
INT8_HALF_RANGE = 127.5
INT8_SCALE_EPS = float(torch.finfo(torch.float32).eps)  # layers/quantization/ops._EPS: an all-zero row's scale
QUANT_FP8, QUANT_INT8 = 1, 2  # the kernels' QUANT constexpr
# the same constants as the kernels see them (a jitted function reads globals only as constexprs)
_FP8_MAX_C = tl.constexpr(FP8_MAX)
_FP8_EPS_C = tl.constexpr(FP8_SCALE_EPS)
_INT8_HALF_C = tl.constexpr(INT8_HALF_RANGE)
_INT8_EPS_C = tl.constexpr(INT8_SCALE_EPS)
# Adding and subtracting 1.5 * 2^23 rounds an fp32 |y| < 2^22 to an integer, half to even (the fp32
# add's own rounding); libdevice.rint does the same on the GPU but has no interpreter equivalent.
_ROUND_MAGIC_C = tl.constexpr(12582912.0)

_QUANT = {FP8_DTYPE: QUANT_FP8, torch.int8: QUANT_INT8}


@triton.jit
def _scale(amax, QUANT: tl.constexpr):
    """(the row's scale, what h is multiplied (fp8) or divided (int8) by)."""
    if QUANT == 1:
        amax_c = tl.maximum(amax, _FP8_EPS_C)
        return tl.div_rn(amax_c, _FP8_MAX_C), tl.div_rn(tl.full([], _FP8_MAX_C, tl.float32), amax_c)
    else:
        s = tl.div_rn(amax, _INT8_HALF_C)
        s = tl.where(s == 0.0, _INT8_EPS_C, s)
        return s, s


@triton.jit
def _static_factor(s, QUANT: tl.constexpr):
    """What x is multiplied (fp8: 1 / s) or divided (int8: s) by under a static scale s."""
    if QUANT == 1:
        return tl.div_rn(tl.full([], 1.0, tl.float32), s)
    else:
        return s


@triton.jit
def _quantize(h, factor, QUANT: tl.constexpr):
    if QUANT == 1:
        return tl.clamp(h * factor, -_FP8_MAX_C, _FP8_MAX_C)
    else:
        y = tl.clamp(tl.div_rn(h, factor), -128.0, 127.0)  # clamped first: |y| small for the rounding
        return (y + _ROUND_MAGIC_C) - _ROUND_MAGIC_C


@triton.jit
def _quant_per_token_kernel(x_ptr, q_ptr, s_ptr, static_s_ptr, K, stride_xm, stride_qm,
                            QUANT: tl.constexpr, STATIC: tl.constexpr, BLOCK: tl.constexpr):
    # One program per token. Dynamic: a first pass finds the row's absmax, the second (from L1/L2)
    # quantizes; a row of up to BLOCK elements is read from DRAM once either way. QUANT 1 fp8, 2 int8.
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xm
    if STATIC:
        factor = _static_factor(tl.load(static_s_ptr).to(tl.float32), QUANT)
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for k0 in range(0, K, BLOCK):
            offs = k0 + tl.arange(0, BLOCK)
            x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        s, factor = _scale(tl.max(amax, axis=0), QUANT)
        tl.store(s_ptr + row, s)
    for k0 in range(0, K, BLOCK):
        offs = k0 + tl.arange(0, BLOCK)
        x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
        q = _quantize(x, factor, QUANT)
        tl.store(q_ptr + row * stride_qm + offs, q.to(q_ptr.dtype.element_ty), mask=offs < K)


def _zero_row_scale(dtype: torch.dtype) -> float:
    """The dynamic scale of a row with no elements (or all zeros), as the kernel computes it."""
    if dtype == FP8_DTYPE:  # div_rn(fp32(1e-10), 448): a tensor / tensor division rounds once, as div_rn does
        return float(torch.tensor(FP8_SCALE_EPS, dtype=torch.float32) / torch.tensor(FP8_MAX, dtype=torch.float32))
    return INT8_SCALE_EPS


def quantize_per_token(x: torch.Tensor, dtype: torch.dtype,
                       scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (bf16/fp16/fp32) -> (q [M, K] of `dtype` (torch.float8_e4m3fn or torch.int8), fp32
    scales) with x ~= q * s, in one launch (module doc for the rules).

    Dynamic (scale None): one scale per token, [M, 1]. Static: the given one-element scale (a
    checkpoint's input_scale) for every row, returned as given in the shape its GEMM takes: [1, 1]
    for FP8 (fp8_gemm), [1] for INT8 (int8_gemm)."""
    if dtype not in _QUANT:
        raise ValueError(f"dtype must be torch.float8_e4m3fn or torch.int8, got {dtype}")
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D, got shape {tuple(x.shape)}")
    M, K = x.shape
    x = x if x.stride(1) == 1 else x.contiguous()
    q = torch.empty((M, K), dtype=dtype, device=x.device)
    if scale is not None:
        if scale.numel() != 1:
            raise ValueError(f"a static activation scale must have one element, got shape {tuple(scale.shape)}")
        s_out, static = scale.reshape((1, 1) if dtype == FP8_DTYPE else (1,)).to(torch.float32), True
    else:
        s_out, static = torch.empty((M, 1), dtype=torch.float32, device=x.device), False
    if M and K:
        block = min(triton.next_power_of_2(K), 4096)
        _quant_per_token_kernel[(M,)](x, q, s_out, s_out, K, x.stride(0), q.stride(0), QUANT=_QUANT[dtype],
                                      STATIC=static, BLOCK=block, num_warps=4 if block >= 1024 else 1)
    elif M and not static:
        s_out.fill_(_zero_row_scale(dtype))
    return q, s_out
