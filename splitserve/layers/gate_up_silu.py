"""The MLP's first half in one Triton kernel: silu(x @ W_gate^T) * (x @ W_up^T).

With cuBLAS the gate/up matmul writes [T, 2I] and an element-wise kernel reads it back to write
silu(gate) * up [T, I]. Here each program computes a tile of gate and the matching tile of up from
the merged [2I, K] weight and stores only the product, so that round trip (at T = 16k and the 8B
shape, ~1.4 GB of traffic per layer) never happens. Measured on the H100
(benchmarks/fused_mlp_probe.py, 8B shape): 0.338 vs 0.422 ms at 1,000 rows, 1.125 vs 1.182 ms at
3,000, 5.90 vs 6.70 ms at 16,384. With few rows the matmul is a matrix-vector product bound by reading
the weights, where cuBLAS is faster: the model uses this kernel only from MIN_ROWS rows on.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# Below this many rows the model keeps cuBLAS + the compiled element-wise kernel (see above).
MIN_ROWS = 1024
# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages): the best of 8 configurations at 3,000 and 16,384
# rows and within 2% of the best at 1,000 (fused_mlp_probe.py on the H100).
_CONFIG = (128, 128, 64, 8, 3)


@triton.jit(do_not_specialize=["M"])
def _gate_up_silu_kernel(x_ptr, w_ptr, out_ptr, M, N: tl.constexpr, K: tl.constexpr,
                         stride_xm, stride_wn, stride_om,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         GROUP_M: tl.constexpr):
    # w is the merged [2N, K] weight: gate rows 0..N-1, up rows N..2N-1 (nn.Linear layout).
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n: tl.constexpr = N // BLOCK_N
    # Grouped order: GROUP_M row blocks run over the same weight tiles together, which stay in L2.
    group = GROUP_M * num_n
    first_m = (pid // group) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group) % size_m
    pid_n = (pid % group) // size_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m[:, None] < M
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    gate_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    up_rows = w_ptr + (offs_n[:, None] + N).to(tl.int64) * stride_wn
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, K // BLOCK_K):
        cols = (kb * BLOCK_K + offs_k)[None, :]
        x = tl.load(x_rows + cols, mask=m_ok, other=0.0)
        acc_gate = tl.dot(x, tl.trans(tl.load(gate_rows + cols)), acc_gate)
        acc_up = tl.dot(x, tl.trans(tl.load(up_rows + cols)), acc_up)
    out = acc_gate / (1.0 + tl.exp(-acc_gate)) * acc_up
    tl.store(out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :],
             out.to(out_ptr.dtype.element_ty), mask=m_ok)


def supported(weight: torch.Tensor) -> bool:
    """Whether the kernel takes this merged [2I, K] gate/up weight: 16-bit floats on CUDA (fp32 stays
    on cuBLAS, whose fp32 path the accuracy checks compare against) and tile-aligned sizes."""
    block_n, block_k = _CONFIG[1], _CONFIG[2]
    two_n, k = weight.shape
    return (weight.is_cuda and weight.dtype in (torch.bfloat16, torch.float16)
            and two_n % (2 * block_n) == 0 and k % block_k == 0 and weight.stride(1) == 1)


def gate_up_silu_triton(x: torch.Tensor, weight: torch.Tensor, config: tuple = _CONFIG) -> torch.Tensor:
    """silu(x @ W_gate^T) * (x @ W_up^T) for x [M, K] and the merged weight [2N, K]; returns [M, N]."""
    block_m, block_n, block_k, num_warps, num_stages = config
    M, K = x.shape
    N = weight.shape[0] // 2
    assert weight.shape[1] == K and N % block_n == 0 and K % block_k == 0, (x.shape, weight.shape)
    assert x.stride(1) == 1 and weight.stride(1) == 1
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return out
    grid = (triton.cdiv(M, block_m) * (N // block_n),)
    _gate_up_silu_kernel[grid](x, weight, out, M, N, K, x.stride(0), weight.stride(0), out.stride(0),
                               BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=8,
                               num_warps=num_warps, num_stages=num_stages)
    return out


# An opaque op for the compiled layers: Inductor keeps its own kernels around it.
@torch.library.custom_op("splitserve::gate_up_silu", mutates_args=())
def gate_up_silu(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return gate_up_silu_triton(x, weight)


@gate_up_silu.register_fake
def _(x, weight):
    return x.new_empty(x.shape[0], weight.shape[0] // 2)
