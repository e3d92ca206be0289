"""Plain torch references for the quantized GEMM kernels: the definitions the kernels are tested
against, and the CPU path of fp8_linear / wna16_linear (FP8 emulated: quantize, dequantize, fp32
matmul) and of act_quant's silu-mul dispatchers (with INT8's exact integer matmul). Nothing here
calls Triton."""
from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
GROUP_K = 128
GROUP_N = 128
SCALE_EPS = 1e-10


def fp8_quantize_ref(x: torch.Tensor, group: int | None = None,
                     static_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q fp8 [M, K], fp32 scales): per token ([M, 1]), per token and `group` along K
    ([M, ceil(K/group)]), or one static scale s. With a = max(|x| over the row or group, 1e-10),
    s = a / 448 and q = clamp(x * (448 / a), -448, 448) rounded to nearest even (a multiply by the
    fp32 reciprocal, as the kernels do it: one division per row, not per element); static:
    q = clamp(x * (1 / s))."""
    xf = x.to(torch.float32)
    M, K = xf.shape
    if static_scale is not None:
        s = static_scale.reshape(1, 1).to(torch.float32)
        return (xf * _div(1.0, s)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), s
    if group is None:
        a = xf.abs().amax(dim=1, keepdim=True).clamp(min=SCALE_EPS)
        return (xf * _div(FP8_MAX, a)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), a / torch.full_like(a, FP8_MAX)
    ng = -(-K // group)
    padded = torch.nn.functional.pad(xf, (0, ng * group - K)).view(M, ng, group)
    a = padded.abs().amax(dim=2).clamp(min=SCALE_EPS)
    q = (padded * _div(FP8_MAX, a)[:, :, None]).clamp(-FP8_MAX, FP8_MAX).reshape(M, ng * group)[:, :K]
    return q.to(FP8_DTYPE), a / torch.full_like(a, FP8_MAX)


def _div(num: float, t: torch.Tensor) -> torch.Tensor:
    """num / t rounded once, as the kernels' div_rn does it (torch computes `num / t` as
    t.reciprocal() * num, and a division by a Python scalar on CUDA as a multiply by its
    reciprocal: each rounds twice and can be one ulp off; tensor / tensor divides)."""
    return torch.full_like(t, num) / t


def _expand_groups(s: torch.Tensor, rows: int, cols: int, row_group: int, col_group: int) -> torch.Tensor:
    return s.repeat_interleave(row_group, 0)[:rows].repeat_interleave(col_group, 1)[:, :cols]


def fp8_dequant_ref(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """fp8 [R, K] with a scale of one element, [R] / [R, 1], [R, ceil(K/128)] (token groups) or
    [ceil(R/128), ceil(K/128)] (weight blocks) -> fp32 [R, K]."""
    R, K = q.shape
    qf, s = q.to(torch.float32), s.to(torch.float32)
    if s.numel() == 1:
        return qf * s.reshape(())
    if s.numel() == R and (s.dim() == 1 or s.shape[-1] == 1):
        return qf * s.reshape(R, 1)
    if s.dim() == 2 and s.shape[0] == R:
        return qf * _expand_groups(s, R, K, 1, GROUP_K)
    if s.dim() == 2 and tuple(s.shape) == (-(-R // GROUP_N), -(-K // GROUP_K)):
        return qf * _expand_groups(s, R, K, GROUP_N, GROUP_K)
    raise ValueError(f"scale shape {tuple(s.shape)} does not fit [{R}, {K}]")


def fp8_gemm_ref(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                 bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """(a * a_scale) @ (w * w_scale).T + bias, in fp32, cast to out_dtype."""
    out = fp8_dequant_ref(a, a_scale) @ fp8_dequant_ref(w, w_scale).t()
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out.to(out_dtype)


def fp8_linear_ref(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None,
                   *, act: str = "token", input_scale: torch.Tensor | None = None) -> torch.Tensor:
    """What fp8_linear computes for x [M, K]: act "token" (per-token dynamic, or the static
    input_scale), "group" (per token and 128-group), or "none" (W8A16: x kept, the weight dequantized)."""
    if act == "none":
        out = x.to(torch.float32) @ fp8_dequant_ref(w, w_scale).t()
        if bias is not None:
            out = out + bias.to(torch.float32)
        return out.to(x.dtype)
    if act not in ("token", "group"):
        raise ValueError(f"act must be 'token', 'group' or 'none', got {act!r}")
    q, s = fp8_quantize_ref(x, GROUP_K if act == "group" else None, input_scale)
    return fp8_gemm_ref(q, s, w, w_scale, bias, x.dtype)


def fp8_gemv_ref(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """What fp8_gemv computes (W8A16): x [M, K] kept as is, w fp8 [N, K] times its per-tensor or
    per-channel scale, fp32 matmul + bias, one rounding to x's dtype (= fp8_linear_ref act "none")."""
    return fp8_linear_ref(x, w, w_scale, bias, act="none")


def quantize_fp8_weight_ref(w: torch.Tensor, block: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense [N, K] -> (fp8 [N, K], fp32 scales): per output channel [N, 1], or per 128x128 block."""
    wf = w.to(torch.float32)
    N, K = wf.shape
    if not block:
        s = wf.abs().amax(dim=1, keepdim=True).clamp(min=SCALE_EPS) / FP8_MAX
        return (wf / s).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), s
    nb, kb = -(-N // GROUP_N), -(-K // GROUP_K)
    padded = torch.nn.functional.pad(wf, (0, kb * GROUP_K - K, 0, nb * GROUP_N - N))
    blocks = padded.view(nb, GROUP_N, kb, GROUP_K)
    s = blocks.abs().amax(dim=(1, 3)).clamp(min=SCALE_EPS) / FP8_MAX
    q = (blocks / s[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).reshape(nb * GROUP_N, kb * GROUP_K)[:N, :K]
    return q.to(FP8_DTYPE), s


def wna16_dequant_ref(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, *,
                      bits: int, group_size: int) -> torch.Tensor:
    """Canonical packed weight (wna16_layout.py) -> fp32 [N, K] in packed K order. Written apart from
    wna16_layout's helpers: one shift per K offset within a word, no shared code with the packers."""
    P = 32 // bits
    Kw, N = qweight.shape
    # K offset r within a word sits at value position j: int4 interleaves (r = 2s -> s, 2s + 1 -> s + 4)
    position = [r // 2 + 4 * (r % 2) for r in range(8)] if bits == 4 else list(range(4))
    cols = [(qweight >> (bits * position[r])) & ((1 << bits) - 1) for r in range(P)]
    q = torch.stack(cols, dim=1).reshape(Kw * P, N).to(torch.float32)  # [K, N]
    g = torch.arange(Kw * P, device=q.device) // group_size
    zero = zeros.to(torch.float32)[g] if zeros is not None else float(1 << (bits - 1))
    return ((q - zero) * scales.to(torch.float32)[g]).t()


def wna16_gemm_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                   *, bits: int, group_size: int, perm: torch.Tensor | None = None,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ W.T + bias in fp32 (x's columns taken in packed order x[:, perm])."""
    xf = x.to(torch.float32)
    if perm is not None:
        xf = xf[:, perm.long()]
    out = xf @ wna16_dequant_ref(qweight, scales, zeros, bits=bits, group_size=group_size).t()
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """[gate | up] -> silu(gate) * up computed in fp32 and rounded once to the input dtype: what
    Inductor's kernel for activation.silu_and_mul computes (eager torch also rounds silu(gate))."""
    g, u = gate_up.to(torch.float32).chunk(2, dim=-1)
    return (torch.nn.functional.silu(g) * u).to(gate_up.dtype)


INT8_HALF_RANGE = 127.5


def int8_quantize_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] -> (int8 [M, K], fp32 [M, 1]): s = absmax / 127.5 (the fp32 eps for a zero row),
    q = clamp(round_half_even(x / s), -128, 127), true divisions (ops.int8_quantize_per_token's rule)."""
    xf = x.to(torch.float32)
    s = xf.abs().amax(dim=1, keepdim=True) / torch.full((1, 1), INT8_HALF_RANGE, device=x.device)
    s = torch.where(s == 0, torch.full_like(s, torch.finfo(torch.float32).eps), s)
    return torch.round(xf / s).clamp(-128, 127).to(torch.int8), s


def int8_linear_ref(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """What int8_linear computes for x [M, K] with dynamic per-token activations and w int8 [N, K]:
    the exact int32 accumulator, then (acc * x_scale) * w_scale + bias in fp32, one rounding to x's dtype."""
    q, s = int8_quantize_ref(x)
    acc = (q.long() @ w.long().t()).to(torch.float32)
    out = acc * s * w_scale.reshape(1, -1).to(torch.float32)
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out.to(x.dtype)
