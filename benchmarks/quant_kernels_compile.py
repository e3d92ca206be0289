"""Compile the quant_kernels Triton kernels for the H100 (sm_90a) on a machine without a GPU.

    python benchmarks/quant_kernels_compile.py [--sass DIR]

The launchers (fp8_gemm, wna16_gemm, ...) run as they do on the GPU, with CPU tensors of the 8B
shapes, against a stand-in driver that reports an sm_90 target; every launch compiles (Triton's
front end, LLVM, the ptxas bundled with Triton) and is then skipped. Prints each compiled variant's
registers, stack (spills) and shared memory from cuobjdump: a compile error, a spill or a blown
shared-memory budget shows up here at no device time. --sass writes each variant's SASS to DIR.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def install_fake_sm90_driver(compiled: list):
    os.environ.pop("TRITON_INTERPRET", None)
    import triton.runtime.jit as jit
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    class Sm90NoDevice:
        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_active_torch_device(self):
            return torch.device("cpu")

        def is_active(self):
            return True

    driver.set_active(Sm90NoDevice())
    orig_run = jit.JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        kernel = orig_run(self, *args, grid=grid, warmup=True, **kwargs)  # compile, never launch
        compiled.append(kernel)
        return kernel

    jit.JITFunction.run = run


def main_loop(sass: str) -> str:
    """Instruction count of the longest backward-branch loop (the K loop) and its top opcodes."""
    import re
    from collections import Counter
    ins = []
    for ln in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)(.*?);", ln)
        if m:
            ins.append((int(m.group(1), 16), m.group(3), m.group(4)))
    loops = []
    for addr, op, rest in ins:
        t = re.search(r"0x([0-9a-f]+)", rest) if op.startswith("BRA") else None
        if t and int(t.group(1), 16) < addr:
            loops.append((int(t.group(1), 16), addr))
    if not loops:
        return "no loop"
    lo, hi = max(loops, key=lambda b: b[1] - b[0])
    body = [op for a, op, _ in ins if lo <= a <= hi]
    top = Counter(op.split(".")[0] for op in body).most_common(6)
    return f"loop {len(body)} instr: " + " ".join(f"{k}{v}" for k, v in top)


def resources(kernel, sass_dir: str | None) -> str:
    from triton import backends
    tools = os.path.join(os.path.dirname(backends.__file__), "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    res = subprocess.run([os.path.join(tools, "cuobjdump"), "-res-usage", f.name], capture_output=True, text=True).stdout
    line = next((ln.strip() for ln in res.splitlines() if "REG:" in ln), res.strip()[-200:])
    line = " ".join(w for w in line.split() if w.split(":")[0] in ("REG", "STACK", "LOCAL"))
    sass = subprocess.run([os.path.join(tools, "cuobjdump"), "-sass", f.name], capture_output=True, text=True).stdout
    line += "  " + main_loop(sass)
    if sass_dir:
        name = f"{kernel.name}_{abs(hash(kernel.hash)) % 10**8}.sass"
        with open(os.path.join(sass_dir, name), "w") as out:
            out.write(sass)
    os.unlink(f.name)
    return line


def compile_jobs(jobs, compiled: list, log=print, sass_dir: str | None = None) -> int:
    """Runs each (what, launch) of `jobs` under the stand-in driver (install_fake_sm90_driver(compiled)
    first) and prints every variant it compiled that no earlier job did: kernel, warps, stages, shared
    memory, registers/spills and the main loop. Prints the count and returns the number of failed jobs."""
    seen, failures = set(), 0
    for what, fn in jobs:
        before = len(compiled)
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - every failure is reported
            failures += 1
            log(f"FAIL {what}: {type(e).__name__}: {str(e)[:600]}")
            continue
        for k in compiled[before:]:
            if k is None or k.hash in seen:
                continue
            seen.add(k.hash)
            log(f"{what:40s} {k.name:28s} warps={k.metadata.num_warps} stages={k.metadata.num_stages} "
                f"smem={k.metadata.shared} {resources(k, sass_dir)}")
    log(f"{len(seen)} variants compiled, {failures} failures")
    return failures


def launches(FP8, WNA, GEMV, M, name, K, N):
    """The launches of one shape and token count (closures over this call's tensors)."""
    x = torch.empty(M, K, dtype=torch.bfloat16)
    w8 = torch.empty(N, K, dtype=torch.float8_e4m3fn)
    ws = torch.empty(N, dtype=torch.float32)
    wsb = torch.empty(-(-N // 128), -(-K // 128), dtype=torch.float32)
    qw = torch.empty(K // 8, N, dtype=torch.int32)
    qw8 = torch.empty(K // 4, N, dtype=torch.int32)
    sc = torch.empty(K // 128, N, dtype=torch.bfloat16)
    zs = torch.empty(K // 128, N, dtype=torch.uint8)
    xq = torch.empty(M, K, dtype=torch.float8_e4m3fn)
    xs = torch.empty(M, 1, dtype=torch.float32)
    xg = torch.empty(M, K // 128, dtype=torch.float32)
    return [
        (f"fp8 group {name} M={M}", lambda: FP8.fp8_gemm(x, None, w8, ws, act="group")),
        (f"fp8 none {name} M={M}", lambda: FP8.fp8_gemm(x, None, w8, ws, act="none")),
        (f"fp8 token {name} M={M}", lambda: FP8.fp8_gemm(xq, xs, w8, ws)),
        (f"fp8 grouped-act block {name} M={M}", lambda: FP8.fp8_gemm(xq, xg, w8, wsb)),
        (f"fp8 block group {name} M={M}", lambda: FP8.fp8_gemm(x, None, w8, wsb, act="group")),
        (f"quant token {name} M={M}", lambda: FP8.quantize_fp8_per_token(x)),
        (f"quant group {name} M={M}", lambda: FP8.quantize_fp8_per_group(x)),
        (f"wna16 int4 {name} M={M}", lambda: WNA.wna16_gemm(x, qw, sc, None, bits=4, group_size=128)),
        (f"wna16 int4 zp {name} M={M}", lambda: WNA.wna16_gemm(x, qw, sc, zs, bits=4, group_size=128)),
        (f"wna16 int8 {name} M={M}", lambda: WNA.wna16_gemm(x, qw8, sc, None, bits=8, group_size=128)),
        (f"wna16 int4 bcast {name} M={M}", lambda: WNA.wna16_gemm(
            x, qw, sc, None, bits=4, group_size=128,
            config=WNA.TileConfig(block_m=16 if M <= 16 else 64, block_n=64, block_k=128, split_k=2,
                                  unpack_bcast=True))),
        (f"wna16 dequant {name}", lambda: WNA.wna16_dequantize(qw, sc, None, bits=4, group_size=128)),
    ] + ([
        (f"wna16_gemv int4 {name} M={M}", lambda: GEMV.wna16_gemv(x, qw, sc, None, bits=4, group_size=128)),
        (f"wna16_gemv int4 zp {name} M={M}", lambda: GEMV.wna16_gemv(x, qw, sc, zs, bits=4, group_size=128)),
        (f"wna16_gemv int8 {name} M={M}", lambda: GEMV.wna16_gemv(x, qw8, sc, None, bits=8, group_size=128)),
    ] if M <= GEMV.GEMV_MAX_ROWS else [])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sass", default=None)
    args = ap.parse_args()
    compiled: list = []
    install_fake_sm90_driver(compiled)
    from splitserve.kernels.gemm.fp8 import fp8_gemm as FP8
    from splitserve.kernels.gemm.wna16 import wna16_gemm as WNA
    from splitserve.kernels.gemm.wna16 import wna16_gemv as GEMV

    shapes = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}
    jobs = []
    for M in (1, 4, 16, 64, 256, 2048):
        for name, (K, N) in shapes.items():
            jobs += launches(FP8, WNA, GEMV, M, name, K, N)
    failures = compile_jobs(jobs, compiled, sass_dir=args.sass)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
