"""Decode-sized matmuls on the 8B shapes: cuBLAS (F.linear) vs the skinny Triton kernel.

    python benchmarks/gemv_bench.py
Prints, per shape and batch rows, the time and achieved weight-read bandwidth, then the sum over one
decode step (32 layers + LM head).
"""
import torch
import torch.nn.functional as F

from splitserve.layers.gemv import gemv

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}
PER_STEP = {"qkv": 32, "o": 32, "gate_up": 32, "down": 32, "lm_head": 1}


def bench(fn, iters=20):
    for _ in range(5):
        fn()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(iters):
            fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    g.replay()
    torch.cuda.synchronize()
    start.record()
    g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters * 1e3  # us


def main():
    torch.manual_seed(0)
    variants = {"cublas": None}
    for bn in (16, 32, 64, 128):
        for bk in (64, 128, 256, 512):
            for st in (2, 3, 4):
                for nw in (4, 8):
                    variants[f"tri bn{bn} bk{bk} st{st} w{nw}"] = (bn, bk, nw, st)
    totals = {m: {v: 0.0 for v in variants} for m in (1, 8)}
    best_per = {1: {}, 8: {}}
    for name, (N, K) in SHAPES.items():
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02
        for m in (1, 8):
            x = torch.randn(m, K, device="cuda", dtype=torch.bfloat16)
            ref = F.linear(x, w).float()
            line = []
            for v, cfg in variants.items():
                if cfg is None:
                    us = bench(lambda: F.linear(x, w))
                else:
                    bn, bk, nw, st = cfg
                    try:
                        err = (gemv(x, w, bn, bk, nw, st).float() - ref).abs().max().item()
                        assert err < 0.05, (name, v, err)
                        us = bench(lambda: gemv(x, w, bn, bk, nw, st))
                    except Exception as e:  # e.g. out of shared memory for big tiles
                        us = float("inf")
                totals[m][v] += us * PER_STEP[name]
                line.append((us, v))
            best = min(line)
            best_per[m][name] = best[0]
            cub = line[0][0]
            print(f"{name:8s} M={m}: cublas {cub:7.1f} us ({N * K * 2 / cub / 1e6:.2f} TB/s)  best {best[1]} "
                  f"{best[0]:7.1f} us ({N * K * 2 / best[0] / 1e6:.2f} TB/s)")
    print("oracle (best variant per shape):", {m: round(sum(PER_STEP[n] * b for n, b in best_per[m].items()) / 1e3, 3)
                                                for m in (1, 8)}, "ms")
    for m in (1, 8):
        ranked = sorted((t, v) for v, t in totals[m].items())
        print(f"one decode step of matmuls, M={m}: cublas {totals[m]['cublas'] / 1e3:.3f} ms; best "
              + ", ".join(f"{v} {t / 1e3:.3f} ms" for t, v in ranked[:3]))


if __name__ == "__main__":
    main()
