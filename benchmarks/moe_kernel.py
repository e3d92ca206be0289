"""Times the fused MoE op (kernels/moe/fused_moe.py) at the Mixtral-8x7B expert shape in bf16.

    python benchmarks/moe_kernel.py                       # H100: batch 1 and 8,192 tokens
    python benchmarks/moe_kernel.py --sweep               # also every tile configuration in CONFIGS
    python benchmarks/moe_kernel.py --device cpu --small  # smoke run: tiny shape, Triton interpreter
    python benchmarks/moe_kernel.py --compile-sm90        # no GPU: compile every variant for sm_90a

Shape: H = 4096, I = 14336, E = 8, top-2 (one layer's experts: 2.8 GB of bf16 weights).
- Batch 1 is bound by reading the two routed experts' weights (3 * H * I * 2 bytes each, 705 MB in
  all): achieved bandwidth = those bytes / time, against --peak-bw (3.0 TB/s, the issue's limit) and
  against a device-to-device copy measured here. Target: >= 60% of the limit.
- 8,192 tokens (16,384 token-expert pairs) is bound by the MMAs: FLOPs = 2 * pairs * 3 * H * I,
  against a bf16 torch.mm of the same FLOPs ([pairs, H] x [H, 3I]) measured here. Target: >= 50%.
Every timing replays a CUDA graph of the whole op (alignment, both GEMMs, the top-k sum) over
--layers distinct weight sets and divides by their number, as a model's layers follow one another
(else the tail of one call's weights would still sit in L2 for the next); eager launches between CUDA
events if the capture fails (said in the output). Each shape is first
checked against the torch reference (fp32 accumulation, same rounding points).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

HIDDEN, INTER, EXPERTS, TOP_K = 4096, 14336, 8, 2
SMALL = dict(hidden=64, inter=96, experts=8, top_k=2, tokens=[1, 40])


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--small", action="store_true", help="tiny shape (for --device cpu: the Triton interpreter)")
    ap.add_argument("--tokens", default="1,8192", help="comma-separated token counts (default 1,8192)")
    ap.add_argument("--peak-bw", type=float, default=3.0e12, help="bandwidth limit in bytes/s (default 3.0e12)")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="nominal dense bf16 TFLOP/s (H100 SXM: 989)")
    ap.add_argument("--sweep", action="store_true", help="time every configuration in CONFIGS too")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--layers", type=int, default=4,
                    help="distinct weight sets called in turn per timed step (as a model's layers are), so no "
                         "call finds its weights in L2 from the call before (default 4: 11 GB)")
    ap.add_argument("--compile-sm90", action="store_true",
                    help="no GPU needed: compile the default and sweep configurations of both token counts for "
                         "sm_90a and print registers / spills / shared memory (benchmarks/quant_kernels_compile.py)")
    return ap.parse_args()


ARGS = parse_args()
COMPILED: list = []
if ARGS.compile_sm90:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from quant_kernels_compile import install_fake_sm90_driver, resources  # noqa: E402
    install_fake_sm90_driver(COMPILED)
elif ARGS.device == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import torch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
if ARGS.device == "cpu" and not ARGS.compile_sm90:
    from tests import triton_interpreter_shims  # noqa: E402
    triton_interpreter_shims.install()
from splitserve.kernels.moe import fused_moe as FM  # noqa: E402
from splitserve.kernels.moe.reference import fused_moe_ref  # noqa: E402
from splitserve.layers.moe.router import topk_route  # noqa: E402

G = FM.GemmConfig
CONFIGS = {  # for --sweep: decode-like (few rows per expert) and prefill-like tiles
    "decode": [
        FM.MoeConfig(16, G(64, 128, 4, 4), G(32, 256, 4, 4)),
        FM.MoeConfig(16, G(32, 128, 4, 4), G(32, 128, 4, 4)),
        FM.MoeConfig(16, G(64, 256, 4, 3), G(64, 256, 4, 3)),
        FM.MoeConfig(16, G(32, 256, 4, 5), G(16, 256, 4, 5)),
        FM.MoeConfig(16, G(128, 128, 4, 4), G(64, 128, 4, 4)),
        FM.MoeConfig(16, G(64, 128, 8, 4), G(32, 512, 4, 3)),
    ],
    "prefill": [
        FM.MoeConfig(128, G(64, 64, 8, 4, 8), G(128, 64, 8, 4, 8)),
        FM.MoeConfig(128, G(64, 64, 4, 4, 8), G(128, 64, 8, 3, 8)),
        FM.MoeConfig(128, G(128, 64, 8, 3, 8), G(128, 64, 8, 4, 8)),
        FM.MoeConfig(64, G(64, 64, 4, 4, 8), G(128, 64, 4, 4, 8)),
        FM.MoeConfig(128, G(64, 32, 4, 5, 8), G(128, 32, 4, 5, 8)),
        FM.MoeConfig(256, G(64, 64, 8, 3, 8), G(128, 64, 8, 3, 8)),
    ],
}


def timed_ms(fn, device: str, iters: int) -> tuple[float, str]:
    """Mean time of fn(): CUDA graph replays when capture works, else eager between events."""
    fn()
    if device == "cpu":
        t0 = time.perf_counter()
        for _ in range(max(1, iters // 10)):
            fn()
        return (time.perf_counter() - t0) * 1e3 / max(1, iters // 10), "cpu wall"
    torch.cuda.synchronize()
    run, how = fn, "eager"
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        run, how = graph.replay, "graph"
    except Exception as e:  # noqa: BLE001 - a benchmark: report and time eagerly instead
        print(f"  (CUDA graph capture failed, timing eager launches: {e!r})"[:200])
        torch.cuda.synchronize()
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        run()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters, how


def copy_bandwidth(device: str, iters: int) -> float:
    """Bytes/s of a device-to-device copy of 1 GiB (read + write counted)."""
    n = (1 << 30) // 2 if device == "cuda" else 1 << 20
    src = torch.empty(n, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    ms, _ = timed_ms(lambda: dst.copy_(src), device, iters)
    return 2 * n * 2 / (ms / 1e3)


def routing(T: int, E: int, k: int, device: str, seed: int):
    g = torch.Generator().manual_seed(seed)
    weights, ids = topk_route(torch.randn(T, E, generator=g), k, renormalize=True)
    return weights.to(device), ids.to(device)


def check(x, w13, w2, weights, ids, config) -> float:
    out = FM.fused_moe_triton(x, w13, w2, weights, ids, config)
    ref = fused_moe_ref(x, w13, w2, weights, ids)
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    if not err < 1e-2:
        raise SystemExit(f"fused_moe_triton differs from the reference: relative error {err:.3e}")
    return err


def compile_sm90() -> None:
    """Every launch of fused_moe_triton at the full shape, compiled for sm_90a against a stand-in
    driver (CPU tensors; nothing runs)."""
    E, H, I, k = EXPERTS, HIDDEN, INTER, TOP_K
    w13 = torch.empty(E, 2 * I, H, dtype=torch.bfloat16)
    w2 = torch.empty(E, H, I, dtype=torch.bfloat16)
    seen, failures = set(), 0
    for T in [int(t) for t in ARGS.tokens.split(",")]:
        x = torch.empty(T, H, dtype=torch.bfloat16)
        weights, ids = routing(T, E, k, "cpu", seed=T)
        kind = "decode" if T * k / E <= 16 else "prefill"
        for cfg in [FM.default_config(T * k, E)] + CONFIGS[kind]:
            before = len(COMPILED)
            try:
                FM.fused_moe_triton(x, w13, w2, weights, ids, cfg)
            except Exception as e:  # noqa: BLE001 - report every configuration
                failures += 1
                print(f"FAIL T={T} {cfg}: {type(e).__name__}: {str(e)[:400]}")
                continue
            for kern in COMPILED[before:]:
                if kern is None or kern.hash in seen:
                    continue
                seen.add(kern.hash)
                print(f"T={T:5d} {kern.name:18s} warps={kern.metadata.num_warps} stages={kern.metadata.num_stages} "
                      f"smem={kern.metadata.shared} {resources(kern, None)}")
    print(f"{len(seen)} variants compiled, {failures} failures")
    sys.exit(1 if failures else 0)


def main() -> None:
    a = ARGS
    if a.compile_sm90:
        return compile_sm90()
    dev = a.device
    if dev == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device; use --device cpu --small for a smoke run")
    H, I, E, k = (SMALL["hidden"], SMALL["inter"], SMALL["experts"], SMALL["top_k"]) if a.small else \
        (HIDDEN, INTER, EXPERTS, TOP_K)
    tokens = SMALL["tokens"] if a.small and a.tokens == "1,8192" else [int(t) for t in a.tokens.split(",")]
    dtype = torch.bfloat16
    import triton
    name = torch.cuda.get_device_name() if dev == "cuda" else "cpu (Triton interpreter)"
    print(f"{name}  torch {torch.__version__}  triton {triton.__version__}  H={H} I={I} E={E} top-{k} {dtype}")
    g = torch.Generator(device=dev).manual_seed(0)
    layers = max(1, a.layers if dev == "cuda" else 1)
    w13s = [(torch.randn(E, 2 * I, H, generator=g, device=dev) * H**-0.5).to(dtype) for _ in range(layers)]
    w2s = [(torch.randn(E, H, I, generator=g, device=dev) * I**-0.5).to(dtype) for _ in range(layers)]
    w13, w2 = w13s[0], w2s[0]

    def run_all(cfg=None):
        for w13_l, w2_l in zip(w13s, w2s):
            FM.fused_moe_triton(x, w13_l, w2_l, weights, ids, cfg)
    copy_bw = copy_bandwidth(dev, a.iters)
    print(f"device copy bandwidth: {copy_bw / 1e12:.2f} TB/s")
    for T in tokens:
        x = torch.randn(T, H, generator=g, device=dev).to(dtype)
        weights, ids = routing(T, E, k, dev, seed=T)
        default = FM.default_config(T * k, E)
        err = check(x, w13, w2, weights, ids, default)
        ms, how = timed_ms(run_all, dev, a.iters)
        ms /= layers
        align_ms, _ = timed_ms(lambda: FM.align_pairs_by_expert(ids, E, default.block_m), dev, a.iters)
        print(f"\ntokens {T}: fused_moe {ms:.3f} ms ({how}), of which alignment {align_ms:.3f} ms; "
              f"rel err vs reference {err:.1e}; config {default}")
        report(T, ms, ids, H, I, k, copy_bw, dev, dtype, a)
        if a.sweep:
            best = (ms, default)
            for cfg in CONFIGS["decode" if T * k / E <= 16 else "prefill"]:
                try:
                    check(x, w13, w2, weights, ids, cfg)
                    t, _ = timed_ms(lambda: run_all(cfg), dev, a.iters)
                    t /= layers
                except Exception as e:  # noqa: BLE001 - a sweep: report the configuration and go on
                    print(f"  {cfg}: failed {e!r}"[:240])
                    continue
                print(f"  {t:.3f} ms  {cfg}")
                best = min(best, (t, cfg), key=lambda b: b[0])
            print(f"  best {best[0]:.3f} ms: {best[1]}")
            report(T, best[0], ids, H, I, k, copy_bw, dev, dtype, a)


def report(T, ms, ids, H, I, k, copy_bw, dev, dtype, a) -> None:
    s = ms / 1e3
    weight_bytes = ids.unique().numel() * 3 * H * I * 2  # the routed experts' weights, each read once
    if T <= 16:  # decode: those weights are the traffic
        bw = weight_bytes / s
        print(f"  batch {T}: {weight_bytes / 1e6:.1f} MB of expert weights at {bw / 1e12:.2f} TB/s = "
              f"{bw / a.peak_bw:.0%} of {a.peak_bw / 1e12:.1f} TB/s ({bw / copy_bw:.0%} of the measured copy)")
    flops = 2 * T * k * 3 * H * I
    mm_a = torch.randn(T * k, H, device=dev).to(dtype)
    mm_b = torch.randn(H, 3 * I, device=dev).to(dtype)
    mm_ms, _ = timed_ms(lambda: torch.mm(mm_a, mm_b), dev, a.iters)
    del mm_a, mm_b
    print(f"  {flops / s / 1e12:.1f} TFLOP/s vs bf16 torch.mm [{T * k}, {H}] x [{H}, {3 * I}] "
          f"{flops / (mm_ms / 1e3) / 1e12:.1f} TFLOP/s ({mm_ms:.3f} ms) = {mm_ms / ms:.0%} of the matmul, "
          f"{flops / s / 1e12 / a.peak_tflops:.0%} of the nominal {a.peak_tflops:.0f}")


if __name__ == "__main__":
    main()
