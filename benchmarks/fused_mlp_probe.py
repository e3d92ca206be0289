"""Is a Triton gate_up GEMM with silu * mul in its epilogue faster than cuBLAS + a separate kernel?

The MLP's first matmul writes [T, 2 * I] (gate and up), and an element-wise kernel reads it back to
write silu(gate) * up [T, I]. A kernel that computes a tile of gate and the matching tile of up
together can apply silu * mul before it stores, skipping that round trip (at T = 16384 and the 8B
shape, ~1.4 GB of traffic per layer). Worth it only if its matmul keeps up with cuBLAS.

    python benchmarks/fused_mlp_probe.py [--rows 1000,3000,16384]

Checks the fused kernel against torch on each shape, then times cuBLAS gate_up + silu * mul against
the fused kernel's configurations, each inside a CUDA graph. Mind the baseline: its silu * mul is
eager torch (two passes), where the engine's compiled layers run one Inductor kernel, so the gain
printed here overstates the engine's (see BENCHMARKS.md, fifth session: none end to end).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from profile_step import replay_ms  # noqa: E402

HIDDEN, INTER = 4096, 14336


@triton.jit
def _gate_up_silu_kernel(x_ptr, w_ptr, out_ptr, M, N, K: tl.constexpr,
                         stride_xm, stride_wn, stride_om,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         GROUP_M: tl.constexpr):
    # w is the merged [2N, K] weight: gate rows 0..N-1, up rows N..2N-1 (nn.Linear layout).
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    group = GROUP_M * num_n  # grouped order: programs of one group share weight tiles in L2
    first_m = (pid // group) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group) % size_m
    pid_n = (pid % group) // size_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    g_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    u_rows = w_ptr + (offs_n[:, None] + N).to(tl.int64) * stride_wn
    m_ok = offs_m[:, None] < M
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, K // BLOCK_K):
        k = kb * BLOCK_K
        x = tl.load(x_rows + (k + offs_k)[None, :], mask=m_ok, other=0.0)
        wg = tl.load(g_rows + (k + offs_k)[None, :])
        wu = tl.load(u_rows + (k + offs_k)[None, :])
        acc_g = tl.dot(x, tl.trans(wg), acc_g)
        acc_u = tl.dot(x, tl.trans(wu), acc_u)
    out = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    tl.store(out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :],
             out.to(out_ptr.dtype.element_ty), mask=m_ok)


def gate_up_silu(x: torch.Tensor, w: torch.Tensor, block_m: int, block_n: int, block_k: int,
                 num_warps: int, num_stages: int, group_m: int = 8) -> torch.Tensor:
    M, K = x.shape
    N = w.shape[0] // 2
    assert N % block_n == 0 and K % block_k == 0
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(M, block_m) * (N // block_n),)
    _gate_up_silu_kernel[grid](x, w, out, M, N, K, x.stride(0), w.stride(0), out.stride(0),
                               BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m,
                               num_warps=num_warps, num_stages=num_stages)
    return out


def reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    gu = F.linear(x, w)
    return F.silu(gu[:, :INTER]) * gu[:, INTER:]


def graph_ms(fn) -> float:
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return replay_ms(g)


CONFIGS = [  # (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)
    (128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 64, 64, 4, 4), (128, 128, 32, 8, 4),
    (64, 128, 64, 4, 4), (128, 64, 64, 8, 3), (256, 64, 64, 8, 3), (64, 64, 64, 4, 5),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1000,3000,16384")
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)
    torch.manual_seed(0)
    ws = [torch.randn(2 * INTER, HIDDEN, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(3)]
    for m in (int(v) for v in args.rows.split(",")):
        x = torch.randn(m, HIDDEN, device="cuda", dtype=torch.bfloat16)
        flops = 2 * m * HIDDEN * 2 * INTER
        ref = reference(x, ws[0])
        base = graph_ms(lambda: [reference(x, w) for w in ws]) / len(ws)
        mm = graph_ms(lambda: [F.linear(x, w) for w in ws]) / len(ws)
        print(f"rows {m}: cuBLAS gate_up {mm:.3f} ms ({flops / mm / 1e9:.0f} TFLOP/s), + silu*mul {base:.3f} ms")
        best = None
        for cfg in CONFIGS:
            try:
                out = gate_up_silu(x, ws[0], *cfg)
                err = float((out.float() - ref.float()).abs().max() / ref.float().abs().max())
                t = graph_ms(lambda: [gate_up_silu(x, w, *cfg) for w in ws]) / len(ws)
            except Exception as e:  # noqa: BLE001 - a probe: report the configuration and go on
                print(f"  {cfg}: failed {e!r}"[:200])
                continue
            print(f"  fused {cfg}: {t:.3f} ms ({flops / t / 1e9:.0f} TFLOP/s), rel err {err:.2e}", flush=True)
            best = min(best or (t, cfg), (t, cfg))
        if best:
            print(f"rows {m}: best fused {best[0]:.3f} ms {best[1]} vs cuBLAS + silu*mul {base:.3f} ms "
                  f"({(best[0] / base - 1) * 100:+.1f}%)", flush=True)


if __name__ == "__main__":
    main()
