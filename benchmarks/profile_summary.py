"""Where a server's CPU time goes, from py-spy's collapsed stacks (`py-spy record --format raw`, as
benchmarks/serve_bench.sh PROFILE_RATE=R writes them): samples per process and thread, then the
functions with the most samples in each, inclusive (anywhere on the stack) and self (on top).
py-spy samples only threads that are running, so a thread's samples / rate = its CPU seconds.

    python benchmarks/profile_summary.py profile_16.txt [--rate 250] [--top 15] [--match splitserve]
"""
from __future__ import annotations

import argparse
import collections
import re


def parse(path: str):
    """Yields (process, thread, frames outermost first, samples)."""
    with open(path) as f:
        for line in f:
            line = line.rstrip("\n")
            if not line:
                continue
            stack, _, count = line.rpartition(" ")
            parts = stack.split(";")
            procs = [p for p in parts if p.startswith("process ")]
            proc = re.sub(r'^process \d+:"', "", procs[-1])[:60] if procs else "?"
            frames = [p for p in parts if not p.startswith(("process ", "thread "))]
            threads = [p for p in parts if p.startswith("thread ")]
            yield proc, threads[-1] if threads else "", frames, int(count)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("profile")
    ap.add_argument("--rate", type=float, default=250.0, help="py-spy's sampling rate (per second)")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--match", default="", help="only functions whose frame text contains this")
    args = ap.parse_args()
    by_thread = collections.Counter()
    incl: dict[tuple, collections.Counter] = collections.defaultdict(collections.Counter)
    self_: dict[tuple, collections.Counter] = collections.defaultdict(collections.Counter)
    for proc, thread, frames, n in parse(args.profile):
        key = (proc, thread)
        by_thread[key] += n
        for fr in set(frames):
            incl[key][fr] += n
        if frames:
            self_[key][frames[-1]] += n
    for key, n in by_thread.most_common():
        if n < args.rate * 0.05:
            continue
        print(f"\n## {key[0]}  {key[1]}: {n} samples = {n / args.rate:.2f} CPU s")
        for title, table in (("inclusive", incl[key]), ("self", self_[key])):
            print(f"  -- {title}")
            shown = 0
            for fr, c in table.most_common():
                if args.match and args.match not in fr:
                    continue
                print(f"  {c / n:6.1%}  {c / args.rate:6.2f} s  {fr[:110]}")
                shown += 1
                if shown >= args.top:
                    break


if __name__ == "__main__":
    main()
