"""W4A16 at many tokens: wna16_tiled's kernel against bf16 cuBLAS and today's dequantize + cuBLAS path.

    python benchmarks/wna16_tiled.py [--check] [--sweep] [--m 128,256,512,1024,2048] [--layers 32]
    python benchmarks/wna16_tiled.py --cpu-compile      # no GPU: compile every variant for sm_90a

The 8B step's four matmul shapes (qkv 4096->6144, o 4096->4096, gate_up 4096->28672, down
14336->4096), int4 symmetric group 128 with fp32 scales (what the served layers hold: wna16.py
stores scales.float()). Per shape and token count M: 32 layers of weights, one launch each, captured
in a CUDA graph (nothing served from L2), median replay / 32 = us per matmul.

--check: every variant (bf16, symmetric int4) and the default tiles with zero points, int8, fp16,
         bias and M = 1000 (not a multiple of the tile) against the fp32 torch reference (relative
         error) and against today's path (dequantize to bf16 + torch.mm: max abs difference, which
         should be at the output rounding: the weights are bit-identical, only the sum order differs).
--sweep: times bf16 F.linear, dequant + mm and every VARIANTS entry; prints the per-shape table, the
         step sums (x layers) per M and the best variant per shape and overall.
Variants compile in parallel child processes first (Triton's disk cache).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from multiprocessing import get_context

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from splitserve.kernels.gemm import reference as R  # noqa: E402
from splitserve.kernels.gemm.tiles import TileConfig  # noqa: E402
from splitserve.kernels.gemm.wna16 import wna16_gemm as WNA  # noqa: E402
from splitserve.kernels.gemm.wna16 import wna16_tiled as T  # noqa: E402
from splitserve.kernels.gemm.wna16 import wna16_wgmma as WG  # noqa: E402

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}  # (K, N)
GROUP = 128


class WgmmaTile(TileConfig):
    """A wna16_wgmma tile: the type only tells this script which kernel a variant runs (the kernels
    take any TileConfig)."""


def C(bm, bn, bk, warps, stages):  # a wna16_tiled tile; C itself: that kernel's default tiles
    return TileConfig(block_m=bm, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages)


def G(bm, bn, bk, warps, stages, split_k=1, programs_per_sm=1.0):  # a wna16_wgmma tile; G: its defaults
    return WgmmaTile(block_m=bm, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages, split_k=split_k,
                     programs_per_sm=programs_per_sm)


# "t": wna16_tiled (Triton; "s" its swap-AB orientation), "g": wna16_wgmma (Gluon, async wgmma).
# Name: tokens x features x block_k, warps, stages. CPU compile for sm_90a (--cpu-compile): none
# spills; 2 programs per SM fit for the 4-warp 128x128 tiles (~255 registers, <= 112 KB shared).
VARIANTS = {
    "t128x128x64w4s3": C(128, 128, 64, 4, 3),
    "t128x128x64w8s4": C(128, 128, 64, 8, 4),
    "t64x128x64w4s4": C(64, 128, 64, 4, 4),
    "t256x128x64w8s3": C(256, 128, 64, 8, 3),
    # Gluon: split-K (0: automatic, split_k_for) wherever the output tiles give fewer than
    # programs_per_sm programs per SM (2 where two programs fit an SM: <= ~113 KB shared, <= 255 regs x 128)
    "g128x128x64w4s4": G(128, 128, 64, 4, 4, 0, 2.0),
    "g128x128x64w4s4-nosplit": G(128, 128, 64, 4, 4, 1),
    "g128x128x64w8s4": G(128, 128, 64, 8, 4, 0, 1.0),
    "g256x128x64w8s4": G(256, 128, 64, 8, 4, 0, 1.0),
    "g256x128x64w8s3": G(256, 128, 64, 8, 3, 0, 1.0),
    "g128x256x64w8s4": G(128, 256, 64, 8, 4, 0, 1.0),
    "g64x128x64w4s5": G(64, 128, 64, 4, 5, 0, 2.0),
    "g128x64x64w4s4": G(128, 64, 64, 4, 4, 0, 2.0),
}
DEFAULTS = {"t-default": C, "g-default": G}  # check()'s default-tile cases, one per kernel


def log(*a):
    print(*a, flush=True)


def rand_int4(N, K, gen, device="cuda"):
    qweight = torch.randint(-2**31, 2**31 - 1, (K // 8, N), dtype=torch.int32, device=device, generator=gen)
    scales = torch.rand(K // GROUP, N, device=device, generator=gen) * 0.01 + 0.001  # fp32, as served
    return qweight, scales


def tiled(x, w, cfg, zeros=None, bits=4, bias=None):
    """cfg: a variant's config, or C / G (the classes) for that kernel's default tiles."""
    kernel = WG.wna16_wgmma_gemm if cfg is G or isinstance(cfg, WgmmaTile) else T.wna16_tiled_gemm
    return kernel(x, w[0], w[1], zeros, bits=bits, group_size=GROUP, bias=bias,
                  config=None if cfg in (C, G) else cfg)


def dequant_mm(x, w):
    """Today's path in wna16_linear past WNA16_DEQUANT_MIN_M tokens."""
    return torch.mm(x, WNA.wna16_dequantize(w[0], w[1], None, bits=4, group_size=GROUP, dtype=x.dtype))


# ---------------------------------------------------------------------------------------------
# correctness
# ---------------------------------------------------------------------------------------------

def family(name: str) -> str:
    """"g" for the Gluon kernel's variants and defaults, "t" for the Triton kernel's."""
    return "g" if name.startswith("g") else "t"


def check(fam: str) -> list[str]:
    """The check of one kernel family (run in its own process: a kernel that faults takes only its
    family's check down). Returns the variant / default names that failed."""
    from splitserve.kernels.gemm.wna16 import wna16_layout as L
    sys.path.insert(0, ROOT)
    fails = 0
    failed: set[str] = set()
    gen = torch.Generator(device="cuda").manual_seed(99)
    variants = {k: v for k, v in VARIANTS.items() if family(k) == fam}
    defaults = {k: v for k, v in DEFAULTS.items() if family(k) == fam}

    def report(what, out, ref, today=None, tol=4e-3):
        nonlocal fails
        err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        bad = not (err < tol) or not torch.isfinite(out.float()).all()
        extra = ""
        if today is not None:
            d = (out.float() - today.float()).abs().max().item()
            ulp = today.float().abs().max().item() * 2 ** -7  # bf16 spacing at the largest output
            extra = f", max |out - today| {d:.3g} (output ulp ~{ulp:.3g})"
            bad |= d > 4 * ulp
        fails += bad
        if bad:
            failed.add(what.split()[0])
        log(f"  {'FAIL' if bad else 'ok  '} {what}: rel err {err:.2e}{extra}")

    for name, (K, N) in SHAPES.items():
        w = torch.randn(N, K, device="cuda", generator=gen) * 0.02
        i4 = L.quantize_rtn(w, 4, GROUP, symmetric=True)
        i4z = L.quantize_rtn(w, 4, GROUP, symmetric=False)
        i8 = L.quantize_rtn(w, 8, GROUP, symmetric=True)
        for wi in (i4, i4z, i8):
            wi.scales = wi.scales.float()
        M = 256
        x = torch.randn(M, K, device="cuda", generator=gen).to(torch.bfloat16)
        ref = R.wna16_gemm_ref(x, i4.qweight, i4.scales, None, bits=4, group_size=GROUP)
        today = dequant_mm(x, (i4.qweight, i4.scales))
        for vname, cfg in variants.items():
            try:
                report(f"{vname} {name} M={M}", tiled(x, (i4.qweight, i4.scales), cfg), ref, today)
            except Exception as e:  # noqa: BLE001 - one call must give every answer it can
                fails += 1
                failed.add(vname)
                log(f"  FAIL {vname} {name}: {type(e).__name__}: {str(e)[:300]}")
        for dname, dcfg in defaults.items():  # each kernel's default tiles on the other cases
            try:
                for M, dtype in ((1000, torch.bfloat16), (300, torch.float16)):
                    x = torch.randn(M, K, device="cuda", generator=gen).to(dtype)
                    bias = torch.randn(N, device="cuda", generator=gen).to(dtype)
                    for wi, bits, what in ((i4, 4, "int4"), (i4z, 4, "int4 zp"), (i8, 8, "int8")):
                        out = tiled(x, (wi.qweight, wi.scales), dcfg, wi.zeros, bits, bias)
                        ref = R.wna16_gemm_ref(x, wi.qweight, wi.scales, wi.zeros, bits=bits, group_size=GROUP,
                                               bias=bias)
                        w_kn = WNA.wna16_dequantize(wi.qweight, wi.scales, wi.zeros, bits=bits, group_size=GROUP,
                                                    dtype=dtype)
                        today = torch.addmm(bias, x, w_kn)
                        report(f"{dname} {what} {str(dtype)[6:]} bias {name} M={M}", out, ref, today,
                               tol=4e-3 if dtype == torch.bfloat16 else 1e-3)
            except Exception as e:  # noqa: BLE001
                fails += 1
                failed.add(dname)
                log(f"  FAIL {dname} {name}: {type(e).__name__}: {str(e)[:300]}")
    # N not a multiple of the tiles and M tails: a small shape, both kernels' default tiles (N % 16 == 0:
    # wna16_tiled_supports)
    K, N, M = 512, 208, 77
    w = L.quantize_rtn(torch.randn(N, K, device="cuda", generator=gen) * 0.02, 4, GROUP, symmetric=False)
    w.scales = w.scales.float()
    x = torch.randn(M, K, device="cuda", generator=gen).to(torch.bfloat16)
    bias = torch.randn(N, device="cuda", generator=gen).to(torch.bfloat16)
    ref = R.wna16_gemm_ref(x, w.qweight, w.scales, w.zeros, bits=4, group_size=GROUP, bias=bias)
    today = torch.addmm(bias, x, WNA.wna16_dequantize(w.qweight, w.scales, w.zeros, bits=4, group_size=GROUP))
    for dname, dcfg in defaults.items():
        try:
            report(f"{dname} int4 zp bias K={K} N={N} M={M}", tiled(x, (w.qweight, w.scales), dcfg, w.zeros, 4, bias),
                   ref, today)
        except Exception as e:  # noqa: BLE001
            fails += 1
            failed.add(dname)
            log(f"  FAIL {dname} tail shape: {type(e).__name__}: {str(e)[:300]}")
    log(f"check {fam}: {fails} failures")
    return sorted(failed)


# ---------------------------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------------------------

def _compile_job(jobs):
    """Child process: one launch per (variant or DEFAULTS name, bits, zero points, dtype, bias) into
    Triton's disk cache."""
    sys.path.insert(0, ROOT)
    gen = torch.Generator(device="cuda").manual_seed(0)
    K, N = SHAPES["o"]
    w4, w8 = rand_int4(N, K, gen), (torch.randint(-2**31, 2**31 - 1, (K // 4, N), dtype=torch.int32, device="cuda",
                                                  generator=gen), rand_int4(N, K, gen)[1])
    zeros = torch.randint(0, 16, (K // GROUP, N), dtype=torch.uint8, device="cuda", generator=gen)
    done = 0
    for name, bits, zp, dtype, bias in jobs:
        x = torch.randn(256 if name in VARIANTS else 1000, K, device="cuda", dtype=dtype, generator=gen)
        b = torch.randn(N, device="cuda", dtype=dtype, generator=gen) if bias else None
        cfg = VARIANTS.get(name) or DEFAULTS[name]
        # a Gluon kernel compiles once with split-K and once without
        cfgs = [replace(cfg, split_k=1), replace(cfg, split_k=2)] if isinstance(cfg, WgmmaTile) else [cfg]
        if cfg is G:
            cfgs = [G(128, 128, 64, 4, 4, split_k=1), G(128, 128, 64, 4, 4, split_k=2)]
        for c in cfgs:
            try:
                tiled(x, w4 if bits == 4 else w8, c, zeros if zp else None, bits, b)
                done += 1
            except Exception:  # noqa: BLE001 - the parent runs it again and reports the error
                pass
    torch.cuda.synchronize()
    return done


def compile_jobs(variants, do_check: bool):
    jobs = [(v, 4, False, torch.bfloat16, False) for v in variants]
    if do_check:  # check()'s default-tile cases
        jobs += [(d, bits, zp, dtype, True) for d in DEFAULTS for dtype in (torch.bfloat16, torch.float16)
                 for bits, zp in ((4, False), (4, True), (8, False))]
    return jobs


def sweep(ms_list, layers: int, variants: list[str]):
    from quant_kernels import graph_ms
    gen = torch.Generator(device="cuda").manual_seed(0)
    res = {}  # (method, shape, M) -> us per matmul
    for name, (K, N) in SHAPES.items():
        ws = [rand_int4(N, K, gen) for _ in range(layers)]
        dense = [(torch.randn(N, K, device="cuda", generator=gen) * 0.02).to(torch.bfloat16) for _ in range(layers)]
        for M in ms_list:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=gen)
            methods = {"bf16": lambda w: F.linear(x, w), "dequant+mm": lambda w: dequant_mm(x, w)}
            for v in variants:
                methods[v] = (lambda cfg: lambda w: tiled(x, w, cfg))(VARIANTS[v])
            line = []
            for meth, fn in methods.items():
                store = dense if meth == "bf16" else ws
                try:
                    us = graph_ms(lambda: [fn(w) for w in store], iters=5) / layers * 1e3
                except Exception as e:  # noqa: BLE001
                    log(f"  {meth} {name} M={M}: ERROR {type(e).__name__}: {str(e)[:200]}")
                    continue
                res[(meth, name, M)] = us
                line.append(f"{meth}={us:.0f}")
            log(f"  {name:8s} M={M:5d} us: " + " ".join(line))
        del ws, dense
        torch.cuda.empty_cache()
    return res


def summarize(res, ms_list, layers, variants):
    log(f"\nus per matmul (median of CUDA-graph replays over {layers} layers' weights)")
    for M in ms_list:
        log(f"M={M}")
        rows = ["bf16", "dequant+mm"] + variants
        log(f"  {'method':22s}" + "".join(f"{n:>10s}" for n in SHAPES) + f"{'step ms':>10s}")
        for meth in rows:
            vals = [res.get((meth, n, M)) for n in SHAPES]
            step = sum(vals) * layers / 1e3 if all(v is not None for v in vals) else float("nan")
            log(f"  {meth:22s}" + "".join(f"{v:10.1f}" if v is not None else f"{'-':>10s}" for v in vals)
                + f"{step:10.2f}")
    log(f"\n8B step (x{layers} layers, LM head excluded), ms")
    log(f"{'M':>6s}{'bf16':>9s}{'dequant':>9s}{'best/shape':>12s}{'best single':>13s}  best single; best per shape")
    summary = {}
    for M in ms_list:
        def step(meth_of):
            vals = [res.get((meth_of(n), n, M)) for n in SHAPES]
            return sum(vals) * layers / 1e3 if all(v is not None for v in vals) else float("nan")
        best_of = {n: min((v for v in variants if (v, n, M) in res), key=lambda v: res[(v, n, M)], default=None)
                   for n in SHAPES}
        singles = {v: step(lambda n, v=v: v) for v in variants}
        single = min(singles, key=lambda v: singles[v] if singles[v] == singles[v] else float("inf"))
        b, d = step(lambda n: "bf16"), step(lambda n: "dequant+mm")
        per = step(lambda n: best_of[n])
        summary[M] = dict(bf16=b, dequant=d, best_per_shape=per, best_single=singles[single], single=single,
                          per_shape=best_of)
        log(f"{M:6d}{b:9.2f}{d:9.2f}{per:12.2f}{singles[single]:13.2f}  {single}; "
            + " ".join(f"{n}={best_of[n]}" for n in SHAPES))
    return summary


def cpu_compile() -> int:
    """Compile every variant (and the check's default-tile cases) for sm_90a without a GPU."""
    from quant_kernels_compile import compile_jobs, install_fake_sm90_driver
    compiled: list = []
    install_fake_sm90_driver(compiled)
    K, N = SHAPES["o"]
    qw, qw8 = torch.empty(K // 8, N, dtype=torch.int32), torch.empty(K // 4, N, dtype=torch.int32)
    sc, zs = torch.empty(K // GROUP, N), torch.empty(K // GROUP, N, dtype=torch.uint8)
    cases = []
    for v, cfg in VARIANTS.items():  # Gluon: with and without split-K
        for c, tag in ([(replace(cfg, split_k=1), ""), (replace(cfg, split_k=2), " split")] if isinstance(cfg, WgmmaTile)
                       else [(cfg, "")]):
            cases.append((v + tag, lambda c=c: tiled(torch.empty(256, K, dtype=torch.bfloat16), (qw, sc), c)))
    for dname, dcfg in DEFAULTS.items():
        for dtype in (torch.bfloat16, torch.float16):
            x, bias = torch.empty(1000, K, dtype=dtype), torch.empty(N, dtype=dtype)
            tag = f"{dname} {str(dtype)[6:]}"
            cases += [(f"{tag} int4", lambda x=x, b=bias, d=dcfg: tiled(x, (qw, sc), d, None, 4, b)),
                      (f"{tag} int4 zp", lambda x=x, b=bias, d=dcfg: tiled(x, (qw, sc), d, zs, 4, b)),
                      (f"{tag} int8", lambda x=x, b=bias, d=dcfg: tiled(x, (qw8, sc), d, None, 8, b))]
    tq, ts, tz = torch.empty(64, 208, dtype=torch.int32), torch.empty(4, 208), torch.empty(4, 208, dtype=torch.uint8)
    tx, tb = torch.empty(77, 512, dtype=torch.bfloat16), torch.empty(208, dtype=torch.bfloat16)
    cases += [(f"{d} tail shape", lambda d=dcfg: tiled(tx, (tq, ts), d, tz, 4, tb)) for d, dcfg in DEFAULTS.items()]
    return compile_jobs(cases, compiled, log)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", default="128,256,512,1024,2048")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--cpu-compile", action="store_true")
    ap.add_argument("--workers", type=int, default=14)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.cpu_compile:
        sys.exit(1 if cpu_compile() else 0)
    ms_list = [int(v) for v in args.m.split(",")]
    variants = [v for v in args.variants.split(",") if v]
    t0 = time.time()
    log(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {__import__('triton').__version__}")
    ctx = get_context("spawn")
    jobs = compile_jobs(variants, args.check)
    workers = max(1, min(args.workers, len(jobs)))
    try:
        with ProcessPoolExecutor(workers, mp_context=ctx) as pool:
            done = sum(pool.map(_compile_job, [jobs[i::workers] for i in range(workers)]))
        log(f"precompiled: {done} launches ok for {len(jobs)} jobs [{time.time() - t0:.0f} s]")
    except Exception as e:  # noqa: BLE001 - a worker that died (a faulting kernel): the check says which
        log(f"precompile: {type(e).__name__}: {str(e)[:300]} [{time.time() - t0:.0f} s]")
    out = {"device": torch.cuda.get_device_name()}
    if args.check:
        failed = []
        for fam in ("t", "g"):
            try:
                with ProcessPoolExecutor(1, mp_context=ctx) as proc:
                    failed += proc.submit(check, fam).result()
            except Exception as e:  # noqa: BLE001 - the process died: none of the family is trusted
                log(f"check {fam}: FAIL, the process died: {type(e).__name__}: {str(e)[:300]}")
                failed += [v for v in list(VARIANTS) + list(DEFAULTS) if family(v) == fam]
        out["check_failed"] = failed
        log(f"check: {len(failed)} variants failed {failed} [{time.time() - t0:.0f} s]")
        variants = [v for v in variants if v not in failed]
    if args.sweep:
        res = sweep(ms_list, args.layers, variants)
        out["us"] = {f"{k[0]}|{k[1]}|{k[2]}": v for k, v in res.items()}
        out["summary"] = summarize(res, ms_list, args.layers, variants)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
    log(f"total {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
