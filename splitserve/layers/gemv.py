"""Skinny matmul for decode: y[M, N] = x[M, K] @ W[N, K]^T with M <= 16 tokens.

At small batch a decode step is a stream of weight reads, so what matters is reaching the memory
bandwidth on every weight matrix. Each program reads a BLOCK_N x (K / SPLIT_K) slab of W once,
multiplies it by all M rows of x (padded to 16 rows for the tensor cores) and writes fp32 partial
sums; the split partials are summed afterwards. SPLIT_K is chosen so that even narrow matrices
(N = 4096) give every SM several programs. Exposed as a custom op so compiled graphs treat it as opaque.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU installs without triton never call this
    triton = None

MAX_ROWS = 16

if triton is not None:
    @triton.jit(do_not_specialize=["M"])
    def _gemv_kernel(x_ptr, w_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_os, stride_om,
                     K_PER_SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
        pid_n, pid_k = tl.program_id(0), tl.program_id(1)
        offs_m = tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        k_start = pid_k * K_PER_SPLIT
        for k0 in range(0, K_PER_SPLIT, BLOCK_K):
            offs_k = k_start + k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < K
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                        mask=(offs_m[:, None] < M) & k_ok[None, :], other=0.0)
            w = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :],
                        mask=(offs_n[:, None] < N) & k_ok[None, :], other=0.0)
            acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
        out = out_ptr + pid_k * stride_os + offs_m[:, None] * stride_om + offs_n[None, :]
        tl.store(out, acc, mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":  # the CPU interpreter (tests): any small count exercises split-K
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def gemv_config(N: int, K: int, num_sms: int, block_n: int = 64, block_k: int = 128) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, SPLIT_K, K_PER_SPLIT): at least ~4 programs per SM."""
    programs_n = triton.cdiv(N, block_n)
    split = 1
    while programs_n * split < 4 * num_sms and K // (split * 2) >= 4 * block_k:
        split *= 2
    k_per_split = triton.cdiv(triton.cdiv(K, split), block_k) * block_k
    return block_n, block_k, triton.cdiv(K, k_per_split), k_per_split


def gemv(x: torch.Tensor, w: torch.Tensor, block_n: int = 64, block_k: int = 128, num_warps: int = 4,
         num_stages: int = 4) -> torch.Tensor:
    M, K = x.shape
    N = w.shape[0]
    assert M <= MAX_ROWS and w.shape[1] == K and x.stride(1) == 1 and w.stride(1) == 1
    block_n, block_k, split, k_per_split = gemv_config(N, K, _num_sms(x.device), block_n, block_k)
    partial = torch.empty((split, M, N), dtype=torch.float32, device=x.device)
    _gemv_kernel[(triton.cdiv(N, block_n), split)](
        x, w, partial, M, N, K, x.stride(0), w.stride(0), partial.stride(0), partial.stride(1),
        K_PER_SPLIT=k_per_split, BLOCK_M=MAX_ROWS, BLOCK_N=block_n, BLOCK_K=block_k,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=num_warps, num_stages=num_stages)
    return (partial[0] if split == 1 else partial.sum(0)).to(x.dtype)


@torch.library.custom_op("splitserve::skinny_linear", mutates_args=())
def skinny_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return gemv(x.contiguous(), w)


@skinny_linear.register_fake
def _(x, w):
    return x.new_empty((x.shape[0], w.shape[0]))
