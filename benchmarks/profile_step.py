"""Where a step's time goes on the device: graph replay (GPU) vs the whole engine step (GPU + host).

    python benchmarks/profile_step.py   # Llama-3-8B shape, random bf16 weights
"""
from __future__ import annotations

import cProfile
import os
import pstats
import random
import time

import torch

from splitserve import LLM, SamplingParams

CONFIG_8B = os.path.join(os.path.dirname(__file__), "configs", "llama3-8b")


def main() -> None:
    t0 = time.perf_counter()
    llm = LLM(CONFIG_8B, random_weights=True, dtype="bfloat16", max_model_len=4096)
    print(f"engine build {time.perf_counter() - t0:.1f} s")
    runner = llm.engine.runner
    graphs = runner.graphs
    for bs in (1, 8, 64, 256):
        g = graphs.graphs[bs]
        for _ in range(3):
            g.replay()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            g.replay()
        end.record()
        torch.cuda.synchronize()
        print(f"decode graph replay bs={bs}: {start.elapsed_time(end) / 20:.3f} ms")
    rng = random.Random(5)
    vocab = llm.engine.config.model.vocab_size
    ps = [[rng.randrange(1000, vocab - 1000) for _ in range(128)] for _ in range(256)]
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    llm.generate(ps[:8], params, use_tqdm=False)
    pr = cProfile.Profile()
    torch.cuda.synchronize()
    t = time.perf_counter()
    pr.enable()
    llm.generate(ps, params, use_tqdm=False)
    pr.disable()
    el = time.perf_counter() - t
    print(f"256 x 128/64: {el:.2f} s, {256 * 64 / el:,.0f} out tok/s")
    pstats.Stats(pr).sort_stats("tottime").print_stats(25)
    # one big prefill forward, eager (compiled layers), timed alone
    ps = [[rng.randrange(1000, vocab - 1000) for _ in range(2048)] for _ in range(8)]
    for mnbt in (8192,):
        t = time.perf_counter()
        llm.generate(ps, SamplingParams(max_tokens=1, ignore_eos=True), use_tqdm=False)
        print(f"prefill 8x2048 {time.perf_counter() - t:.3f} s")


if __name__ == "__main__":
    main()
