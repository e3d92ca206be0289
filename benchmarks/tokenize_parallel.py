"""CPU time to tokenize one random-dataset prompt: plain encode vs encode_text (in pieces).

Prompts come from `bench serve`'s random dataset (splitserve.bench.datasets._PromptMaker) with the
default model's tokenizer unless --tokenizer names one. For each length it prints the median wall
time per prompt of tokenizer.encode and of splitserve.tokenize_parallel.encode_text, the pieces
encode_text cut the text into, and checks that both give the same ids.

  python benchmarks/tokenize_parallel.py [--lengths 1024 8192 32768] [--reps 20] [--tokenizer PATH]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

from splitserve import tokenize_parallel as tp
from splitserve.bench.datasets import _PromptMaker
from splitserve.cpu_limits import affinity_cpus, usable_cpus
from splitserve.loading.resolve import load_tokenizer


def _median_ms(fn, reps: int) -> float:
    fn()  # warm: BPE caches, the rayon pool
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 8192, 32768], help="prompt lengths in tokens")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--tokenizer", default=None, help="model path or name (default: the default model)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    tok = load_tokenizer(args.tokenizer)
    maker = _PromptMaker(tok, np.random.default_rng(args.seed))
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"cpus: usable {usable_cpus()} (affinity {affinity_cpus()}, os.cpu_count {os.cpu_count()}); "
          f"load average {load:.2f}; tokenizer cut-safe: {tp.can_cut(tok)}; "
          f"TOKENIZERS_PARALLELISM={os.environ.get('TOKENIZERS_PARALLELISM', '(unset)')}")
    print(f"{'tokens':>7} {'chars':>8} {'pieces':>6} {'plain ms':>9} {'parallel ms':>11} {'speedup':>7}")
    for n in args.lengths:
        text, actual = maker.text(n)
        want = list(tok.encode(text, add_special_tokens=True))
        if tp.encode_text(tok, text) != want:
            raise SystemExit(f"encode_text disagrees with encode on the {n}-token prompt")
        pieces = 1
        if len(text) >= tp.MIN_PARALLEL_CHARS and tp.can_cut(tok):
            pieces = 1 + len(tp.cut_points(text, min(tp._cpus(), len(text) // tp.MIN_PIECE_CHARS), tp._plan(tok)))
        plain = _median_ms(lambda: tok.encode(text, add_special_tokens=True), args.reps)
        par = _median_ms(lambda: tp.encode_text(tok, text), args.reps)
        print(f"{actual:>7} {len(text):>8} {pieces:>6} {plain:>9.2f} {par:>11.2f} {plain / par:>6.2f}x")


if __name__ == "__main__":
    main()
