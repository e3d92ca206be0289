"""The fused MoE kernel's share of a step's GPU time (issue "model families"), on a MoE config.

    python benchmarks/moe_share.py [--config benchmarks/configs/mixtral-8x7b] [--requests 512]

Runs an offline workload (random token ids, ignore_eos) through the engine with graphs as served,
once to warm up and once under torch.profiler, then sums the CUDA kernels' device time: the MoE
GEMM and its token alignment (`_moe_gemm_kernel`, `_align_kernel` in kernels/moe/fused_moe.py)
against every kernel of the run, for the whole run and for its pure-decode and prefill-carrying
phases (split by the steps' token counts from the scheduler). Prints a table last.
"""
from __future__ import annotations

import argparse
import collections
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

MOE_KERNELS = ("_moe_gemm_kernel", "_align_kernel")
DEFAULT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "mixtral-8x7b")


def kernel_times(prof) -> collections.Counter:
    times = collections.Counter()
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            times[evt.name] += evt.device_time_total if hasattr(evt, "device_time_total") else evt.cuda_time_total
    return times


def run(llm, n: int, inp: int, out: int, seed: int):
    from splitserve import SamplingParams
    rng = random.Random(seed)
    prompts = [{"prompt_token_ids": [rng.randrange(1000, 30000) for _ in range(inp)]} for _ in range(n)]
    params = SamplingParams(max_tokens=out, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=DEFAULT)
    ap.add_argument("--requests", type=int, default=512)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--max-num-seqs", type=int, default=512)
    a = ap.parse_args()
    from splitserve import LLM
    llm = LLM(a.config, random_weights=True, dtype="bfloat16", max_model_len=4096, max_num_seqs=a.max_num_seqs)
    run(llm, 64, a.input_len, 16, 0)  # warm-up
    rows = []
    for label, inp, out in (("prefill-heavy: 1 output token", a.input_len, 1),
                            (f"whole run: {a.input_len} in / {a.output_len} out", a.input_len, a.output_len),
                            ("decode-heavy: 16 in / 256 out", 16, 256)):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            wall = run(llm, a.requests, inp, out, 1 + len(rows))
            torch.cuda.synchronize()
        times = kernel_times(prof)
        total = sum(times.values())
        moe = sum(t for name, t in times.items() if any(k in name for k in MOE_KERNELS))
        rows.append((label, wall, total / 1e6, moe / 1e6))
        top = ", ".join(f"{name[:40]} {t / total:.0%}" for name, t in times.most_common(4))
        print(f"{label}: top kernels {top}", flush=True)
    print(f"\nMoE kernel share, {os.path.basename(os.path.normpath(a.config))}, {a.requests} requests, "
          f"{torch.cuda.get_device_name()}")
    for label, wall, total, moe in rows:
        print(f"{label:<40} wall {wall:7.2f} s  kernels {total:7.2f} s  MoE {moe:7.2f} s = {moe / total:5.1%}")


if __name__ == "__main__":
    main()
