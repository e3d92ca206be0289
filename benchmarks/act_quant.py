"""The down projection's input: silu(gate) * up and its per-token fp8 / int8 quantization, unfused (what
the layers ran before) against the fused kernel (kernels/gemm/act_quant.py).

    python benchmarks/act_quant.py [--check] [--m 256,1024,4096,16384] [--i 14336,4096] [--warps 8,16,32]

  unfused   Inductor's kernel for activation.silu_and_mul (torch.compile, as in the engine's compiled
            layers) writing h in bf16, then quantize_fp8_per_token / quantize_int8_per_token
  fused     silu_mul_quant_per_token: gate_up read once, q and the scales written (--warps: also
            these num_warps for the one-pass kernel). INT8 runs it at every M, decode included:
            --m 1,16 shows whether one row per program is slower there than the two launches.

Each time is the median of CUDA-graph replays of one graph that runs the op over enough input copies
(>= 256 MB) that nothing comes from L2 between copies, divided by the copies. GB/s counts the fused
kernel's minimum traffic for both (gate_up read, q + scales written), so the columns compare directly.

--check: on fresh random inputs at every M and I, the fused kernel against the unfused computation with
the torch reference's h (fp32, one rounding) and the existing quantizers: scales and codes equal, but
for rare elements where exp's last fp32 bit moves h by a bf16 ulp (then a code one step apart, or the
row's scale one bf16 ulp apart). Also counts how far eager / Inductor h differ. FAIL lines, exit 1.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks.quant_kernels import graph_ms  # noqa: E402
from splitserve.kernels.gemm import act_quant as A  # noqa: E402
from splitserve.kernels.gemm import reference as R  # noqa: E402
from splitserve.kernels.gemm.fp8.fp8_gemm import quantize_fp8_per_token  # noqa: E402
from splitserve.kernels.gemm.int8.int8_gemm import quantize_int8_per_token  # noqa: E402
from splitserve.layers.activation import silu_and_mul  # noqa: E402

KINDS = {"fp8": (torch.float8_e4m3fn, quantize_fp8_per_token), "int8": (torch.int8, quantize_int8_per_token)}
GRAPH_BYTES = 256 << 20
DEVICE = "cuda"  # a trial of --check's logic on CPU sets "cpu" (TRITON_INTERPRET=1)


def log(*a):
    print(*a, flush=True)


def inputs(M: int, I: int, copies: int = 1) -> list[torch.Tensor]:
    return [torch.randn(M, 2 * I, device=DEVICE, dtype=torch.bfloat16) * 2 for _ in range(copies)]


def timed(fn, xs) -> float:
    """µs per call of fn over the copies xs, in one graph."""
    return graph_ms(lambda: [fn(x) for x in xs]) * 1000 / len(xs)


def bench(ms, i_list, warps) -> None:
    silu = torch.compile(silu_and_mul, dynamic=True)  # as the engine compiles its layers
    log(f"{'kind':5} {'I':>6} {'M':>6}  {'unfused µs':>10} {'GB/s':>6}  {'fused µs':>9} {'GB/s':>6}  {'speed-up':>8}"
        + "".join(f"  w{w:<2} µs" for w in warps))
    for I in i_list:
        for M in ms:
            copies = max(1, -(-GRAPH_BYTES // (M * 2 * I * 2)))
            xs = inputs(M, I, copies)
            gb = (M * 2 * I * 2 + M * I + 4 * M) / 1e3  # bytes / 1e3: / µs -> GB/s
            for kind, (dtype, quantize) in KINDS.items():
                t_unfused = timed(lambda x: quantize(silu(x)), xs)
                t_fused = timed(lambda x: A.silu_mul_quant_per_token(x, dtype), xs)
                extra = "".join(f"  {timed(lambda x, w=w: A.silu_mul_quant_per_token(x, dtype, num_warps=w), xs):8.1f}"
                                for w in warps)
                log(f"{kind:5} {I:6} {M:6}  {t_unfused:10.1f} {gb / t_unfused:6.0f}  {t_fused:9.1f} {gb / t_fused:6.0f}"
                    f"  {t_unfused / t_fused:7.2f}x" + extra)
            del xs
            torch.cuda.empty_cache()


def check(ms, i_list) -> int:
    silu = torch.compile(silu_and_mul, dynamic=True)
    failures = 0
    for I in list(i_list) + [16385]:  # 16385: the two-pass kernel
        for M in ms:
            x = inputs(M, I)[0]
            x[0] = 0
            if M > 1:
                x[1, :I] = -100.0  # exp overflow in silu
            h = R.silu_mul_ref(x)
            for name, other in (("eager", silu_and_mul(x)), ("inductor", silu(x)), ("act_quant.silu_mul", A.silu_mul(x))):
                frac = (other != h).float().mean().item()
                log(f"I={I} M={M}: {name} h differs from the fp32 one-rounding reference on {frac:.2e} of the elements")
            for kind, (dtype, quantize) in KINDS.items():
                q, s = A.silu_mul_quant_per_token(x, dtype)
                q_ref, s_ref = quantize(h)
                same_s = (s == s_ref).reshape(-1)
                s_rel = ((s - s_ref).abs() / s_ref).max().item()
                qa, qb = (q.view(torch.uint8), q_ref.view(torch.uint8)) if kind == "fp8" else (q, q_ref)
                diff = (qa.int() - qb.int()).abs()[same_s]
                n_bad = (diff > 0).sum().item()
                ok = (same_s.float().mean() >= 0.99 and s_rel <= 2**-7 and (diff.max().item() if diff.numel() else 0) <= 1
                      and n_bad <= max(2, diff.numel() // 10000))
                if not ok:
                    failures += 1
                log(f"{'OK  ' if ok else 'FAIL'} {kind} I={I} M={M}: scales equal on {same_s.sum().item()}/{M} rows "
                    f"(max rel diff {s_rel:.1e}); {n_bad} of {diff.numel()} codes differ (max {diff.max().item() if diff.numel() else 0})")
    return failures


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true")
    p.add_argument("--m", default="256,1024,4096,16384")
    p.add_argument("--i", default="14336,4096")
    p.add_argument("--warps", default="", help="also time the fused kernel with these num_warps")
    a = p.parse_args(argv)
    ms, i_list = [int(v) for v in a.m.split(",")], [int(v) for v in a.i.split(",")]
    warps = [int(v) for v in a.warps.split(",") if v]
    log(torch.cuda.get_device_name())
    if a.check:
        return 1 if check(ms, i_list) else 0
    bench(ms, i_list, warps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
