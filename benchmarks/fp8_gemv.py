"""The FP8-weight GEMV (kernels/gemm/fp8/fp8_gemv.py, W8A16) against today's fp8_linear at 1-2 tokens.

    python benchmarks/fp8_gemv.py --check --sweep [--layers 32] [--json PATH]
    python benchmarks/fp8_gemv.py --fake-sm90      # CPU only: compile every variant for sm_90a

Shapes: the Llama-3-8B layer (qkv 4096->6144, o 4096->4096, gate_up 4096->28672, down 14336->4096),
FP8 e4m3 weights with per-channel scales (online --quantization fp8), 32 layers' weights per shape
so that L2 holds none of them, each method timed as one CUDA graph over the 32 layers (median of
replays, per layer in us). Per shape and M in (1, 2): bf16 F.linear, fp8_linear as it is today
(FP8_GEMV_MAX_M = 0: the split-K tl.dot kernel, x quantized per 128-group inside it), and the GEMV
variants of VARIANTS. Then the decode step's matmuls: 32 x the four shapes + a measured bf16 LM head
(4096 -> 128256) for today's fp8_linear, the best GEMV per shape, and the best single variant.

--check: the GEMV (every variant and the default tiles) against reference.fp8_gemv_ref at the four
         shapes, M = 1, 2, bf16 and fp16, with bias, per-channel and per-tensor scales (max rel
         error); fp8_linear with the route on; a split-K GEMV replayed in a CUDA graph on fresh x.
--fake-sm90: no GPU; benchmarks/quant_kernels_compile.py's stand-in driver compiles every variant
         and prints registers, spills (STACK) and the K loop's instruction mix.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}  # (K, N)
LM_HEAD = (4096, 128256)
MS = (1, 2)
DEV = "cuda"  # "cpu" with --dry-run
# (block_n, block_k, num_warps, programs per SM for the split, prefetch). Per thread and K step:
# block_n * block_k / (256 * num_warps) 8-byte weight runs (LDG.64). Splits are per shape.
VARIANTS = [
    (16, 512, 4, 4, False),
    (16, 512, 4, 8, False),
    (32, 512, 4, 4, False),
    (32, 256, 4, 4, False),
    (8, 1024, 4, 4, False),
    (16, 256, 2, 4, False),
    (64, 256, 4, 2, False),
    (16, 512, 4, 2, False),
    (8, 512, 2, 8, False),
    (32, 256, 8, 4, False),
    (16, 256, 1, 8, False),
    (16, 512, 4, 4, True),
]


def log(*a):
    print(*a, flush=True)


def variant_config(v, N: int, K: int):
    from splitserve.kernels.gemm.fp8 import fp8_gemv as G
    from splitserve.kernels.gemm.tiles import TileConfig
    bn, bk, warps, per_sm, prefetch = v
    return TileConfig(block_n=bn, block_k=bk, split_k=G.gemv_split_for(N, K, bn, bk, 132, per_sm), num_warps=warps,
                      num_stages=1, prefetch=prefetch)


def vname(v) -> str:
    bn, bk, warps, per_sm, prefetch = v
    return f"n{bn}k{bk}w{warps}s{per_sm}" + ("pf" if prefetch else "")


# ---------------------------------------------------------------------------------------------
# CPU: compile for sm_90a
# ---------------------------------------------------------------------------------------------

def fake_sm90() -> int:
    from quant_kernels_compile import compile_jobs, install_fake_sm90_driver
    compiled: list = []
    install_fake_sm90_driver(compiled)
    from splitserve.kernels.gemm.fp8 import fp8_gemv as G
    jobs = []
    for M in MS:
        for name, (K, N) in SHAPES.items():
            x = torch.empty(M, K, dtype=torch.bfloat16)
            w = torch.empty(N, K, dtype=torch.float8_e4m3fn)
            ws = torch.empty(N, dtype=torch.float32)
            for v in VARIANTS + [None]:
                cfg = None if v is None else variant_config(v, N, K)
                what = f"M={M} {name} {vname(v) if v else 'default'} split={cfg.split_k if cfg else '-'}"
                jobs.append((what, lambda x=x, w=w, ws=ws, cfg=cfg: G.fp8_gemv(x, w, ws, config=cfg)))
    return compile_jobs(jobs, compiled, log)


# ---------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------

def graph_ms(fn, iters: int = 10) -> float:
    """fn once eagerly (compiles, allocates split-K counters), captured in a CUDA graph, median replay
    (quant_kernels.graph_ms); --dry-run on CPU times one eager call, for the script's logic only."""
    if DEV == "cpu":
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    from quant_kernels import graph_ms as cuda_graph_ms
    return cuda_graph_ms(fn, iters)


def rand_fp8(N, K, gen):
    w = torch.randn(N, K, device=DEV, generator=gen) * 0.02
    s = w.abs().amax(1).clamp(min=1e-10) / 448
    return (w / s[:, None]).to(torch.float8_e4m3fn), s.contiguous()


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


# the default tiles are also checked with bias, per-tensor scales and fp16 (each a compiled variant)
EXTRA_CHECKS = [(torch.bfloat16, True, False), (torch.bfloat16, False, True), (torch.float16, True, False),
                (torch.float16, False, True)]  # (dtype, bias, per-tensor scale)


def _precompile_job(jobs):
    """Child process: one launch per (shape, M, variant, dtype, bias, per-tensor) compiles it into
    Triton's disk cache."""
    sys.path.insert(0, ROOT)
    from splitserve.kernels.gemm.fp8 import fp8_gemm as FP8
    from splitserve.kernels.gemm.fp8 import fp8_gemv as G
    gen = torch.Generator(device=DEV).manual_seed(0)
    done = 0
    for name, M, v, dtype, has_bias, per_tensor in jobs:
        K, N = SHAPES[name]
        w, s = rand_fp8(N, K, gen)
        x = torch.randn(M, K, device=DEV, generator=gen).to(dtype)
        try:
            G.fp8_gemv(x, w, s[:1] if per_tensor else s, s.to(dtype) if has_bias else None,
                       config=None if v is None else variant_config(v, N, K))
            if v is None and dtype == torch.bfloat16 and not has_bias and not per_tensor:
                FP8.fp8_linear(x, w, s)  # today's kernel (FP8_GEMV_MAX_M is 0 in a fresh process)
            done += 1
        except Exception:  # noqa: BLE001 - the parent runs it again and reports the error
            pass
    torch.cuda.synchronize()
    return done


def precompile(workers: int, do_check: bool) -> None:
    jobs = [(name, M, v, torch.bfloat16, False, False) for M in MS for name in SHAPES for v in VARIANTS + [None]]
    if do_check:
        jobs += [(name, M, None, *extra) for M in MS for name in SHAPES for extra in EXTRA_CHECKS]
    t0 = time.time()
    with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
        try:
            done = sum(pool.map(_precompile_job, [jobs[i::workers] for i in range(workers)]))
            log(f"precompiled {len(jobs)} launches ({done} ok) in {time.time() - t0:.0f} s")
        except Exception as e:  # noqa: BLE001 - a broken worker only costs compile time later
            log(f"precompile: {type(e).__name__}: {str(e)[:300]}")


def check() -> int:
    from splitserve.kernels.gemm import reference as R
    from splitserve.kernels.gemm.fp8 import fp8_gemm as FP8
    from splitserve.kernels.gemm.fp8 import fp8_gemv as G
    fails = 0
    gen = torch.Generator(device=DEV).manual_seed(1234)

    def report(what, err, tol):
        nonlocal fails
        if not err < tol:
            fails += 1
            log(f"  FAIL {what}: rel err {err:.2e}")

    for name, (K, N) in SHAPES.items():
        w32 = torch.randn(N, K, device=DEV, generator=gen) * 0.02
        wq, ws = R.quantize_fp8_weight_ref(w32)
        ws = ws.reshape(-1)
        st = (w32.abs().max() / 448).reshape(())
        wqt = (w32 / st).to(torch.float8_e4m3fn)
        del w32
        for M in MS:
            errs = []
            try:
                x = torch.randn(M, K, device=DEV, generator=gen).to(torch.bfloat16)
                ref = R.fp8_gemv_ref(x, wq, ws)
                for v in VARIANTS + [None]:  # every variant as the sweep runs it
                    cfg = None if v is None else variant_config(v, N, K)
                    err = rel(G.fp8_gemv(x, wq, ws, config=cfg), ref)
                    report(f"{name} M={M} {vname(v) if v else 'default'}", err, 4e-3)
                    errs.append(err)
                for dtype, has_bias, per_tensor in EXTRA_CHECKS:  # the default tiles, other signatures
                    xd = x.to(dtype)
                    b = torch.randn(N, device=DEV, generator=gen).to(dtype) if has_bias else None
                    w_, s_ = (wqt, st) if per_tensor else (wq, ws)
                    err = rel(G.fp8_gemv(xd, w_, s_, b), R.fp8_gemv_ref(xd, w_, s_, b))
                    report(f"{name} M={M} default {str(dtype)[6:]} bias={has_bias} per_tensor={per_tensor}", err,
                           4e-3 if dtype == torch.bfloat16 else 1e-3)
                    errs.append(err)
                old = FP8.FP8_GEMV_MAX_M
                FP8.FP8_GEMV_MAX_M = 2
                try:
                    err = rel(FP8.fp8_linear(x, wq, ws), ref)
                finally:
                    FP8.FP8_GEMV_MAX_M = old
                report(f"fp8_linear (GEMV route) {name} M={M}", err, 4e-3)
                errs.append(err)
            except Exception as e:  # noqa: BLE001
                fails += 1
                log(f"  FAIL {name} M={M}: {type(e).__name__}: {str(e)[:300]}")
            log(f"  check {name:8s} M={M}: {len(errs)} runs, max rel err {max(errs, default=float('nan')):.2e}")
    # split-K counters under CUDA-graph replay: fresh x copied into the captured buffer each time
    if DEV == "cpu":
        log(f"check: {fails} failures")
        return fails
    K, N = SHAPES["down"]
    wq, ws = rand_fp8(N, K, gen)
    for M in MS:
        x = torch.randn(M, K, device=DEV, dtype=torch.bfloat16, generator=gen)
        cfg = variant_config(VARIANTS[0], N, K)
        G.fp8_gemv(x, wq, ws, config=cfg)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = G.fp8_gemv(x, wq, ws, config=cfg)
        for _ in range(3):
            x.copy_(torch.randn(M, K, device=DEV, generator=gen))
            out.fill_(float("nan"))
            g.replay()
            report(f"CUDA graph replay down M={M} split={cfg.split_k}", rel(out, R.fp8_gemv_ref(x, wq, ws)), 4e-3)
    log(f"check: {fails} failures")
    return fails


def sweep(layers: int) -> dict:
    from splitserve.kernels.gemm.fp8 import fp8_gemm as FP8
    from splitserve.kernels.gemm.fp8 import fp8_gemv as G
    gen = torch.Generator(device=DEV).manual_seed(0)
    res: dict = {}
    t0 = time.time()
    Kl, Nl = LM_HEAD
    lm_w = (torch.randn(Nl, Kl, device=DEV, generator=gen) * 0.02).to(torch.bfloat16)
    for M in MS:
        x = torch.randn(M, Kl, device=DEV, dtype=torch.bfloat16, generator=gen)
        res[("lm_head bf16", "lm", M)] = graph_ms(lambda: F.linear(x, lm_w)) * 1e3
    del lm_w
    for name, (K, N) in SHAPES.items():
        fp8 = [rand_fp8(N, K, gen) for _ in range(layers)]
        bf16 = [(torch.randn(N, K, device=DEV, generator=gen) * 0.02).to(torch.bfloat16) for _ in range(layers)]
        for M in MS:
            x = torch.randn(M, K, device=DEV, dtype=torch.bfloat16, generator=gen)
            methods = {"bf16 F.linear": lambda: [F.linear(x, w) for w in bf16]}
            old = FP8.FP8_GEMV_MAX_M
            FP8.FP8_GEMV_MAX_M = 0
            methods["fp8_linear today"] = lambda: [FP8.fp8_linear(x, w, s) for w, s in fp8]
            methods["gemv default"] = lambda: [G.fp8_gemv(x, w, s) for w, s in fp8]
            for v in VARIANTS:
                cfg = variant_config(v, N, K)
                methods[vname(v)] = lambda cfg=cfg: [G.fp8_gemv(x, w, s, config=cfg) for w, s in fp8]
            for what, fn in methods.items():
                try:
                    res[(what, name, M)] = graph_ms(fn, iters=5) / layers * 1e3  # us per layer
                except Exception as e:  # noqa: BLE001
                    log(f"  {what} {name} M={M}: ERROR {type(e).__name__}: {str(e)[:200]}")
            FP8.FP8_GEMV_MAX_M = old
            wbytes = K * N
            row = sorted(((t, w) for (w, n, m), t in res.items() if n == name and m == M and w != "bf16 F.linear"))
            log(f"{name:8s} M={M} bf16 {res.get(('bf16 F.linear', name, M), float('nan')):6.1f} us | "
                + "  ".join(f"{w} {t:.1f} ({wbytes / t / 1e6:.2f} TB/s)" for t, w in row[:6])
                + f" | worst {row[-1][1]} {row[-1][0]:.1f} [{time.time() - t0:.0f} s]")
        del fp8, bf16
        torch.cuda.empty_cache()
    return res


def summary(res: dict, layers: int) -> None:
    names = ["bf16 F.linear", "fp8_linear today", "gemv default"] + [vname(v) for v in VARIANTS]
    log("\nper layer, us (TB/s of weights; bf16 counts 2 bytes per weight)")
    log(f"{'method':18s}" + "".join(f"{n + ' M=' + str(m):>22s}" for m in MS for n in SHAPES))
    for w in names:
        cells = []
        for M in MS:
            for n, (K, N) in SHAPES.items():
                t = res.get((w, n, M))
                b = K * N * (2 if w.startswith("bf16") else 1)
                cells.append(f"{t:8.1f} ({b / t / 1e6:4.2f})" if t else f"{'-':>15s}")
        log(f"{w:18s}" + "".join(f"{c:>22s}" for c in cells))
    log(f"\ndecode step's matmuls, ms: {layers} x (qkv + o + gate_up + down) + bf16 LM head (measured)")
    for M in MS:
        lm = res[("lm_head bf16", "lm", M)] / 1e3

        def step(pick):
            return sum(pick(n) for n in SHAPES) * layers / 1e3

        rows = {}
        for w in ("bf16 F.linear", "fp8_linear today", "gemv default"):
            if all((w, n, M) in res for n in SHAPES):
                rows[w] = (step(lambda n, w=w: res[(w, n, M)]), "")
        gem = [vname(v) for v in VARIANTS]
        best = {n: min(((res[(w, n, M)], w) for w in gem if (w, n, M) in res), default=(float('nan'), '-'))
                for n in SHAPES}
        rows["GEMV best per shape"] = (step(lambda n: best[n][0]), " ".join(f"{n}={best[n][1]}" for n in SHAPES))
        singles = [(step(lambda n, w=w: res[(w, n, M)]), w) for w in gem if all((w, n, M) in res for n in SHAPES)]
        if singles:
            t, w = min(singles)
            rows["GEMV best single"] = (t, w)
        for what, (t, extra) in rows.items():
            log(f"  M={M} {what:22s} layers {t:6.3f}  + LM head {lm:5.3f} = {t + lm:6.3f} ms  {extra}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--fake-sm90", action="store_true")
    ap.add_argument("--dry-run", action="store_true", help="CPU, Triton interpreter, tiny shapes: the script's logic")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--workers", type=int, default=12)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.fake_sm90:
        sys.exit(1 if fake_sm90() else 0)
    if args.dry_run:
        global DEV, SHAPES, LM_HEAD, VARIANTS
        os.environ["TRITON_INTERPRET"] = "1"
        from tests import triton_interpreter_shims
        triton_interpreter_shims.install()
        DEV, args.layers = "cpu", 2
        SHAPES = {"qkv": (256, 96), "o": (256, 64), "gate_up": (256, 448), "down": (512, 64)}
        LM_HEAD = (256, 1000)
        VARIANTS = [(16, 64, 2, 4, False), (16, 128, 4, 8, True)]
        return run(args)
    log(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {__import__('triton').__version__}")
    run(args)


def run(args) -> None:
    t0 = time.time()
    if DEV == "cuda":
        precompile(args.workers, args.check)
    out = {}
    if args.check:
        out["check_failures"] = check()
        log(f"[{time.time() - t0:.0f} s]")
    if args.sweep:
        res = sweep(args.layers)
        summary(res, args.layers)
        out["sweep_us"] = {f"{w}|{n}|{m}": t for (w, n, m), t in res.items()}
    path = args.json or (os.path.join(os.environ["OUT"], "fp8_gemv.json") if os.environ.get("OUT") else None)
    if path:
        with open(path, "w") as f:
            json.dump(out, f, indent=1)
    log(f"total {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
