"""`python benchmarks/grammar_fill.py --mode core`: the engine core's thread time per step in grammar
work, with the fill in the grammar process against the fill on the core's thread (see grammar_fill.py)."""
from __future__ import annotations

import functools
import os
import random
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.structured_overhead import SCHEMAS  # noqa: E402
from splitserve.loading.resolve import load_tokenizer  # noqa: E402
from splitserve.core.request import Request  # noqa: E402
from splitserve.sampling_params import SamplingParams, StructuredOutputsParams  # noqa: E402
from splitserve.structured_output.manager import StructuredOutputManager  # noqa: E402
from splitserve.structured_output.process_manager import GrammarProcessManager  # noqa: E402

WARMUP_STEPS = 6  # into the array's strings first, the state most tokens are in


def _host_work(ms: float) -> None:
    """Python work holding the GIL, as the core's scheduler update and next schedule do."""
    end = time.perf_counter() + ms / 1e3
    x = 0
    while time.perf_counter() < end:
        for i in range(200):
            x += i


def _pick(bitmask, vocab: int, rng: random.Random) -> list[int]:
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")[:, :vocab]
    tokens = []
    for row in bits:
        ids = np.flatnonzero(row)
        tokens.append(int(ids[rng.randrange(len(ids))]))
    return tokens


def _run(manager, args, process: bool) -> dict[str, list[float]]:
    params = SamplingParams(structured_outputs=StructuredOutputsParams(json=SCHEMAS[args.schema]))
    requests = [Request(f"r{i}", [1], params, (), 1 << 20) for i in range(args.requests)]
    for r in requests:
        manager.register(r)
    while not all(manager.is_ready(r) for r in requests):
        assert not manager.take_failed()
        manager.wait_for_compiles(0.1)
    rng = random.Random(0)
    rows = manager.fill_bitmask(requests)
    times = {"held": [], "wait": [], "step": []}
    for step in range(WARMUP_STEPS + args.steps):
        tokens = _pick(rows, args.vocab_size, rng)  # the device's part: not timed
        t0 = time.perf_counter()
        if process:
            manager.queue_fill(requests)  # the next step's rows go out with these tokens
        answer = manager.accept_tokens_later(list(zip(requests, tokens)))  # inline: accepts here
        t1 = time.perf_counter()
        _host_work(args.host_work_ms)
        t2 = time.perf_counter()
        ended = answer()
        rows = manager.take_fill() if process else manager.fill_bitmask(requests)
        t3 = time.perf_counter()
        assert not ended, "a request left its array"
        if step >= WARMUP_STEPS:
            times["held"].append((t1 - t0) + (t3 - t2))
            times["wait"].append(t3 - t2)
            times["step"].append(t3 - t0)
    for r in requests:
        manager.release(r)
    return times


def core_busy(args) -> None:
    loader = functools.partial(load_tokenizer, args.tokenizer)
    eos = ()
    inline = StructuredOutputManager(args.vocab_size, eos, loader)
    process = GrammarProcessManager(args.vocab_size, eos, loader, max_rows=args.requests)
    print(f"{args.requests} matchers of {args.schema}, vocab {args.vocab_size}, {len(os.sched_getaffinity(0))} CPUs, "
          f"{args.host_work_ms:.1f} ms of other host work per step; medians over {args.steps} steps")
    print(f"  {'fill':8s} {'core thread held by grammar calls':>34s} {'of which rows':>14s} {'step wall':>10s}")
    try:
        for name, manager, is_process in (("inline", inline, False), ("process", process, True)):
            t = _run(manager, args, is_process)
            print(f"  {name:8s} {1e3 * statistics.median(t['held']):31.2f} ms {1e3 * statistics.median(t['wait']):11.2f} ms"
                  f" {1e3 * statistics.median(t['step']):7.2f} ms", flush=True)
    finally:
        process.shutdown()
        inline.shutdown()
