"""The Llama-3-8B step's matmuls with quantized weights: library ops against quant_kernels' Triton kernels.

    python benchmarks/quant_kernels.py [--check] [--sweep] [--m 1,16,64,256,2048] [--layers 32]

One step = 32 layers x (qkv 4096->6144, o 4096->4096, gate_up 4096->28672, down 14336->4096) + the
LM head 4096->128256 in bf16, every layer with its own weights (nothing served from L2), captured in
one CUDA graph per method and token count M, median of replays. Methods: bf16 F.linear; FP8 per-channel
weights with torch._scaled_mm (x already quantized, and with the per-token quantization kernel);
fp8_gemm in its activation modes (group: quantized in the kernel; token: quantization launch + kernel;
none: W8A16); fp8_linear (the dispatcher); int4 group-128: aten._weight_int4pack_mm, wna16_gemm (tl.dot
split-K kernel), wna16_gemv (the decode GEMV, up to 8 tokens) and wna16_linear. Each row gives ms per step, % of the bandwidth limit (weight + activation bytes at the
measured copy bandwidth) and TFLOP/s.

--check: every kernel against the torch reference on fresh random inputs at every shape and M
         (the GEMV also at M = 1, 2, 4, 8, int4 with zero points / int8, bf16 / fp16), and once
         through CUDA-graph replays (split-K counters). Prints FAIL lines.
--sweep: tile configurations per shape at M = 1, 16, 64 (the GEMV: 1, 2, 4, 8), compiled in parallel
         first, best first.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from multiprocessing import get_context

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from splitserve.kernels.gemm import reference as R  # noqa: E402
from splitserve.kernels.gemm.fp8 import fp8_gemm as FP8  # noqa: E402
from splitserve.kernels.gemm.tiles import TileConfig  # noqa: E402
from splitserve.kernels.gemm.wna16 import wna16_gemm as WNA  # noqa: E402
from splitserve.kernels.gemm.wna16 import wna16_gemv as GEMV  # noqa: E402

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}  # (K, N)
LM_HEAD = (4096, 128256)
GROUP = 128
FP8_MODES = {"fp8 group": "group", "fp8 token": "token", "fp8 W8A16": "none"}


def log(*a):
    print(*a, flush=True)


def graph_ms(fn, iters: int = 10) -> float:
    """fn once eagerly (compiles, allocates counters), captured in a CUDA graph, median replay in ms."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(2):
        g.replay()
    times = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        g.replay()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    del g
    return statistics.median(times)


def copy_bandwidth() -> float:
    """Device-to-device copy of 2 GiB, bytes read + written per second."""
    a = torch.empty(1 << 31, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ms = graph_ms(lambda: b.copy_(a), iters=10)
    return 2 * (1 << 31) / (ms * 1e-3)


# ---------------------------------------------------------------------------------------------
# weights
# ---------------------------------------------------------------------------------------------

def rand_fp8(N, K, gen):
    w = torch.randn(N, K, device="cuda", generator=gen) * 0.02
    s = w.abs().amax(1).clamp(min=1e-10) / 448
    return (w / s[:, None]).to(torch.float8_e4m3fn), s.contiguous()


def rand_int4(N, K, gen):
    qweight = torch.randint(-2**31, 2**31 - 1, (K // 8, N), dtype=torch.int32, device="cuda", generator=gen)
    scales = (torch.rand(K // GROUP, N, device="cuda", generator=gen) * 0.01 + 0.001).to(torch.bfloat16)
    return qweight, scales


def rand_tinygemm(N, K, gen):
    w = torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, device="cuda", generator=gen)
    packed = torch._convert_weight_to_int4pack(w, 8)
    sz = (torch.rand(K // GROUP, N, 2, device="cuda", generator=gen) * 0.01).to(torch.bfloat16)
    return packed, sz


class Weights:
    def __init__(self, layers: int, kinds: set[str]):
        gen = torch.Generator(device="cuda").manual_seed(0)
        self.layers = layers
        self.bf16, self.fp8, self.fp8b, self.int4, self.tiny = {}, {}, {}, {}, {}
        for name, (K, N) in SHAPES.items():
            if "bf16" in kinds:
                self.bf16[name] = [(torch.randn(N, K, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
                                   for _ in range(layers)]
            if "fp8" in kinds:
                self.fp8[name] = [rand_fp8(N, K, gen) for _ in range(layers)]
                # the same fp8 weights with 128x128 block scales (block-wise checkpoints)
                self.fp8b[name] = [(q, torch.rand(-(-N // 128), -(-K // 128), device="cuda", generator=gen) * 1e-4
                                    + 1e-5) for q, _ in self.fp8[name]]
            if "int4" in kinds:
                self.int4[name] = [rand_int4(N, K, gen) for _ in range(layers)]
            if "tiny" in kinds:
                try:
                    self.tiny[name] = [rand_tinygemm(N, K, gen) for _ in range(layers)]
                except Exception as e:  # noqa: BLE001 - a baseline we cannot build is reported, not fatal
                    log(f"int4pack weights: {type(e).__name__}: {str(e)[:300]}")
        K, N = LM_HEAD
        self.lm_head = (torch.randn(N, K, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)


def linear_fn(method: str, x: torch.Tensor, xq, w, name: str):
    """One matmul of `method` for weight w of shape `name`; x bf16 [M, K], xq its per-token fp8 copy."""
    if method == "bf16":
        return lambda: F.linear(x, w)
    if method == "scaled_mm (x pre-quantized)":
        q, s = xq
        return lambda: FP8.scaled_mm_linear(q, s, w[0], w[1], None, torch.bfloat16)
    if method == "quant + scaled_mm":
        return lambda: FP8.scaled_mm_linear(*FP8.quantize_fp8_per_token(x), w[0], w[1], None, torch.bfloat16,
                                            fast_accum=False)
    if method == "quant + scaled_mm fast":
        return lambda: FP8.scaled_mm_linear(*FP8.quantize_fp8_per_token(x), w[0], w[1], None, torch.bfloat16,
                                            fast_accum=True)
    if method == "fp8 token":
        return lambda: FP8.fp8_gemm(*FP8.quantize_fp8_per_token(x), w[0], w[1])
    if method in FP8_MODES:
        return lambda: FP8.fp8_gemm(x, None, w[0], w[1], act=FP8_MODES[method])
    if method in ("fp8_linear", "fp8_linear block"):
        return lambda: FP8.fp8_linear(x, w[0], w[1])
    if method == "int4pack_mm":
        return lambda: torch._weight_int4pack_mm(x, w[0], GROUP, w[1])
    if method == "wna16 kernel":
        return lambda: WNA.wna16_gemm(x, w[0], w[1], None, bits=4, group_size=GROUP)
    if method == "wna16 gemv":
        return lambda: GEMV.wna16_gemv(x, w[0], w[1], None, bits=4, group_size=GROUP)
    if method == "wna16 dequant+mm":
        return lambda: torch.mm(x, WNA.wna16_dequantize(w[0], w[1], None, bits=4, group_size=GROUP))
    if method == "wna16_linear":
        return lambda: WNA.wna16_linear(x, w[0], w[1], None, bits=4, group_size=GROUP)
    raise ValueError(method)


METHOD_WEIGHTS = {"bf16": "bf16", "scaled_mm (x pre-quantized)": "fp8", "quant + scaled_mm": "fp8", "quant + scaled_mm fast": "fp8",
                  "fp8 group": "fp8", "fp8 token": "fp8", "fp8 W8A16": "fp8", "fp8_linear": "fp8",
                  "fp8_linear block": "fp8b",
                  "int4pack_mm": "tiny", "wna16 kernel": "int4", "wna16 gemv": "int4", "wna16 dequant+mm": "int4",
                  "wna16_linear": "int4"}
BYTES_PER_WEIGHT = {"bf16": 2.0, "fp8": 1.0, "fp8b": 1.0, "tiny": 0.5 + 4 / GROUP, "int4": 0.5 + 2 / GROUP}


def step_table(W: Weights, ms_list, methods, bw):
    rows = []
    Kl, Nl = LM_HEAD
    for M in ms_list:
        gen = torch.Generator(device="cuda").manual_seed(M)
        xs = {K: torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=gen) for K in (4096, 14336)}
        xqs = {K: FP8.quantize_fp8_per_token(x) for K, x in xs.items()}
        lm = lambda: F.linear(xs[4096], W.lm_head)  # noqa: E731
        for method in methods:
            if method == "int4pack_mm" and M > 16:
                continue
            if method == "wna16 dequant+mm" and M < 256:
                continue
            if method == "wna16 gemv" and M > GEMV.GEMV_MAX_ROWS:
                continue
            store = getattr(W, METHOD_WEIGHTS[method])
            if not store:
                continue
            try:
                fns = [linear_fn(method, xs[K], xqs[K], store[name][layer], name)
                       for layer in range(W.layers) for name, (K, N) in SHAPES.items()]
                ms = graph_ms(lambda: ([f() for f in fns], lm()))
            except Exception as e:  # noqa: BLE001 - report and go on: one call must give every answer it can
                log(f"  {method} M={M}: ERROR {type(e).__name__}: {str(e)[:300]}")
                continue
            elems = sum(K * N for K, N in SHAPES.values()) * W.layers
            act = sum(M * (K + N) * 2 for K, N in SHAPES.values()) * W.layers + M * (Kl + Nl) * 2
            limit_ms = (elems * BYTES_PER_WEIGHT[METHOD_WEIGHTS[method]] + Kl * Nl * 2 + act) / bw * 1e3
            tflops = 2 * M * (elems + Kl * Nl) / (ms * 1e-3) / 1e12
            rows.append(dict(M=M, method=method, ms=ms, limit_ms=limit_ms, pct=100 * limit_ms / ms, tflops=tflops))
            log(f"  M={M:5d} {method:28s} {ms:8.3f} ms  limit {limit_ms:6.3f}  {100 * limit_ms / ms:5.1f}%  "
                f"{tflops:7.1f} TFLOP/s")
    return rows


# ---------------------------------------------------------------------------------------------
# correctness on the GPU
# ---------------------------------------------------------------------------------------------

def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def linear_act(M: int) -> str:
    """The activation handling fp8_linear uses for M tokens with per-channel weight scales: "none"
    (W8A16) on the GEMV route, else per-group in the kernel, else per token."""
    if FP8.fp8_route(M, 1, None) == "gemv":
        return "none"
    return "token" if M > FP8.FP8_TRITON_MAX_M else FP8.fp8_small_m_act(M)


def check(ms_list) -> int:
    from splitserve.kernels.gemm.wna16 import wna16_layout as L
    fails = 0

    def report(what, err, tol=4e-3):
        nonlocal fails
        bad = not (err < tol)
        fails += bad
        if bad or "M=1 " in what or "graph" in what or "scaled_mm" in what:
            log(f"  {'FAIL' if bad else 'ok  '} {what}: rel err {err:.2e}")

    gen = torch.Generator(device="cuda").manual_seed(1234)
    for name, (K, N) in SHAPES.items():
        w = torch.randn(N, K, device="cuda", generator=gen) * 0.02
        wq, ws = R.quantize_fp8_weight_ref(w)
        wqb, wsb = R.quantize_fp8_weight_ref(w, block=True)
        i4 = L.quantize_rtn(w, 4, GROUP, symmetric=False)
        i8 = L.quantize_rtn(w, 8, GROUP, symmetric=True)
        bias = torch.randn(N, device="cuda", generator=gen).to(torch.bfloat16)
        for M in ms_list:
            x = torch.randn(M, K, device="cuda", generator=gen).to(torch.bfloat16)
            try:
                for act in ("group", "none"):
                    report(f"fp8_gemm act={act} {name} M={M} ", rel(FP8.fp8_gemm(x, None, wq, ws, bias, act=act),
                                                                   R.fp8_linear_ref(x, wq, ws, bias, act=act)))
                q, s = FP8.quantize_fp8_per_token(x)
                report(f"fp8_gemm token {name} M={M} ", rel(FP8.fp8_gemm(q, s, wq, ws, bias),
                                                           R.fp8_linear_ref(x, wq, ws, bias, act="token")))
                report(f"fp8_linear block {name} M={M} ", rel(FP8.fp8_linear(x, wqb, wsb, bias),
                                                             R.fp8_linear_ref(x, wqb, wsb, bias, act="group")))
                report(f"fp8_linear {name} M={M} ", rel(FP8.fp8_linear(x, wq, ws, bias),
                                                       R.fp8_linear_ref(x, wq, ws, bias, act=linear_act(M))), tol=2e-2)
                if M >= 16:  # torch._scaled_mm, both accumulation modes (fp8_linear takes it above 64 tokens)
                    ref = R.fp8_linear_ref(x, wq, ws, bias, act="token")
                    for fast in (False, True):
                        report(f"scaled_mm fast_accum={fast} {name} M={M} ",
                               rel(FP8.scaled_mm_linear(q, s, wq, ws, bias, torch.bfloat16, fast_accum=fast), ref))
                for wi, bits in ((i4, 4), (i8, 8)):
                    ref = R.wna16_gemm_ref(x, wi.qweight, wi.scales, wi.zeros, bits=bits, group_size=GROUP, bias=bias)
                    report(f"wna16_gemm int{bits} {name} M={M} ",
                           rel(WNA.wna16_gemm(x, wi.qweight, wi.scales, wi.zeros, bits=bits, group_size=GROUP, bias=bias), ref))
                    report(f"wna16_linear int{bits} {name} M={M} ",
                           rel(WNA.wna16_linear(x, wi.qweight, wi.scales, wi.zeros, bits=bits, group_size=GROUP, bias=bias), ref))
            except Exception as e:  # noqa: BLE001
                fails += 1
                log(f"  FAIL {name} M={M}: {type(e).__name__}: {str(e)[:400]}")
        # the decode GEMV at every token count it takes, default tiles and a second configuration
        for M in (1, 2, 4, 8):
            for dtype in (torch.bfloat16, torch.float16):
                x = torch.randn(M, K, device="cuda", generator=gen).to(dtype)
                try:
                    for wi, bits in ((i4, 4), (i8, 8)):
                        b = bias.to(dtype)
                        ref = R.wna16_gemm_ref(x, wi.qweight, wi.scales, wi.zeros, bits=bits, group_size=GROUP, bias=b)
                        bk = 128 if M <= 2 else 32  # the second: 4 columns per thread, prefetch up to 2 rows
                        cfgs = [None, TileConfig(block_n=256, block_k=bk, split_k=GEMV.gemv_split_for(N, K, 256, bk, 132, 2),
                                                num_warps=2, num_stages=1, prefetch=M <= 2)]
                        for cfg in cfgs:
                            out = GEMV.wna16_gemv(x, wi.qweight, wi.scales, wi.zeros, bits=bits, group_size=GROUP,
                                                  bias=b, config=cfg)
                            report(f"wna16_gemv int{bits} {str(dtype)[6:]} {name} M={M} "
                                   f"{'default' if cfg is None else cfg}", rel(out, ref),
                                   tol=4e-3 if dtype == torch.bfloat16 else 1e-3)
                except Exception as e:  # noqa: BLE001
                    fails += 1
                    log(f"  FAIL wna16_gemv {name} M={M}: {type(e).__name__}: {str(e)[:400]}")
    # split-K under CUDA-graph replay: fresh inputs copied into the captured buffers, three replays
    K, N = SHAPES["o"]
    w = torch.randn(N, K, device="cuda", generator=gen) * 0.02
    wq, ws = R.quantize_fp8_weight_ref(w)
    i4 = L.quantize_rtn(w, 4, GROUP)
    x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
    fns = {"fp8_linear": lambda: FP8.fp8_linear(x, wq, ws),
           "wna16_linear": lambda: WNA.wna16_linear(x, i4.qweight, i4.scales, None, bits=4, group_size=GROUP),
           "wna16_gemm": lambda: WNA.wna16_gemm(x, i4.qweight, i4.scales, None, bits=4, group_size=GROUP),
           "wna16_gemv": lambda: GEMV.wna16_gemv(x, i4.qweight, i4.scales, None, bits=4, group_size=GROUP)}
    refs = {"fp8_linear": lambda: R.fp8_linear_ref(x, wq, ws, act=linear_act(1)),
            "wna16_linear": lambda: R.wna16_gemm_ref(x, i4.qweight, i4.scales, None, bits=4, group_size=GROUP)}
    refs["wna16_gemm"] = refs["wna16_gemv"] = refs["wna16_linear"]
    for what, fn in fns.items():
        fn()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = fn()
        for _ in range(3):
            x.copy_(torch.randn(1, K, device="cuda", generator=gen))
            out.fill_(float("nan"))
            g.replay()
            report(f"{what} in a CUDA graph, o M=1", rel(out, refs[what]()))
    log(f"check: {fails} failures")
    return fails


# ---------------------------------------------------------------------------------------------
# sweep
# ---------------------------------------------------------------------------------------------

def split_for(M, N, K, bm, bn, bk, waves, sms=132):
    tiles = -(-M // bm) * -(-N // bn)
    k_tiles = K // bk
    split = 1
    while tiles * split < waves * sms and split * 2 <= max(1, k_tiles // 4):
        split *= 2
    return split


def gemv_sweep_configs(M: int, K: int, N: int):
    """GEMV tiles: (BLOCK_N, warps) gives the columns per thread (BLOCK_N / (32 * warps): 4, 8 or 16),
    BLOCK_K the word rows (warps past BLOCK_N / 128 split the K rows and reduce through shared
    memory); words per thread <= 128 / M (the sm_90 compile spills past that at 4 tokens), and
    <= 64 / M with the next tile prefetched into registers."""
    out = []
    for bn, warps in ((256, 2), (512, 2), (512, 4), (1024, 4), (1024, 2), (256, 1), (256, 4)):
        for bk in (32, 64, 128):
            words = (bk // 8) * bn // (32 * warps)
            if words > 128 // M:
                continue
            for per_sm in (2, 4, 8):
                split = GEMV.gemv_split_for(N, K, bn, bk, 132, per_sm)
                out.append(TileConfig(block_n=bn, block_k=bk, split_k=split, num_warps=warps, num_stages=1))
                if words <= 64 // M:  # register prefetch doubles the words held (spills past this)
                    out.append(TileConfig(block_n=bn, block_k=bk, split_k=split, num_warps=warps, num_stages=1,
                                          prefetch=True))
    return list(dict.fromkeys(out))


def sweep_configs(kind: str, M: int, K: int, N: int):
    if kind == "wna16_gemv":
        return gemv_sweep_configs(M, K, N)
    bms = (16,) if M <= 16 else (32, 64)
    out = []
    for bm in bms:
        if kind == "wna16":
            for bn in (32, 64, 128):
                for stages in (3, 5):
                    for bcast in (False, True):
                        for waves in (1, 2):
                            out.append(TileConfig(block_m=bm, block_n=bn, block_k=128,
                                                  split_k=split_for(M, N, K, bm, bn, 128, waves), num_warps=4,
                                                  num_stages=stages, unpack_bcast=bcast))
        else:
            bks = (128,) if kind == "fp8 group" else (128, 256)
            bns = (32, 64, 128) if kind == "fp8 group" else (16, 32, 64)
            for bn in bns:
                for bk in bks:
                    for stages in (3, 5):
                        for waves in (1, 2):
                            out.append(TileConfig(block_m=bm, block_n=bn, block_k=bk,
                                                  split_k=split_for(M, N, K, bm, bn, bk, waves), num_warps=4,
                                                  num_stages=stages))
    return list(dict.fromkeys(out))


SWEEP_KINDS = ("fp8 group", "fp8 W8A16", "fp8 token", "wna16", "wna16_gemv")
SWEEP_M = (1, 16, 64)
SWEEP_M_OF = {"wna16_gemv": (1, 2, 4, 8)}  # token counts per kind (SWEEP_M otherwise)


def run_one(kind, x, w, cfg):
    if kind == "wna16_linear":
        return WNA.wna16_linear(x, w[0], w[1], None, bits=4, group_size=GROUP)
    if kind == "wna16":
        return WNA.wna16_gemm(x, w[0], w[1], None, bits=4, group_size=GROUP, config=cfg)
    if kind == "wna16_gemv":
        return GEMV.wna16_gemv(x, w[0], w[1], None, bits=4, group_size=GROUP, config=cfg)
    if kind == "fp8 token":
        return FP8.fp8_gemm(x[0], x[1], w[0], w[1], config=cfg)
    return FP8.fp8_gemm(x, None, w[0], w[1], act=FP8_MODES[kind], config=cfg)


def _precompile_job(jobs):
    """Child process: compile (and run once) each (kind, shape, M, cfg) into Triton's disk cache."""
    sys.path.insert(0, ROOT)
    gen = torch.Generator(device="cuda").manual_seed(0)
    done = 0
    for kind, name, M, cfg in jobs:
        K, N = SHAPES[name]
        w = rand_int4(N, K, gen) if kind.startswith("wna16") else rand_fp8(N, K, gen)
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=gen)
        if kind == "fp8 token":
            x = FP8.quantize_fp8_per_token(x)
        try:
            run_one(kind, x, w, cfg)
            done += 1
        except Exception:  # noqa: BLE001 - the parent times it again and reports the error
            pass
    torch.cuda.synchronize()
    return done


def precompile(ms_list, sweep_kinds, do_check: bool, workers: int):
    """Compile in parallel child processes into Triton's disk cache: one launch per compiled variant
    (shapes share a kernel when their ints specialize alike: M == 1 or not, everything else here is
    a multiple of 16; split counts only matter as 1 or more), the table's default configurations,
    and meanwhile the correctness check in its own process."""
    jobs, seen = [], set()

    def add(kind, name, M, cfg):
        m_key = M if kind == "wna16_gemv" else M == 1  # the GEMV compiles per BLOCK_M = next_power_of_2(M)
        key = (kind, m_key, M, None) if cfg is None else (kind, m_key, replace(cfg, split_k=min(cfg.split_k, 2)))
        if key not in seen:
            seen.add(key)
            jobs.append((kind, name, M, cfg))

    for kind in sweep_kinds:
        for name, (K, N) in SHAPES.items():
            for M in SWEEP_M_OF.get(kind, SWEEP_M):
                for cfg in sweep_configs(kind, M, K, N):
                    add(kind, name, M, cfg)
    for M in ms_list:
        for name in SHAPES:
            for kind in SWEEP_KINDS + ("wna16_linear",):
                if kind == "wna16_gemv" and M > GEMV.GEMV_MAX_ROWS:
                    continue
                add(kind, name, M, None)
    t0 = time.time()
    ctx = get_context("spawn")
    with ProcessPoolExecutor(1, mp_context=ctx) as checker, ProcessPoolExecutor(workers, mp_context=ctx) as pool:
        fails = checker.submit(check, ms_list) if do_check else None
        try:
            compiled = sum(pool.map(_precompile_job, [jobs[i::workers] for i in range(workers)]))
            log(f"precompiled {len(jobs)} launches ({compiled} ok) in {time.time() - t0:.0f} s")
        except Exception as e:  # noqa: BLE001 - a broken worker only costs compile time later
            log(f"precompile: {type(e).__name__}: {str(e)[:300]}")
        if fails is not None:
            try:
                log(f"check: {fails.result()} failures [{time.time() - t0:.0f} s]")
            except Exception as e:  # noqa: BLE001
                log(f"check: FAIL, the check process died: {type(e).__name__}: {str(e)[:300]}")


def sweep(W: Weights, kinds):
    results = {}
    for kind in kinds:
        store = W.int4 if kind.startswith("wna16") else W.fp8
        for M in SWEEP_M_OF.get(kind, SWEEP_M):
            for name, (K, N) in SHAPES.items():
                gen = torch.Generator(device="cuda").manual_seed(7)
                x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=gen)
                if kind == "fp8 token":
                    x = FP8.quantize_fp8_per_token(x)
                timed = []
                for cfg in sweep_configs(kind, M, K, N):
                    try:
                        ms = graph_ms(lambda: [run_one(kind, x, w, cfg) for w in store[name]], iters=5) / W.layers
                        timed.append((ms, cfg))
                    except Exception as e:  # noqa: BLE001
                        log(f"  {kind} {name} M={M} {cfg}: ERROR {type(e).__name__}: {str(e)[:200]}")
                timed.sort(key=lambda t: t[0])
                bytes_ = K * N * (BYTES_PER_WEIGHT["int4"] if kind.startswith("wna16") else 1.0)
                if timed:
                    best_ms, best = timed[0]
                    results[(kind, name, M)] = (best_ms, best)
                    log(f"  {kind:10s} {name:8s} M={M:3d} best {best_ms * 1e3:7.1f} us "
                        f"({bytes_ / best_ms / 1e9:5.2f} TB/s) {best}; next "
                        + ", ".join(f"{t * 1e3:.1f}" for t, _ in timed[1:4]) + f"; worst {timed[-1][0] * 1e3:.1f}")
    log("sweep summary: per-step estimate from each shape's best config (x32 layers, LM head excluded)")
    for kind in kinds:
        for M in SWEEP_M_OF.get(kind, SWEEP_M):
            tot = sum(results[(kind, n, M)][0] for n in SHAPES if (kind, n, M) in results) * W.layers
            log(f"  {kind:10s} M={M:3d}: {tot:.3f} ms  " + " ".join(
                f"{n}={results[(kind, n, M)][1]}" for n in SHAPES if (kind, n, M) in results))
    return results


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", default="1,16,32,64,128,256,2048")
    ap.add_argument("--sweep-kinds", default=",".join(SWEEP_KINDS))
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--no-table", action="store_true")
    ap.add_argument("--methods", default=",".join(METHOD_WEIGHTS))
    ap.add_argument("--workers", type=int, default=14)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    ms_list = [int(v) for v in args.m.split(",")]
    methods = args.methods.split(",")
    t0 = time.time()
    log(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton "
        f"{__import__('triton').__version__} SMs {torch.cuda.get_device_properties(0).multi_processor_count}")
    bws = [copy_bandwidth(), copy_bandwidth()]
    log("copy bandwidth " + ", ".join(f"{b / 1e12:.2f}" for b in bws) + " TB/s (read + write)")
    sweep_kinds = args.sweep_kinds.split(",") if args.sweep else []
    precompile(ms_list, sweep_kinds, args.check, args.workers)
    log(f"[{time.time() - t0:.0f} s]")
    kinds = {METHOD_WEIGHTS[m] for m in methods} if not args.no_table else set()
    kinds = {"fp8" if k == "fp8b" else k for k in kinds}
    if args.sweep:
        kinds |= {"fp8", "int4"}
    W = Weights(args.layers, kinds)
    log(f"weights ready [{time.time() - t0:.0f} s]")
    out = {"device": torch.cuda.get_device_name()}
    if args.sweep:
        res = sweep(W, sweep_kinds)
        out["sweep"] = {f"{k[0]}|{k[1]}|{k[2]}": [v[0], repr(v[1])] for k, v in res.items()}
        log(f"[{time.time() - t0:.0f} s]")
    bws.append(copy_bandwidth())
    bw = max(bws)
    log(f"copy bandwidth again {bws[-1] / 1e12:.2f} TB/s; the limits use the best, {bw / 1e12:.2f} TB/s")
    out["bw"] = bw
    if not args.no_table:
        rows = step_table(W, ms_list, methods, bw)
        out["table"] = rows
        log(f"\nThe 8B step's matmuls ({args.layers} layers + bf16 LM head), CUDA graph, median of 10 replays; "
            f"limit = weight + activation bytes at {bw / 1e12:.2f} TB/s")
        header = f"{'method':28s}" + "".join(f"{'M=' + str(m):>17s}" for m in ms_list)
        log(header)
        for method in methods:
            cells = []
            for m in ms_list:
                r = next((r for r in rows if r["M"] == m and r["method"] == method), None)
                cells.append(f"{r['ms']:8.3f} ({r['pct']:3.0f}%)" if r else f"{'-':>15s}")
            log(f"{method:28s}" + "".join(f"{c:>17s}" for c in cells))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
    log(f"total {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
