"""Is a hand-written silu * mul kernel faster than the one Inductor generates for the compiled layers?

The MLP's element-wise step reads gate | up [T, 2I] and writes silu(gate) * up [T, I]: pure memory
traffic, 1.41 GB per layer at T = 16384 on the 8B shape. The fourth session's profile had Inductor's
kernel at ~2.4 TB/s there, where a copy runs at ~3.0 TB/s.

    python benchmarks/silu_mul_probe.py [--rows 1024,3000,16384]

Checks each variant against eager torch in fp32, then times Inductor's kernel (torch.compile with
dynamic shapes, as the engine compiles its layers; with the column count dynamic too, and static as
in the engine) against the engine's Triton kernel (layers/silu_mul_kernel.py) at several
configurations, each inside a CUDA graph over three inputs (so nothing is served from L2).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from profile_step import replay_ms  # noqa: E402

from splitserve.layers.activation import silu_and_mul_torch  # noqa: E402
from splitserve.layers.silu_mul_kernel import _silu_and_mul_kernel  # noqa: E402

INTER = 14336


def silu_mul_triton(x: torch.Tensor, block: int, num_warps: int) -> torch.Tensor:
    """The engine's kernel at a given configuration."""
    n = x.shape[1] // 2
    out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    _silu_and_mul_kernel[(x.shape[0], triton.cdiv(n, block))](x, out, x.stride(0), out.stride(0), n, BLOCK=block,
                                                              num_warps=num_warps)
    return out


def graph_ms(fn) -> float:
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return replay_ms(g)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1024,3000,16384")
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)
    compiled = torch.compile(silu_and_mul_torch, dynamic=True, fullgraph=True)
    # In the engine the column count is a weight's size, so Inductor knows it (and the row stride).
    compiled_static_cols = torch.compile(silu_and_mul_torch, dynamic=True, fullgraph=True)

    def inductor_static_cols(x):
        torch._dynamo.mark_static(x, 1)
        return compiled_static_cols(x)
    for m in (int(v) for v in args.rows.split(",")):
        xs = [torch.randn(m, 2 * INTER, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
        ref = (F.silu(xs[0][:, :INTER].float()) * xs[0][:, INTER:].float())
        gb = 3 * m * INTER * 2 / 1e9  # read gate and up, write the product (bf16)

        def report(label, fn):
            err = float(((fn(xs[0]).float() - ref).abs().max() / ref.abs().max()))
            ms = graph_ms(lambda: [fn(x) for x in xs]) / len(xs)
            print(f"rows {m:6d} {label:28s} {ms * 1e3:8.1f} us {gb / ms:6.2f} TB/s  rel err {err:.1e}", flush=True)
            return ms
        with torch.inference_mode():
            report("inductor (dynamic)", compiled)
            base = report("inductor (static columns)", inductor_static_cols)
            best = None
            for block in (512, 1024, 2048, 4096):
                for warps in (4, 8):
                    ms = report(f"triton BLOCK {block} warps {warps}", lambda x, b=block, w=warps: silu_mul_triton(x, b, w))
                    best = min(best or (ms, block, warps), (ms, block, warps))
        print(f"BEST rows {m}: triton BLOCK {best[1]} warps {best[2]} {best[0] * 1e3:.1f} us vs inductor "
              f"{base * 1e3:.1f} us ({(best[0] / base - 1) * 100:+.1f}%)", flush=True)


if __name__ == "__main__":
    main()
