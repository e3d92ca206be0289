"""The 8B layer's matmuls at a step's token counts: cuBLAS against cuBLASLt (torch's two BLAS paths).

    python benchmarks/gemm_table.py [--rows 1000,2048,3000,16384]

Each matmul is timed inside a CUDA graph (20 replays of 5 calls, as a step replays them), with the
weights of several layers rotating so nothing is served from L2. Prints TFLOP/s per shape and
library and the time of one layer's four matmuls with each library and with the better one per shape.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from profile_step import capture_graph, replay_ms  # noqa: E402

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}


def time_linear(x: torch.Tensor, weights: list[torch.Tensor], library: str) -> float:
    torch.backends.cuda.preferred_blas_library(library)
    g = capture_graph(lambda: [F.linear(x, w) for w in weights])
    return replay_ms(g) / len(weights)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="512,1000,1024,2048,3000,4096,8192,16384")
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__)
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights = {name: [torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02 for _ in range(5)]
               for name, (k, n) in SHAPES.items()}
    print(f"{'rows':>6} {'shape':>8} {'cublas ms':>10} {'TFLOP/s':>8} {'lt ms':>8} {'TFLOP/s':>8}")
    for m in (int(v) for v in args.rows.split(",")):
        totals = {"cublas": 0.0, "cublaslt": 0.0, "best": 0.0}
        for name, (k, n) in SHAPES.items():
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
            t = {lib: time_linear(x, weights[name], lib) for lib in ("cublas", "cublaslt")}
            flops = 2 * m * k * n
            print(f"{m:6d} {name:>8} {t['cublas']:10.4f} {flops / t['cublas'] / 1e9:8.0f} "
                  f"{t['cublaslt']:8.4f} {flops / t['cublaslt'] / 1e9:8.0f}")
            for lib in ("cublas", "cublaslt"):
                totals[lib] += t[lib]
            totals["best"] += min(t.values())
        print(f"{m:6d} {'layer':>8} cublas {totals['cublas']:.4f} ms, cublaslt {totals['cublaslt']:.4f} ms, "
              f"best per shape {totals['best']:.4f} ms", flush=True)
    torch.backends.cuda.preferred_blas_library("cublas")


if __name__ == "__main__":
    main()
