"""Where a step's time goes on the device: host phases of the engine step vs GPU time.

    python benchmarks/profile_step.py [--kernels]   # Llama-3-8B shape, random bf16 weights

For each workload it prints the wall time per step split into host phases (schedule, prepare,
launch of forward + sampler, waiting for the GPU at the token copy, post-processing). A wait near
zero means the host is on the critical path: overlapping the next step's host work would help.
With --kernels it also prints the top CUDA kernels of one 8 x 2048 prefill step (torch.profiler).
"""
from __future__ import annotations

import argparse
import collections
import os
import random
import time

import torch

from splitserve import LLM, SamplingParams

CONFIG_8B = os.path.join(os.path.dirname(__file__), "configs", "llama3-8b")


class PhaseTimer:
    def __init__(self):
        self.total = collections.Counter()
        self.steps = 0
        self.originals = []

    def restore(self) -> None:
        for obj, name, fn, had in reversed(self.originals):
            if had:
                setattr(obj, name, fn)
            else:
                delattr(obj, name)

    def wrap(self, obj, name: str, phase: str):
        fn = getattr(obj, name)
        self.originals.append((obj, name, fn, name in obj.__dict__))

        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.total[phase] += time.perf_counter() - t
        setattr(obj, name, timed)

    def report(self, label: str, wall: float) -> str:
        per = {k: v / max(self.steps, 1) * 1e3 for k, v in self.total.items()}
        parts = ", ".join(f"{k} {v:.2f}" for k, v in sorted(per.items()))
        return f"{label}: {self.steps} steps, {wall / max(self.steps, 1) * 1e3:.2f} ms/step wall; per step ms: {parts}"


def instrument(llm: LLM) -> PhaseTimer:
    eng, runner = llm.engine, llm.engine.runner
    pt = PhaseTimer()
    pt.wrap(eng.scheduler, "schedule", "schedule")
    pt.wrap(eng.scheduler, "update", "sched_update")
    pt.wrap(runner, "prepare", "prepare")
    pt.wrap(runner, "_forward_logits", "forward_launch")
    pt.wrap(runner, "sampler", "sampler_launch")
    step = eng.step
    pt.originals.append((eng, "step", step, False))

    def counted():
        pt.steps += 1
        t = time.perf_counter()
        out = step()
        pt.total["step_total"] += time.perf_counter() - t
        return out
    eng.step = counted
    return pt


def profile_steps(llm: LLM, ps, params) -> None:
    """Each step of one run, synchronised before and after so its wall time is its own: grouped by
    kind (pure decode / mixed) and size; then the top kernels of a window of pure-decode steps."""
    from torch.profiler import ProfilerActivity, profile
    eng, runner = llm.engine, llm.engine.runner
    launch = runner.launch
    rows = []

    def timed(sched, inflight=None):
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = launch(sched, inflight)
        torch.cuda.synchronize()
        n_tok = sched.total_num_scheduled_tokens
        rows.append((len(sched.num_scheduled_tokens), n_tok, time.perf_counter() - t))
        return out
    runner.launch = timed
    prof = None
    for r in ps:
        eng.add_request(None, r, params, stream=False)
    while eng.has_unfinished_requests():
        if len(rows) == 40:
            prof = profile(activities=[ProfilerActivity.CUDA])
            prof.__enter__()
        eng.step()
        if len(rows) == 45 and prof is not None:
            torch.cuda.synchronize()
            prof.__exit__(None, None, None)
    del runner.launch
    groups = collections.defaultdict(list)
    for seqs, tok, dt in rows:
        kind = "decode" if seqs == tok else "mixed"
        groups[(kind, 1 << (tok - 1).bit_length())].append(dt)
    print("kind    tokens<=  steps  ms/step (mean)  total s")
    for (kind, cap), v in sorted(groups.items()):
        print(f"{kind:7s} {cap:8d} {len(v):6d} {sum(v) / len(v) * 1e3:14.2f} {sum(v):8.2f}")
    print(f"all steps: {sum(r[2] for r in rows):.2f} s (launch only, synchronised)")
    print("steps 40-44:", [(r[0], r[1], round(r[2] * 1e3, 1)) for r in rows[40:45]])
    if prof is not None:
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernels", action="store_true")
    ap.add_argument("--steps", action="store_true", help="per-step table + kernel profile of 1000 x 128/128")
    ap.add_argument("--trace", action="store_true",
                    help="kernel totals of batch-2 decode graph replays and of one whole 1000 x 128/128 run")
    ap.add_argument("--trace-run", default="", metavar="N,IN,OUT",
                    help="kernel totals, GPU gaps and step counts of one N x IN/OUT run (e.g. 1000,1024,128)")
    ap.add_argument("--decode-trace", action="store_true",
                    help="only the kernel totals of batch-2 decode graph replays (no workloads)")
    ap.add_argument("--max-num-seqs", type=int, default=1024)
    ap.add_argument("--config", default=CONFIG_8B, help="model directory (e.g. benchmarks/configs/llama3-8b-gptq-int4)")
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--tokenizer", default=None, help="a tokenizer directory, where the config has none")
    args = ap.parse_args()
    t0 = time.perf_counter()
    llm = LLM(args.config, random_weights=True, dtype="bfloat16", max_model_len=4096,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=16384, quantization=args.quantization,
              tokenizer=args.tokenizer)
    print(f"engine build {time.perf_counter() - t0:.1f} s")
    runner = llm.engine.runner
    for bs in (1, 2, 8, 64, 256, 512, 1024):
        g = runner.graphs.graphs.get((bs, False))
        if g is not None:
            print(f"decode graph replay bs={bs}: {replay_ms(g):.3f} ms")
    if args.decode_trace:
        decode_trace(llm)
        return
    rng = random.Random(5)
    vocab = llm.engine.config.model.vocab_size

    def prompts(n, length):
        return [[rng.randrange(1000, vocab - 1000) for _ in range(length)] for _ in range(n)]

    lines = []
    for label, n, inp, out in (("b1 decode 128/256", 1, 128, 256), ("1000 x 128/128", 1000, 128, 128),
                               ("prefill 8 x 2048", 8, 2048, 1)):
        llm.generate(prompts(min(n, 8), inp), SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
        pt = instrument(llm)
        torch.cuda.synchronize()
        t = time.perf_counter()
        llm.generate(prompts(n, inp), SamplingParams(max_tokens=out, temperature=0, ignore_eos=True), use_tqdm=False)
        wall = time.perf_counter() - t
        pt.restore()
        lines.append(pt.report(label, wall) + f"; total {wall:.2f} s")
    if args.steps:
        profile_steps(llm, prompts(1000, 128), SamplingParams(max_tokens=128, temperature=0, ignore_eos=True))
    if args.kernels:
        from torch.profiler import ProfilerActivity, profile
        ps = prompts(8, 2048)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            llm.generate(ps, SamplingParams(max_tokens=1, ignore_eos=True), use_tqdm=False)
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=70))
    if args.trace:
        trace(llm, prompts(1000, 128))
    if args.trace_run:
        n, inp, out = (int(x) for x in args.trace_run.split(","))
        lines.append(trace_run(llm, prompts(n, inp), out, f"one {n} x {inp}/{out} run"))
    print("\n".join(lines))


def capture_graph(fn) -> torch.cuda.CUDAGraph:
    """fn run once outside a graph (compilation, cuBLAS plans, allocations), then captured."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def replay_ms(graph: torch.cuda.CUDAGraph, iters: int = 20) -> float:
    """GPU time of one replay of a captured graph, after three warm-up replays."""
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def kernel_table(prof, wall_s: float, label: str, rows: int = 16) -> None:
    """Kernel time by name, and the GPU's busy share of the wall time (kernels do not overlap here)."""
    stats = [e for e in prof.key_averages() if e.device_time_total > 0]
    busy = sum(e.self_device_time_total for e in stats) / 1e6
    print(f"{label}: wall {wall_s * 1e3:.1f} ms, kernels {busy * 1e3:.1f} ms ({busy / wall_s:.0%} busy)")
    for e in sorted(stats, key=lambda e: -e.self_device_time_total)[:rows]:
        print(f"  {e.self_device_time_total / 1e3:10.2f} ms {e.count:7d}x  {e.key[:90]}")


def gpu_gaps(prof, label: str, top: int = 8) -> None:
    """Idle time of the GPU between device events (kernels and copies): the part of the wall time no
    kernel work covers, and the longest gaps with their offsets into the run."""
    from torch.autograd import DeviceType
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type == DeviceType.CUDA)
    if not spans:
        return
    gaps, end = [], spans[0][1]
    for s, e in spans[1:]:
        if s > end:
            gaps.append((s - end, end - spans[0][0]))
        end = max(end, e)
    idle = sum(g for g, _ in gaps) / 1e3
    print(f"{label}: GPU idle {idle:.1f} ms of {(end - spans[0][0]) / 1e3:.1f} ms between first and last device event; "
          f"gaps > 0.1 ms: {sum(g > 100 for g, _ in gaps)} ({sum(g for g, _ in gaps if g > 100) / 1e3:.1f} ms)")
    for g, at in sorted(gaps, reverse=True)[:top]:
        print(f"  {g / 1e3:8.2f} ms gap at {at / 1e3:9.1f} ms")


def decode_trace(llm: LLM) -> None:
    """Kernel totals of 10 replays of the smallest decode graph (batch 1 or 2)."""
    from torch.profiler import ProfilerActivity, profile
    graphs = llm.engine.runner.graphs.graphs
    bs = min(b for b, lora in graphs if not lora)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(10):
            graphs[bs, False].replay()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
    kernel_table(prof, wall, f"10 replays of the batch-{bs} decode graph", rows=30)


def trace(llm: LLM, ps) -> None:
    from torch.profiler import ProfilerActivity, profile
    g = llm.engine.runner.graphs.graphs[2, False]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(10):
            g.replay()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
    kernel_table(prof, wall, "10 replays of the batch-2 decode graph", rows=24)
    print(trace_run(llm, ps, 128, "one 1000 x 128/128 run"))


def trace_run(llm: LLM, ps, max_tokens: int, label: str) -> str:
    """Kernel totals and GPU gaps of one whole run, and its steps: how many, and tokens per step."""
    from torch.profiler import ProfilerActivity, profile
    sched = llm.engine.scheduler
    tokens_per_step = []
    schedule = sched.schedule

    def counted():
        out = schedule()
        tokens_per_step.append(out.total_num_scheduled_tokens)
        return out
    sched.schedule = counted
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            torch.cuda.synchronize()
            t = time.perf_counter()
            llm.generate(ps, params, use_tqdm=False)
            torch.cuda.synchronize()
            wall = time.perf_counter() - t
    finally:
        del sched.schedule
    kernel_table(prof, wall, f"{label} (profiled)", rows=40)
    gpu_gaps(prof, label)
    steps = [n for n in tokens_per_step if n]
    full = sum(n >= 0.9 * llm.engine.config.scheduler.max_num_batched_tokens for n in steps)
    return (f"{label}: {len(steps)} steps, {sum(steps) / len(steps):.0f} tokens per step on average, "
            f"{full} of them at >= 90% of the token budget")


if __name__ == "__main__":
    main()
