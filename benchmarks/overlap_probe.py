"""Can memory-bound decode attention hide under compute-bound GEMMs on this GPU?

A step with ~1000 decode rows (1000 x 128/128) or ~3000 tokens of which ~360 decode (1000 x 1024/128)
spends ~25-30% of its time in decode attention, which reads the KV cache at ~2.8 TB/s while the
tensor cores idle, and ~65% in GEMMs that are compute-bound. Splitting the batch in two halves and
running half A's attention beside half B's GEMMs (two streams) would hide the attention if the two
kinds of kernel really share the GPU. This probe measures, for one layer's GEMM chain (o_proj,
gate_up, silu*mul, down, qkv) of M rows and the decode attention of S sequences of context L:

  gemm alone, attention alone, both one after the other, both on two streams at once,
  and the same with the GEMMs limited to fewer SMs (cuBLASLt SM-count target) or the attention put
  in a green context of a few SMs.

    python benchmarks/overlap_probe.py
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from splitserve.attention.ops.paged_attention import paged_decode_attention

HIDDEN, INTER, HQ, HKV, D, BLOCK = 4096, 14336, 32, 8, 128, 16


def make_gemm_chain(m: int, dtype=torch.bfloat16):
    dev = "cuda"
    w_o = torch.randn(HIDDEN, HQ * D, device=dev, dtype=dtype) * 0.02
    w_gu = torch.randn(2 * INTER, HIDDEN, device=dev, dtype=dtype) * 0.02
    w_d = torch.randn(HIDDEN, INTER, device=dev, dtype=dtype) * 0.02
    w_qkv = torch.randn((HQ + 2 * HKV) * D, HIDDEN, device=dev, dtype=dtype) * 0.02
    x = torch.randn(m, HQ * D, device=dev, dtype=dtype)

    def run():
        h = F.linear(x, w_o)
        gu = F.linear(h, w_gu)
        a = F.silu(gu[:, :INTER]) * gu[:, INTER:]
        h = F.linear(a, w_d)
        return F.linear(h, w_qkv)
    flops = 2 * m * HIDDEN * (HQ * D + 2 * INTER + (HQ + 2 * HKV) * D) + 2 * m * INTER * HIDDEN
    return run, flops


def make_attention(num_seqs: int, ctx: int, dtype=torch.bfloat16):
    dev = "cuda"
    blocks_per_seq = (ctx + BLOCK - 1) // BLOCK
    num_blocks = num_seqs * blocks_per_seq
    kv = torch.randn(num_blocks, 2, BLOCK, HKV, D, device=dev, dtype=dtype)
    tables = torch.randperm(num_blocks, device=dev, dtype=torch.int32).view(num_seqs, blocks_per_seq)
    seq_lens = torch.full((num_seqs,), ctx, device=dev, dtype=torch.int32)
    q = torch.randn(num_seqs, HQ, D, device=dev, dtype=dtype)
    out = torch.empty_like(q)

    def run():
        paged_decode_attention(q, kv, seq_lens, tables, ctx, D ** -0.5, out=out)
    kv_bytes = num_seqs * ctx * HKV * D * 2 * kv.element_size()
    return run, kv_bytes


def timed(fn, iters: int = 20) -> float:
    """ms per call, after a warm-up."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def concurrently(gemm, attn, side: torch.cuda.Stream):
    main = torch.cuda.current_stream()

    def run():
        side.wait_stream(main)
        with torch.cuda.stream(side):
            attn()
        gemm()
        main.wait_stream(side)
    return run


def graphed(fn):
    """The same launches captured in one CUDA graph (fork/join streams become graph branches)."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="500,500,192;1000,1000,192;1500,180,1100;3000,360,1100",
                    help="gemm_rows,attn_seqs,context; ...")
    ap.add_argument("--carveouts", default="0,16,32")
    ap.add_argument("--green", default="16,32")
    args = ap.parse_args()
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), torch.__version__)
    have_carveout = hasattr(torch._C, "_set_sm_carveout_experimental")
    green_ok = getattr(torch.cuda, "green_contexts", None) is not None and torch.cuda.green_contexts.SUPPORTED
    print(f"sm carveout api: {have_carveout}, green contexts: {green_ok}")
    rows = []
    side = torch.cuda.Stream()
    for case in args.cases.split(";"):
        m, s, ctx = (int(v) for v in case.split(","))
        gemm, flops = make_gemm_chain(m)
        attn, kv_bytes = make_attention(s, ctx)
        tg, ta = timed(gemm), timed(attn)
        seq = timed(lambda: (gemm(), attn()))
        conc = timed(concurrently(gemm, attn, side))
        res = {"case": case, "gemm": tg, "attn": ta, "seq": seq, "conc": conc,
               "tflops": flops / tg / 1e9, "kv_tbs": kv_bytes / ta / 1e9}
        try:
            res["conc_graph"] = timed(graphed(concurrently(gemm, attn, side)))
            res["seq_graph"] = timed(graphed(lambda: (gemm(), attn())))
        except Exception as e:  # noqa: BLE001 - a probe: report and go on
            print("graph capture failed:", repr(e)[:200])
        if have_carveout:
            prev = torch.backends.cuda.preferred_blas_library()
            torch.backends.cuda.preferred_blas_library("cublaslt")
            res["gemm_lt"] = timed(gemm)
            res["conc_lt"] = timed(concurrently(gemm, attn, side))
            for c in (int(v) for v in args.carveouts.split(",") if v):
                torch._C._set_sm_carveout_experimental(c)
                res[f"gemm_co{c}"] = timed(gemm)
                res[f"conc_co{c}"] = timed(concurrently(gemm, attn, side))
                torch._C._set_sm_carveout_experimental(None)
            torch.backends.cuda.preferred_blas_library(prev)
        if green_ok:
            for n in (int(v) for v in args.green.split(",") if v):
                try:
                    ctx_g = torch.cuda.green_contexts.GreenContext.create(num_sms=n)
                    gs = ctx_g.Stream()
                    with torch.cuda.stream(gs):
                        res[f"attn_gc{n}"] = timed(attn)
                    res[f"conc_gc{n}"] = timed(concurrently(gemm, attn, gs))
                except Exception as e:  # noqa: BLE001
                    print(f"green context {n}: {e!r}"[:200])
        rows.append(res)
        print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in res.items()}, flush=True)
    print("\ncase (gemm rows, attn seqs, ctx) | gemm ms (TFLOP/s) | attn ms (TB/s) | seq | concurrent | "
          "hidden share of attn")
    for r in rows:
        best = min(v for k, v in r.items() if k.startswith("conc"))
        hidden = (r["gemm"] + r["attn"] - best) / r["attn"]
        print(f"{r['case']:>16} | {r['gemm']:.3f} ({r['tflops']:.0f}) | {r['attn']:.3f} ({r['kv_tbs']:.2f}) | "
              f"{r['seq']:.3f} | best {best:.3f} | {hidden:.0%}")


if __name__ == "__main__":
    main()
