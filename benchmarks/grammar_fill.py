"""What filling grammar masks costs on the host: xgrammar's batch fill of N matchers of the
structured_overhead.py schema (inside a JSON string, the state most of its tokens are in).

    python benchmarks/grammar_fill.py --tokenizer <dir> [--vocab-size 128256] [--requests 64]
    python benchmarks/grammar_fill.py --mode core --tokenizer <dir> [--host-work-ms 8]

--mode threads (default): the batch fill by thread count, against one-by-one fills.
--mode core: how long the engine core's thread is held per step by the grammar work, the fill in a
grammar process (the default; structured_output/process_manager.py) against the fill on the core's
thread ("inline"), through the managers the core uses and in the core's order: the step's tokens and
the next rows go out, the core does --host-work-ms of other Python work (a stand-in for its scheduler
update, outputs and next schedule, holding the GIL), then reads the accept's answer and takes the rows. Per step (medians) it
prints how long the core's thread is held by the grammar calls (sending the tokens and waiting for
their accept, then taking, or filling, the rows), the rows' part of it, and the step's wall time.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.structured_overhead import LONG_ARRAY  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--vocab-size", type=int, default=128256)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--mode", choices=("threads", "core"), default="threads")
    ap.add_argument("--host-work-ms", type=float, default=8.0, help="--mode core: the core's other host work")
    args = ap.parse_args()
    if args.mode == "core":
        from benchmarks.grammar_fill_core import core_busy
        core_busy(args)
        return
    threads_mode(args)


def threads_mode(args) -> None:
    import xgrammar as xgr
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    V = args.vocab_size
    compiled = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok, vocab_size=V)).compile_json_schema(
        json.dumps(LONG_ARRAY))
    rng = random.Random(0)
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(args.requests)]
    bitmask = torch.empty((args.requests, -(-V // 32)), dtype=torch.int32)
    variants = {"one by one": None, **{f"batch, {t} threads": t for t in (1, 4, 8, 16)}, "batch, auto": "auto"}
    batchers = {name: xgr.BatchGrammarMatcher(t) for name, t in variants.items() if t is not None}
    times = {name: [] for name in variants}
    for _ in range(args.steps):
        for name in variants:
            t0 = time.perf_counter()
            if name in batchers:
                batchers[name].batch_fill_next_token_bitmask(matchers, bitmask)
            else:
                for i, m in enumerate(matchers):
                    m.fill_next_token_bitmask(bitmask, i)
            times[name].append(time.perf_counter() - t0)
        bits = ((bitmask[:, :, None] >> torch.arange(32)) & 1).flatten(1)[:, :V]
        for i, m in enumerate(matchers):  # advance each by a random allowed token
            ids = bits[i].nonzero().flatten().tolist()
            assert m.accept_token(ids[rng.randrange(len(ids))])
    print(f"{args.requests} matchers, vocab {V}, {os.cpu_count()} CPUs: median ms per fill of all")
    for name, ts in times.items():
        print(f"  {name:18s} {1e3 * statistics.median(ts):7.2f} ms")


if __name__ == "__main__":
    main()
