"""The floor under a batch-1 decode step of the Llama-3-8B shape: its matmuls alone, and its attention.

    python benchmarks/decode_floor.py

1. Every matmul of one decode step (32 layers of qkv, o, gate_up, down, then the LM head; 15 GB of
   distinct bf16 weights, so nothing comes from L2) captured in one CUDA graph at M rows, with
   cuBLAS and with cuBLASLt, and with o_proj as mm or as addmm (the residual added by cuBLAS).
   Prints ms per step, the weight-read rate, and the device operations per replay.
2. The split-K decode attention kernel at the batch-2 graph's shape (one sequence, one padding row)
   in a graph of 32 calls (one per layer, each with its own cache), per split count and context.
"""
from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from profile_step import capture_graph, replay_ms  # noqa: E402

from splitserve.kernels.attention.paged_attention import paged_decode_attention  # noqa: E402

LAYERS, HIDDEN, INTER, VOCAB = 32, 4096, 14336, 128256
HQ, HKV, D, BLOCK = 32, 8, 128, 16


def device_ops(g: torch.cuda.CUDAGraph) -> int:
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        g.replay()
        torch.cuda.synchronize()
    return sum(1 for e in p.events() if e.device_type.name == "CUDA")


def matmul_floor() -> None:
    bf16 = dict(device="cuda", dtype=torch.bfloat16, generator=torch.Generator(device="cuda").manual_seed(0))
    layers = [{"qkv": torch.randn(6144, HIDDEN, **bf16) * .02, "o": torch.randn(HIDDEN, HIDDEN, **bf16) * .02,
               "gate_up": torch.randn(2 * INTER, HIDDEN, **bf16) * .02, "down": torch.randn(HIDDEN, INTER, **bf16) * .02}
              for _ in range(LAYERS)]
    head = torch.randn(VOCAB, HIDDEN, **bf16) * .02
    nbytes = sum(w.numel() * 2 for d in layers for w in d.values()) + head.numel() * 2
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; one step reads {nbytes / 1e9:.2f} GB of weights")
    for m in (1, 2, 4, 8):
        x, xi, res = (torch.randn(m, k, **bf16) for k in (HIDDEN, INTER, HIDDEN))
        for lib in ("cublas", "cublaslt"):
            for addmm in (False, True):
                def step():
                    for d in layers:
                        F.linear(x, d["qkv"])
                        torch.addmm(res, x, d["o"].t()) if addmm else F.linear(x, d["o"])
                        F.linear(x, d["gate_up"])
                        F.linear(xi, d["down"])
                    F.linear(x, head)
                torch.backends.cuda.preferred_blas_library(lib)
                g = capture_graph(step)
                ms = min(replay_ms(g, 10) for _ in range(3))
                print(f"M={m} {lib:9s} o_proj {'addmm' if addmm else 'mm':5s} {ms:7.3f} ms/step "
                      f"{nbytes / ms / 1e9:5.2f} TB/s {device_ops(g):4d} device ops", flush=True)
        for name in ("qkv", "o", "gate_up", "down"):
            xin = xi if name == "down" else x
            row = []
            for lib in ("cublas", "cublaslt"):
                torch.backends.cuda.preferred_blas_library(lib)
                g = capture_graph(lambda: [F.linear(xin, d[name]) for d in layers])
                us = min(replay_ms(g, 10) for _ in range(3)) / LAYERS * 1e3
                row.append(f"{lib} {us:6.1f} us {layers[0][name].numel() * 2 / us / 1e6:5.2f} TB/s")
            print(f"M={m} {name:8s} " + " | ".join(row), flush=True)
    torch.backends.cuda.preferred_blas_library("cublas")


def attention_floor() -> None:
    num_blocks = 4096 // BLOCK + 2
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, HQ, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    tables = (torch.arange(2 * num_blocks, device="cuda", dtype=torch.int32) % num_blocks).view(2, num_blocks)
    caches = [torch.randn(num_blocks, 2, BLOCK, HKV, D, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(LAYERS)]
    for ctx in (200, 384, 1024, 4000):
        seq_lens = torch.tensor([ctx, 0], device="cuda", dtype=torch.int32)
        row = []
        for splits in (1, 2, 4, 8, 16, 32):
            g = capture_graph(lambda: [paged_decode_attention(q, c, seq_lens, tables, 4096, D ** -0.5, num_splits=splits)
                                  for c in caches])
            row.append(f"{splits}: {min(replay_ms(g, 20) for _ in range(3)) / LAYERS * 1e3:5.1f}")
        print(f"decode attention, batch-2 graph, context {ctx:4d}, us per layer by split count: " + "  ".join(row))


if __name__ == "__main__":
    matmul_floor()
    torch.cuda.empty_cache()
    attention_floor()
