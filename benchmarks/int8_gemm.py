"""W8A8 INT8 GEMMs on the Llama-3-8B shapes: bf16 F.linear, the torch._int_mm path the INT8 layer used
before kernels/gemm/int8/int8_gemm.py, and that Triton kernel (with and without its quantization launch).

    python benchmarks/int8_gemm.py [--check] [--sweep] [--m 64,256,1024,4096,16384] [--no-compile]
    python benchmarks/int8_gemm.py --compile-only     (no GPU needed)
    python benchmarks/int8_gemm.py --check --tiles all [--tiles-m 512,2048,8192]   (+ --compile-only: no GPU)

Shapes (K -> N): qkv 4096->6144, o 4096->4096, gate_up 4096->28672, down 14336->4096. Each timing is
the median of CUDA-graph replays of one graph that runs the matmul over enough weight copies
(>= 256 MB of weights) that nothing is served from L2 between replays, divided by the copies.
Methods:
  bf16              F.linear(x, w) with bf16 weights
  int_mm path       per-token quantization in torch ops, 16 zero rows of padding, torch._int_mm (int32
                    [M, N] written to memory), both scales and the cast: the old Int8LinearMethod
                    .gpu_matmul, compiled by Inductor (dynamic shapes) as the engine's decoder layers
                    are (--no-compile: eager torch ops)
  triton+quant      int8_linear: quantize_int8_per_token + int8_gemm (what the layer runs now)
  triton gemm       int8_gemm on already-quantized activations
  triton tma        int8_gemm with the table's tile on the TMA kernel (M > 256)
  triton tma ws     the TMA kernel, 128x256x128 tiles, warp-specialized (M > 256; see WS_CONFIG)
TFLOP/s counts 2*M*N*K; "x bf16" is the ratio to bf16's time (higher is faster).

--check: the kernels against exact references on the GPU at every shape and M (quantization bit for
         bit; the int32 accumulator exactly, against a float64 matmul; the bf16 output within one
         bf16 rounding of the fp32 epilogue), and once through CUDA-graph replays (split-K counters).
--sweep: tile configurations per shape at --sweep-m (default 256,1024,4096,16384), best first, and the
         best per shape and M at the end.
--tiles: the named tiles of tiles.INT8_TILES (<= 10, one compile each) with bf16 and the table's default,
         every shape at --tiles-m, then per M the 8B layer's sum of the four matmuls (x bf16) and the
         best tile per shape; with --check first each tile against exact references (check_tiles).
--compile-only: every variant compiled for sm_90a without a GPU (stand-in driver), with its
         registers, spills and shared memory; FAIL lines for what does not compile.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import replace

import torch
import torch.nn.functional as F
from triton.runtime.errors import OutOfResources

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from splitserve.kernels.gemm import tiles  # noqa: E402
from splitserve.kernels.gemm.int8 import int8_gemm as G  # noqa: E402
from splitserve.kernels.gemm.tiles import TileConfig  # noqa: E402
from splitserve.layers.quantization import ops  # noqa: E402

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}  # (K, N)
DEFAULT_M = (64, 256, 1024, 4096, 16384)
WEIGHT_BYTES_PER_GRAPH = 256 << 20  # > 5x the H100's 50 MB L2
INT_MM_PAD_ROWS = 16
DEVICE = "cuda"  # tests of the script's own logic set "cpu" (TRITON_INTERPRET=1, graph_ms replaced)


def log(*a):
    print(*a, flush=True)


def graph_ms(fns, iters: int = 10) -> float:
    """The fns captured in one CUDA graph (quant_kernels.graph_ms: once eagerly first), median
    replay in ms divided by len(fns)."""
    from benchmarks.quant_kernels import graph_ms as one_graph_ms
    return one_graph_ms(lambda: [f() for f in fns], iters) / len(fns)


def copies_for(bytes_per_copy: int) -> int:
    return max(1, math.ceil(WEIGHT_BYTES_PER_GRAPH / bytes_per_copy))


def int8_weight(N: int, K: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    q = torch.randint(-127, 128, (N, K), dtype=torch.int8, device=DEVICE, generator=gen)
    s = torch.rand(N, device=DEVICE, generator=gen) * 2e-4 + 1e-4  # ~ normal(0, 0.02) weights / 127.5
    return q, s


def int_mm_path(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """The INT8 layer's GPU matmul before int8_gemm (see the module docstring)."""
    q, scale = ops.int8_quantize_per_token(x)
    m = q.shape[0]
    q = F.pad(q, (0, 0, 0, INT_MM_PAD_ROWS))
    acc = torch._int_mm(q, w.t())[:m]
    return (acc.float() * scale * w_scale).to(x.dtype)


# ---------------------------------------------------------------------------------------------
# timings
# ---------------------------------------------------------------------------------------------

def method_fns(method: str, x: torch.Tensor, xq, ws, int_mm) -> list:
    if method == "bf16":
        return [lambda w=w: F.linear(x, w) for w in ws]
    if method == "int_mm path":
        return [lambda w=w: int_mm(x, w[0], w[1]) for w in ws]
    if method == "triton+quant":
        return [lambda w=w: G.int8_linear(x, w[0], w[1]) for w in ws]
    if method == "triton gemm":
        return [lambda w=w: G.int8_gemm(xq[0], xq[1], w[0], w[1]) for w in ws]
    if method in ("triton tma", "triton tma ws"):
        M, K = x.shape
        cfg = tiles.int8_gemm_tiles(M, ws[0][0].shape[0], K)
        cfg = replace(cfg, tma=True) if method == "triton tma" else WS_CONFIG
        return [lambda w=w: G.int8_gemm(xq[0], xq[1], w[0], w[1], config=cfg) for w in ws]
    raise ValueError(method)


METHODS = ("bf16", "int_mm path", "triton+quant", "triton gemm", "triton tma", "triton tma ws")
# Triton only overlaps consecutive wgmma groups for fp32 accumulators: an int32 dot waits for its
# MMAs every K step. With warp specialization (num_warps=4 here: two 4-warp MMA groups + a loader)
# one MMA group's wait is covered by the other's MMAs.
WS_CONFIG = TileConfig(block_m=128, block_n=256, block_k=128, num_warps=4, num_stages=3, tma=True, warp_spec=True)


def run_table(ms_list, compiled: bool):
    int_mm = torch.compile(int_mm_path, dynamic=True, fullgraph=True) if compiled else int_mm_path
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    rows = []
    for name, (K, N) in SHAPES.items():
        wb = [(torch.randn(N, K, device=DEVICE, generator=gen) * 0.02).to(torch.bfloat16)
              for _ in range(copies_for(2 * N * K))]
        wq = [int8_weight(N, K, gen) for _ in range(copies_for(N * K))]
        for M in ms_list:
            x = torch.randn(M, K, device=DEVICE, dtype=torch.bfloat16, generator=gen)
            xq = G.quantize_int8_per_token(x)
            flop = 2 * M * N * K
            base = None
            for method in METHODS:
                if method.startswith("triton tma") and (M <= 256 or not G.tma_supported(xq[0], wq[0][0])):
                    continue
                try:
                    ms = graph_ms(method_fns(method, x, xq, wb if method == "bf16" else wq, int_mm))
                except Exception as e:  # noqa: BLE001 - report and go on: one call must give every answer it can
                    log(f"  {name} M={M} {method}: ERROR {type(e).__name__}: {str(e)[:300]}")
                    continue
                base = ms if method == "bf16" else base
                ratio = base / ms if base else float("nan")
                rows.append(dict(shape=name, M=M, method=method, ms=ms, tflops=flop / (ms * 1e-3) / 1e12, ratio=ratio))
                log(f"  {name:8s} M={M:6d} {method:14s} {ms * 1e3:9.1f} us {rows[-1]['tflops']:7.1f} TFLOP/s "
                    f"{ratio:5.2f}x bf16")
            del x, xq
        del wb, wq
        torch.cuda.empty_cache()
    return rows


def print_table(rows, ms_list):
    log("\nTFLOP/s (x bf16) per shape and M:")
    methods = [m for m in METHODS if any(r["method"] == m for r in rows)]
    log(f"{'shape':8s} {'M':>6s} " + " ".join(f"{m:>20s}" for m in methods))
    for name in SHAPES:
        for M in ms_list:
            cells = []
            for m in methods:
                r = next((r for r in rows if r["shape"] == name and r["M"] == M and r["method"] == m), None)
                cells.append(f"{'-':>20s}" if r is None else f"{r['tflops']:>11.1f} ({r['ratio']:4.2f}x)")
            log(f"{name:8s} {M:6d} " + " ".join(cells))


# ---------------------------------------------------------------------------------------------
# correctness on the GPU
# ---------------------------------------------------------------------------------------------

def quant_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's definition with true divisions (tensor / tensor; torch divides a CUDA tensor by
    a Python scalar as a multiply by its reciprocal, which can be one ulp off)."""
    xf = x.float()
    amax = xf.abs().amax(dim=1, keepdim=True)
    s = amax / torch.full_like(amax, G.INT8_HALF_RANGE)
    s = torch.where(s == 0, torch.full_like(s, G.SCALE_EPS), s)
    return torch.round(xf / s).clamp(-128, 127).to(torch.int8), s


def beyond_one_rounding(out, acc_ref, mag, s, ws, bias) -> int:
    """How many outputs are further from (acc * s) * ws + bias (fp32) than one rounding to out's dtype,
    allowing a few fp32 ulps of the terms' magnitudes (FMA contraction, split-K partial sums)."""
    b = 0 if bias is None else bias.float()
    ref = acc_ref.float() * s * ws + b
    tol = torch.finfo(out.dtype).eps * ref.abs() + 8 * torch.finfo(torch.float32).eps * (mag * s * ws + abs(b))
    return ((out.float() - ref).abs() > tol).sum().item()


def check(ms_list) -> int:
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    failures = 0

    def fail(msg):
        nonlocal failures
        failures += 1
        log("FAIL " + msg)

    for name, (K, N) in SHAPES.items():
        w, ws = int8_weight(N, K, gen)
        bias = torch.randn(N, device=DEVICE, dtype=torch.bfloat16, generator=gen)
        for M in sorted(set(ms_list) | {1, 7, 16, 33, 100}):
            x = torch.randn(M, K, device=DEVICE, dtype=torch.bfloat16, generator=gen) * 2
            x[0] = 0  # an all-zero token
            q, s = G.quantize_int8_per_token(x)
            q_ref, s_ref = quant_ref(x)
            if not torch.equal(s, s_ref) or not torch.equal(q, q_ref):
                fail(f"{name} M={M}: quantization differs in {(q != q_ref).sum().item()} values, "
                     f"{(s != s_ref).sum().item()} scales")
            q_ops, _ = ops.int8_quantize_per_token(x)
            off = (q_ops.int() - q.int()).abs()
            if off.max() > 1:
                fail(f"{name} M={M}: quantization is more than 1 off ops.int8_quantize_per_token")
            acc_ref = (q.double() @ w.double().t()).to(torch.int32)  # exact: |sums| < 2^28
            mag = (q.double().abs() @ w.double().abs().t()).float()
            configs = [("default", None)]
            if M > 256 and G.tma_supported(q, w):
                cfg = tiles.int8_gemm_tiles(M, N, K)
                configs += [("tma", replace(cfg, tma=True)), ("tma ws", WS_CONFIG)]
            for label, cfg in configs:
                raw_cfg = cfg or tiles.int8_gemm_tiles(M, N, K)
                raw_cfg = replace(raw_cfg, split_k=1)
                try:
                    acc = G.int8_gemm(q, None, w, None, out_dtype=torch.int32, config=raw_cfg)
                except OutOfResources as e:  # a variant's tiles (an int32 output tile staged for TMA) too big
                    log(f"{name} M={M} {label}: skipped, {e}")
                    continue
                if not torch.equal(acc, acc_ref):
                    fail(f"{name} M={M} {label}: int32 accumulator differs in {(acc != acc_ref).sum().item()} values")
                for b in (None, bias):
                    out = G.int8_gemm(q, s, w, ws, b, config=cfg)
                    bad = beyond_one_rounding(out, acc_ref, mag, s, ws, b)
                    if bad:
                        fail(f"{name} M={M} {label} bias={b is not None}: {bad} outputs beyond one bf16 rounding")
            if beyond_one_rounding(G.int8_linear(x, w, ws, bias), acc_ref, mag, s, ws, bias):
                fail(f"{name} M={M}: int8_linear beyond one bf16 rounding of the reference")
            del acc_ref, mag
        if DEVICE != "cuda":
            log(f"check {name}: done (no graph replays off CUDA)")
            continue
        # graph replays: split-K counters must come back to zero between replays
        x = torch.randn(16, K, device=DEVICE, dtype=torch.bfloat16, generator=gen)
        first = G.int8_linear(x, w, ws)
        out = torch.empty_like(first)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out.copy_(G.int8_linear(x, w, ws))
        for _ in range(3):
            g.replay()
        torch.cuda.synchronize()
        if not torch.equal(out, first):
            fail(f"{name}: graph replays differ from the eager call")
        log(f"check {name}: done")
    log(f"check: {failures} failure(s)")
    return failures


# ---------------------------------------------------------------------------------------------
# tile sweep
# ---------------------------------------------------------------------------------------------

SMEM_LIMIT = 227 * 1024


def sweep_configs(M: int) -> list:
    tiles = [(64, 128, 128), (64, 256, 128), (128, 128, 128), (128, 256, 128), (256, 128, 128),
             (128, 128, 256), (64, 128, 256), (128, 256, 256)]
    out = []
    for bm, bn, bk in tiles:
        if bm > max(64, 2 * M):
            continue
        for warps in (4, 8):
            for stages in (2, 3, 4):
                if stages * (bm + bn) * bk > SMEM_LIMIT - 8192 or (stages == 2) != (bk == 256 and bn == 256):
                    continue
                for tma, ws in ((False, False), (True, False), (True, True)):
                    # warp specialization applies at 4 warps (two MMA groups of 4 + a loader); the
                    # int32 accumulator registers per thread of an MMA warp must stay <= 128
                    mma_warps = 8 if ws else warps
                    if (ws and warps != 4) or bm * bn // (mma_warps * 32) > 128 or (tma and bk > 128):
                        continue
                    out.append(TileConfig(block_m=bm, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages, tma=tma, warp_spec=ws))
    return out


def sweep(ms_list, only: str = ""):
    gen = torch.Generator(device=DEVICE).manual_seed(2)
    best = []
    for name, (K, N) in SHAPES.items():
        wq = [int8_weight(N, K, gen) for _ in range(copies_for(N * K))]
        for M in ms_list:
            x = torch.randn(M, K, device=DEVICE, dtype=torch.bfloat16, generator=gen)
            q, s = G.quantize_int8_per_token(x)
            flop = 2 * M * N * K
            results = []
            default = tiles.int8_gemm_tiles(M, N, K)
            for cfg in [default] + [c for c in sweep_configs(M) if only in c.describe()]:
                try:
                    ms = graph_ms([lambda w=w, cfg=cfg: G.int8_gemm(q, s, w[0], w[1], config=cfg) for w in wq], iters=5)
                except Exception as e:  # noqa: BLE001 - out of resources etc.: skip the config
                    log(f"  {name} M={M} {cfg.describe()}: {type(e).__name__}: {str(e)[:120]}")
                    continue
                results.append((ms, cfg))
            results.sort(key=lambda r: r[0])
            log(f"sweep {name} M={M}: default {default.describe()}")
            for ms, cfg in results[:5]:
                log(f"    {cfg.describe():40s} {ms * 1e3:9.1f} us {flop / (ms * 1e-3) / 1e12:7.1f} TFLOP/s")
            if results:
                d = next((ms for ms, cfg in results if cfg == default), float("nan"))
                best.append((name, M, results[0][1], results[0][0], d, flop))
        del wq
        torch.cuda.empty_cache()
    log("\nbest tile per shape and M (vs the table's default):")
    for name, M, cfg, ms, d, flop in best:
        log(f"  {name:8s} M={M:6d} {cfg.describe():40s} {flop / (ms * 1e-3) / 1e12:7.1f} TFLOP/s "
            f"(default {flop / (d * 1e-3) / 1e12:7.1f})")


# ---------------------------------------------------------------------------------------------
# named tiles (tiles.INT8_TILES): one compile each, every shape at a few M, bf16 alongside
# ---------------------------------------------------------------------------------------------

def tile_names(arg: str) -> list[str]:
    names = list(tiles.INT8_TILES) if arg == "all" else [n.strip() for n in arg.split(",") if n.strip()]
    unknown = [n for n in names if n not in tiles.INT8_TILES]
    if unknown:
        raise SystemExit(f"unknown tiles {unknown}; known: {', '.join(tiles.INT8_TILES)}")
    return names


def check_tiles(names) -> int:
    """Each named tile against exact references: the int32 accumulator at M = 2048 (the timed
    specialization) and M = 333 (a partial M tile), and the scaled bf16 output with and without
    bias at 333, on qkv and down (K = 14336: 112 K tiles)."""
    gen = torch.Generator(device=DEVICE).manual_seed(3)
    failures = 0
    for shape in ("qkv", "down"):
        K, N = SHAPES[shape]
        w, ws = int8_weight(N, K, gen)
        bias = torch.randn(N, device=DEVICE, dtype=torch.bfloat16, generator=gen)
        for M in (2048, 333):
            x = torch.randn(M, K, device=DEVICE, dtype=torch.bfloat16, generator=gen)
            q, s = G.quantize_int8_per_token(x)
            q[0] = -128  # the extremes: -128 * -128 over all of K
            w[0] = -128
            acc_ref = (q.double() @ w.double().t()).to(torch.int32)
            mag = (q.double().abs() @ w.double().abs().t()).float()
            for name in names:
                cfg = tiles.INT8_TILES[name]
                try:
                    acc = G.int8_gemm(q, None, w, None, out_dtype=torch.int32, config=cfg)
                    bad = (acc != acc_ref).sum().item()
                    if M != 2048:
                        for b in (None, bias):
                            bad += beyond_one_rounding(G.int8_gemm(q, s, w, ws, b, config=cfg), acc_ref, mag, s, ws, b)
                except Exception as e:  # noqa: BLE001 - report every tile
                    log(f"FAIL tile {name} {shape} M={M}: {type(e).__name__}: {str(e)[:300]}")
                    failures += 1
                    continue
                if bad:
                    failures += 1
                    log(f"FAIL tile {name} {shape} M={M}: {bad} wrong values")
                else:  # one line per launch group, so that a hang names its tile
                    log(f"  check {shape} M={M} {name}: exact")
            del acc_ref, mag
    log(f"check tiles: {failures} failure(s) over {len(names)} tiles")
    return failures


def time_tiles(names, ms_list):
    """µs per shape and M: bf16 F.linear, the table's default (int8_gemm without a config) and every
    named tile on already-quantized activations; then the sum over the four matmuls of an 8B layer."""
    import time
    gen = torch.Generator(device=DEVICE).manual_seed(4)
    methods = ["bf16", "default"] + list(names)
    us = {}  # (method, shape, M) -> µs
    first_call = {}
    for shape, (K, N) in SHAPES.items():
        wb = [(torch.randn(N, K, device=DEVICE, generator=gen) * 0.02).to(torch.bfloat16)
              for _ in range(copies_for(2 * N * K))]
        wq = [int8_weight(N, K, gen) for _ in range(copies_for(N * K))]
        for M in ms_list:
            x = torch.randn(M, K, device=DEVICE, dtype=torch.bfloat16, generator=gen)
            q, s = G.quantize_int8_per_token(x)
            for method in methods:
                if method == "bf16":
                    fns = [lambda w=w: F.linear(x, w) for w in wb]
                else:
                    cfg = None if method == "default" else tiles.INT8_TILES[method]
                    fns = [lambda w=w, cfg=cfg: G.int8_gemm(q, s, w[0], w[1], config=cfg) for w in wq]
                try:
                    if method not in first_call:  # the compile, once per kernel variant
                        t = time.perf_counter()
                        fns[0]()
                        torch.cuda.synchronize()
                        first_call[method] = time.perf_counter() - t
                    ms = graph_ms(fns, iters=10)
                except Exception as e:  # noqa: BLE001 - report and go on
                    log(f"  {shape} M={M} {method}: ERROR {type(e).__name__}: {str(e)[:200]}")
                    continue
                us[(method, shape, M)] = ms * 1e3
                log(f"  {shape:8s} M={M:6d} {method:26s} {ms * 1e3:9.1f} us "
                    f"{2 * M * N * K / (ms * 1e-3) / 1e12:7.1f} TOP/s")
            del x, q, s
        del wb, wq
        torch.cuda.empty_cache()
    log("\nfirst calls (compile + run), s: " + ", ".join(f"{m} {t:.1f}" for m, t in first_call.items()))
    for M in ms_list:
        log(f"\nM = {M}: µs per matmul, the layer's sum (qkv + o + gate_up + down) and x bf16 (layer sum)")
        log(f"{'method':26s} " + " ".join(f"{n:>9s}" for n in SHAPES) + f" {'layer':>9s} {'x bf16':>7s}")
        base = sum(us.get(("bf16", n, M), float("nan")) for n in SHAPES)
        rows = []
        for method in methods:
            cells = [us.get((method, n, M), float("nan")) for n in SHAPES]
            rows.append((sum(cells), method, cells))
        for total, method, cells in sorted(rows, key=lambda r: (r[1] != "bf16", r[0])):
            log(f"{method:26s} " + " ".join(f"{c:9.1f}" for c in cells) + f" {total:9.1f} {base / total:7.2f}")
        best = [min((us.get((m, n, M), float("inf")), m) for m in names) for n in SHAPES]
        total = sum(b[0] for b in best)
        log(f"{'best tile per shape':26s} " + " ".join(f"{b[0]:9.1f}" for b in best) + f" {total:9.1f} {base / total:7.2f}")
        log("  best: " + ", ".join(f"{n} {b[1]}" for n, b in zip(SHAPES, best)))


def compile_only(ms_list, tiles_only=()) -> int:
    """Every kernel variant the table, --check and --sweep launch, compiled for sm_90a on this
    machine (no GPU needed: benchmarks/quant_kernels_compile.py's stand-in driver); prints registers,
    spills and shared memory per variant."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import quant_kernels_compile as QC
    compiled: list = []
    QC.install_fake_sm90_driver(compiled)
    jobs = []
    for name, (K, N) in SHAPES.items():
        w, ws, b = torch.empty(N, K, dtype=torch.int8), torch.empty(N), torch.empty(N, dtype=torch.bfloat16)
        for M in sorted(set(ms_list) | ({333} if tiles_only else {1, 16, 33, 100})):
            x, q, s = torch.empty(M, K, dtype=torch.bfloat16), torch.empty(M, K, dtype=torch.int8), torch.empty(M, 1)
            jobs.append((f"quant {name} M={M}", lambda x=x: G.quantize_int8_per_token(x)))
            if tiles_only:  # what --tiles --check and the timings launch
                for n in tiles_only:
                    c = tiles.INT8_TILES[n]
                    jobs += [(f"{name} M={M} {n}", lambda q=q, s=s, w=w, ws=ws, c=c: G.int8_gemm(q, s, w, ws, config=c)),
                             (f"{name} M={M} {n} bias", lambda q=q, s=s, w=w, ws=ws, b=b, c=c: G.int8_gemm(q, s, w, ws, b, config=c)),
                             (f"{name} M={M} {n} raw", lambda q=q, w=w, c=c: G.int8_gemm(q, None, w, None, out_dtype=torch.int32,
                                                                                        config=c))]
                continue
            cfgs = [tiles.int8_gemm_tiles(M, N, K)] + (sweep_configs(M) + [WS_CONFIG] if M > 256 else [])
            jobs += [(f"{name} M={M} {c.describe()}", lambda q=q, s=s, w=w, ws=ws, c=c: G.int8_gemm(q, s, w, ws, config=c))
                     for c in cfgs]
    return QC.compile_jobs(jobs, compiled, log)


def parse_ms(s: str) -> list[int]:
    try:
        ms = [int(v) for v in s.split(",") if v.strip()]
    except ValueError:
        raise SystemExit(f"--m / --sweep-m take comma-separated token counts, got {s!r}")
    if not ms or min(ms) < 1:
        raise SystemExit(f"token counts must be positive, got {s!r}")
    return ms


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--m", default=",".join(map(str, DEFAULT_M)), help="token counts of the table")
    ap.add_argument("--check", action="store_true", help="kernels against exact references, then the table")
    ap.add_argument("--sweep", action="store_true", help="tile sweep instead of the table")
    ap.add_argument("--sweep-m", default="256,1024,4096,16384")
    ap.add_argument("--sweep-only", default="", help="sweep only configurations whose description has this "
                    "text (e.g. 'tma')")
    ap.add_argument("--tiles", default="", help="named tiles of tiles.INT8_TILES ('all' or comma-separated): "
                    "with --check, each against exact references; then every shape at --tiles-m with bf16 "
                    "and the table's default, and the 8B layer's sum per M")
    ap.add_argument("--tiles-m", default="512,2048,8192")
    ap.add_argument("--no-compile", action="store_true", help="time the int_mm path as eager torch ops")
    ap.add_argument("--compile-only", action="store_true",
                    help="no GPU: compile every variant for sm_90a and print registers / spills / smem")
    args = ap.parse_args(argv)
    tiles = tile_names(args.tiles) if args.tiles else []
    ms_list = parse_ms(args.tiles_m if tiles else args.m)
    sweep_ms = parse_ms(args.sweep_m)
    if args.compile_only:
        raise SystemExit(1 if compile_only(ms_list, tiles) else 0)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/int8_gemm.py needs a CUDA GPU")
    log(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    if tiles:
        if args.check and check_tiles(tiles):
            raise SystemExit(1)
        time_tiles(tiles, ms_list)
        return
    if args.check and check(ms_list):
        raise SystemExit(1)
    if args.sweep:
        sweep(sweep_ms, args.sweep_only)
        return
    rows = run_table(ms_list, compiled=not args.no_compile)
    print_table(rows, ms_list)


if __name__ == "__main__":
    main()
