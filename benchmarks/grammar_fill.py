"""What filling grammar masks costs on the host: xgrammar's batch fill of N matchers of a
structured_overhead.py schema (--schema: bounded-strings, the default, nearly every token inside a
length-bounded string, xgrammar's most expensive state; or objects, an extraction-like schema).

    python benchmarks/grammar_fill.py --tokenizer <dir> [--schema objects] [--vocab-size 128256] [--requests 64]
    python benchmarks/grammar_fill.py --mode core --tokenizer <dir> [--schema objects] [--host-work-ms 8]

--mode threads (default): the CPUs (affinity count, cgroup quota, and the fill threads the engine
picks from them), then the batch fill by thread count against one-by-one fills (whose time over N is
the per-mask cost of the schema, on one thread) and against a pool of threads that each take the next
matcher from a shared counter (dynamic assignment: a matcher slower to fill holds up only its own
thread; it shows whether the batch fill's scaling is lost to an uneven split). The matchers start
alike and then follow random allowed tokens, so they drift into different states; each variant has
matchers of its own following the same tokens (every fill is the first in its state, as in the
engine) and must give the same masks. Besides the medians it prints the spread of one mask's cost
and, per thread count, the floor: the step's one-by-one masks shared out perfectly, never less than
its slowest mask. xgrammar's batch fill starts its threads anew on every call (one clone per
thread), a fixed cost that cheap masks do not repay.
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
import itertools
import os
import random
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.structured_overhead import SCHEMAS, add_schema_option  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--vocab-size", type=int, default=128256)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--steps", type=int, default=40)
    add_schema_option(ap)
    ap.add_argument("--mode", choices=("threads", "core"), default="threads")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4, 8, 16],
                    help="--mode threads: the thread counts to try")
    ap.add_argument("--host-work-ms", type=float, default=8.0, help="--mode core: the core's other host work")
    args = ap.parse_args()
    if args.mode == "core":
        from benchmarks.grammar_fill_core import core_busy
        core_busy(args)
        return
    threads_mode(args)


def compile_schema(tokenizer, vocab_size: int, schema: dict):
    """The schema compiled as the engine compiles it (the same grammar options)."""
    import xgrammar as xgr

    from splitserve.sampling_params import StructuredOutputsParams
    from splitserve.structured_output.grammar import build_grammar
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    return xgr.GrammarCompiler(info).compile_grammar(build_grammar(StructuredOutputsParams(json=schema).key()))


class DynamicPool:
    """Fills the matchers on `threads` threads, each taking the next matcher from a shared counter
    (each fill is a one-matcher batch fill: xgrammar releases the GIL in it)."""

    def __init__(self, threads: int):
        import xgrammar as xgr
        self.threads = threads
        self.pool = ThreadPoolExecutor(threads)
        self._local = threading.local()
        self._make = lambda: xgr.BatchGrammarMatcher(1)

    def fill(self, matchers, bitmask) -> None:
        counter = itertools.count()
        n = len(matchers)

        def work():
            batch = getattr(self._local, "batch", None)
            if batch is None:
                batch = self._local.batch = self._make()
            while (i := next(counter)) < n:
                batch.batch_fill_next_token_bitmask([matchers[i]], bitmask, [i])
        for f in [self.pool.submit(work) for _ in range(self.threads)]:
            f.result()


def threads_mode(args) -> None:
    import xgrammar as xgr
    from transformers import AutoTokenizer

    from splitserve.cpu_limits import affinity_cpus, cgroup_cpu_quota, usable_cpus
    from splitserve.structured_output.manager import fill_threads
    quota = cgroup_cpu_quota()
    engine_threads = fill_threads()
    print(f"CPUs: affinity {affinity_cpus()}, cgroup quota {'none' if quota is None else f'{quota:g}'}, "
          f"usable {usable_cpus()}; the engine fills on {engine_threads} threads")
    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    V = args.vocab_size
    compiled = compile_schema(tok, V, SCHEMAS[args.schema])
    rng = random.Random(0)
    counts = sorted(set(args.threads) | {engine_threads})
    variants = {"one by one": None, **{f"batch, {t} threads": t for t in counts}, "batch, auto": "auto",
                **{f"dynamic, {t} threads": ("dynamic", t) for t in counts if t > 1}}
    # Each variant fills matchers of its own, all following the same tokens: every fill is the first
    # in its state, as in the engine (a second fill of a state can be cheaper).
    matchers = {name: [xgr.GrammarMatcher(compiled) for _ in range(args.requests)] for name in variants}
    bitmasks = {name: torch.empty((args.requests, -(-V // 32)), dtype=torch.int32) for name in variants}
    fillers = {}
    for name, v in variants.items():
        if isinstance(v, tuple):
            fillers[name] = DynamicPool(v[1]).fill
        elif v is not None:
            fillers[name] = xgr.BatchGrammarMatcher(v).batch_fill_next_token_bitmask
    times = {name: [] for name in variants}
    singles, floors = [], {t: [] for t in counts}  # each mask's time; a step's least possible time on t threads
    for _ in range(args.steps):
        for name in variants:
            ms, bitmask = matchers[name], bitmasks[name]
            t0 = time.perf_counter()
            if name in fillers:
                fillers[name](ms, bitmask)
            else:
                step = []
                for i, m in enumerate(ms):
                    t1 = time.perf_counter()
                    m.fill_next_token_bitmask(bitmask, i)
                    step.append(time.perf_counter() - t1)
                singles.extend(step)
                for t in counts:  # perfectly shared out, a step still waits for its slowest mask
                    floors[t].append(max(max(step), sum(step) / t))
            times[name].append(time.perf_counter() - t0)
        ref = bitmasks["one by one"]
        assert all(torch.equal(b, ref) for b in bitmasks.values()), "a fill variant gave other masks"
        bits = ((ref[:, :, None] >> torch.arange(32)) & 1).flatten(1)[:, :V]
        for i in range(args.requests):  # advance each by a random allowed token
            ids = bits[i].nonzero().flatten().tolist()
            token = ids[rng.randrange(len(ids))]
            for ms in matchers.values():
                assert ms[i].accept_token(token)
    one = statistics.median(times["one by one"])
    print(f"schema {args.schema}: {1e3 * one / args.requests:.3f} ms per mask on one thread (median step)")
    q = statistics.quantiles(singles, n=100)
    print(f"  one mask: median {1e3 * q[49]:.3f}, p90 {1e3 * q[89]:.3f}, p99 {1e3 * q[98]:.3f}, "
          f"max {1e3 * max(singles):.3f} ms")
    print(f"{args.requests} matchers, vocab {V}: median ms per fill of all (floor: the one-by-one masks of the "
          f"step shared out perfectly, never less than its slowest mask)")
    for name, ts in times.items():
        v = variants[name]
        t = v if isinstance(v, int) else v[1] if isinstance(v, tuple) else None
        floor = f"   floor {1e3 * statistics.median(floors[t]):7.2f} ms" if t in floors else ""
        print(f"  {name:20s} {1e3 * statistics.median(ts):7.2f} ms{floor}")


if __name__ == "__main__":
    main()
