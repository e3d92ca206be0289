"""silu(gate) * up fused with the per-token quantization of the down projection's input.

A gated MLP's down projection takes h = silu(gate) * up from gate_up = [gate | up] ([M, 2I]). Unfused,
one kernel writes h in bf16 ([M, I]) and the per-token quantizer reads it back to write fp8 / int8;
here one kernel reads gate_up once and writes q [M, I] (float8_e4m3fn or int8) and the per-token
scales [M, 1] fp32, saving a bf16 write and read of [M, I] per layer.

Numbers: h is computed in fp32 and rounded once to the input dtype, h = dtype(silu(g) * u) with
silu(g) = g / (1 + exp(-g)), which is what Inductor's kernel for activation.silu_and_mul computes in
the engine's compiled layers (it keeps silu(g) in fp32; eager torch rounds it to bf16 first and differs
by one bf16 ulp on about a quarter of the elements). The quantization of h is the per-token
quantizer's exactly, the same jitted rules (quant.py's _scale and _quantize): fp8 s = max(amax, 1e-10) / 448,
q = clamp(h * (448 / amax)); int8 s = amax / 127.5 (the fp32 eps for a zero row),
q = clamp(round_half_even(h / s), -128, 127); true divisions. silu's exp and division are the GPU's
fast ones (ex2.approx, the approximate reciprocal; Inductor's tl.sigmoid uses the same), within a few
fp32 ulps of torch's: that moves h by one bf16 ulp on about one element in 10^4 (the interpreter's
numpy arithmetic: rarer still). Given the same h the results are bit for bit the quantizers'.

The dispatchers (silu_mul_fp8_linear, silu_mul_int8_linear) compute down(silu(gate) * up) for the FP8
and INT8 methods' custom ops; off CUDA they compute the same function with the torch references.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.kernels.gemm import reference
from splitserve.kernels.gemm.fp8.fp8_gemm import (FP8_GROUP_MAX_M, FP8_TRITON_MAX_M, fp8_gemm, fp8_linear,
                                                  scaled_mm_linear)
from splitserve.kernels.gemm.int8 import int8_gemm as I8
from splitserve.kernels.gemm.quant import FP8_DTYPE, QUANT_FP8, QUANT_INT8, _quantize, _scale

# Rows up to this many elements are held in registers whole (one pass over DRAM, silu computed once);
# longer rows take two passes (below). 16384 covers I = 14336 (Llama-3-8B / Mistral-7B) on one rank.
ONE_PASS_MAX = 16384


@triton.jit
def _silu_mul(x_row, offs, I):
    """h for the columns offs of one row, in the input dtype (0 past I)."""
    mask = offs < I
    g = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_row + I + offs, mask=mask, other=0.0).to(tl.float32)
    # `/` is the GPU's fast division (within 2 ulp), as in tl.sigmoid, which Inductor's silu uses
    return (g / (1.0 + tl.exp(-g)) * u).to(x_row.dtype.element_ty)


@triton.jit
def _silu_mul_kernel(x_ptr, h_ptr, I, stride_xm, stride_hm, BLOCK: tl.constexpr):
    # h itself (the few-token FP8 path's input): programs over rows x column blocks, so that one
    # decode token's row is spread over the SMs as Inductor's pointwise kernel spreads it.
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    tl.store(h_ptr + row * stride_hm + offs, _silu_mul(x_ptr + row * stride_xm, offs, I), mask=offs < I)


@triton.jit
def _silu_mul_quant_kernel(x_ptr, q_ptr, s_ptr, I, stride_xm, stride_qm,
                           QUANT: tl.constexpr, BLOCK: tl.constexpr, ONE_PASS: tl.constexpr):
    # One program per token (row); QUANT 1 fp8, 2 int8.
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xm
    q_row = q_ptr + row * stride_qm
    if ONE_PASS:
        # The whole row in registers (BLOCK >= I), so gate and up are read from DRAM once and silu is
        # computed once. h is held in the input dtype (exact, it was rounded to it): for I = 14336 at
        # 16 warps that is ~51 registers a thread (sm_90a), two programs to an SM, so one row's loads
        # overlap another's arithmetic. Recomputing silu in a second pass instead would double the
        # exp and the division per element, ~30 instructions each at fp8: at DRAM speed (~600 G
        # elements/s on an H100) two passes would need more than the SMs' issue rate.
        offs = tl.arange(0, BLOCK)
        h = _silu_mul(x_row, offs, I)
        s, factor = _scale(tl.max(tl.abs(h.to(tl.float32)), axis=0), QUANT)
        tl.store(s_ptr + row, s)
        tl.store(q_row + offs, _quantize(h.to(tl.float32), factor, QUANT).to(q_ptr.dtype.element_ty), mask=offs < I)
    else:
        # Rows too long for registers: the amax pass, then the quantizing pass re-reads gate and up
        # (from L2: the rows in flight are a few MB against the H100's 50 MB) and recomputes h, the
        # same function, so the same values.
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for k0 in range(0, I, BLOCK):
            amax = tl.maximum(amax, tl.abs(_silu_mul(x_row, k0 + tl.arange(0, BLOCK), I).to(tl.float32)))
        s, factor = _scale(tl.max(amax, axis=0), QUANT)
        tl.store(s_ptr + row, s)
        for k0 in range(0, I, BLOCK):
            offs = k0 + tl.arange(0, BLOCK)
            q = _quantize(_silu_mul(x_row, offs, I).to(tl.float32), factor, QUANT)
            tl.store(q_row + offs, q.to(q_ptr.dtype.element_ty), mask=offs < I)


def _check(gate_up: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    if gate_up.dim() != 2:
        raise ValueError(f"gate_up must be 2-D [tokens, 2 * intermediate], got shape {tuple(gate_up.shape)}")
    if gate_up.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"gate_up must be bfloat16, float16 or float32, got {gate_up.dtype}")
    M, two_i = gate_up.shape
    if two_i % 2 or two_i == 0:
        raise ValueError(f"gate_up's last dimension holds [gate | up]: it must be even and nonzero, got {two_i}")
    return (gate_up if gate_up.stride(1) == 1 else gate_up.contiguous()), M, two_i // 2


def silu_mul_quant_per_token(gate_up: torch.Tensor, dtype: torch.dtype, *,
                             num_warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """gate_up [M, 2I] = [gate | up] (bf16/fp16/fp32) -> (q [M, I] of `dtype` (torch.float8_e4m3fn or
    torch.int8), fp32 scales [M, 1]) with q * s ~= silu(gate) * up (module doc), in one launch.
    num_warps overrides the launch's (benchmarks)."""
    if dtype not in (FP8_DTYPE, torch.int8):
        raise ValueError(f"dtype must be torch.float8_e4m3fn or torch.int8, got {dtype}")
    x, M, I = _check(gate_up)
    q = torch.empty((M, I), dtype=dtype, device=x.device)
    s = torch.empty((M, 1), dtype=torch.float32, device=x.device)
    if M:
        one_pass = triton.next_power_of_2(I) <= ONE_PASS_MAX
        block = triton.next_power_of_2(I) if one_pass else 4096
        _silu_mul_quant_kernel[(M,)](x, q, s, I, x.stride(0), q.stride(0),
                                     QUANT=QUANT_FP8 if dtype == FP8_DTYPE else QUANT_INT8,
                                     BLOCK=block, ONE_PASS=one_pass,
                                     num_warps=num_warps or max(1, min(16, block // 1024)))
    return q, s


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [M, 2I] -> h = silu(gate) * up [M, I] in gate_up's dtype, the h the quantizing kernel
    quantizes (one launch; the few-token FP8 path feeds it to the GEMM that quantizes per group)."""
    x, M, I = _check(gate_up)
    h = torch.empty((M, I), dtype=x.dtype, device=x.device)
    if M:
        block = min(1024, triton.next_power_of_2(I))
        _silu_mul_kernel[(M, triton.cdiv(I, block))](x, h, I, x.stride(0), h.stride(0), BLOCK=block,
                                                     num_warps=max(1, block // 256))
    return h


# ---------------------------------------------------------------------------------------------
# down(silu(gate) * up) for the FP8 and INT8 methods' custom ops
# ---------------------------------------------------------------------------------------------

def silu_mul_fp8_linear(gate_up: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                        bias: torch.Tensor | None = None, *, kernels: bool | None = None) -> torch.Tensor:
    """fp8_linear(silu(gate) * up, w, w_scale, bias) for gate_up [M, 2I] (bf16/fp16), w float8_e4m3fn
    [N, I] with one scale per tensor or per output channel (not blocks), dynamic activations.

    Up to FP8_GROUP_MAX_M tokens h is written (silu_mul) for fp8_linear's kernel, which quantizes per
    token and 128-group itself; above, one launch quantizes per token, then the Triton GEMM (up to
    FP8_TRITON_MAX_M tokens) or torch._scaled_mm: fp8_linear's own choices on the same h. kernels:
    run the Triton kernels (None: on CUDA; True on CPU under TRITON_INTERPRET=1 for tests); without,
    the torch references."""
    M = gate_up.shape[0]
    if not (gate_up.is_cuda if kernels is None else kernels):
        return fp8_linear(reference.silu_mul_ref(gate_up), w, w_scale, bias)
    if M <= FP8_GROUP_MAX_M:
        return fp8_linear(silu_mul(gate_up), w, w_scale, bias)
    q, s = silu_mul_quant_per_token(gate_up, FP8_DTYPE)
    if M <= FP8_TRITON_MAX_M:
        return fp8_gemm(q, s, w, w_scale, bias, out_dtype=gate_up.dtype)
    return scaled_mm_linear(q, s, w, w_scale, bias, gate_up.dtype)


def silu_mul_int8_linear(gate_up: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                         bias: torch.Tensor | None = None, *, kernels: bool | None = None) -> torch.Tensor:
    """int8_linear(silu(gate) * up, w, w_scale, bias) with dynamic per-token activations: the fused
    quantization, then int8_gemm (its tile table by M, as int8_linear) for every token count.
    kernels: as silu_mul_fp8_linear's (without: reference.int8_linear_ref)."""
    if not (gate_up.is_cuda if kernels is None else kernels):
        return reference.int8_linear_ref(reference.silu_mul_ref(gate_up), w, w_scale, bias)
    q, s = silu_mul_quant_per_token(gate_up, torch.int8)
    return I8.int8_gemm(q, s, w, w_scale, bias, out_dtype=gate_up.dtype)
