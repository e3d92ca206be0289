"""`splitserve bench throughput`: offline, in-process throughput on random token-id prompts.

Every request has exactly --input-len prompt tokens and --output-len output tokens (ignore_eos), so
runs are comparable across engines. With --random-weights the model is built from its config alone.
"""
from __future__ import annotations

import argparse
import json
import random
import time


def add_args(p: argparse.ArgumentParser) -> None:
    from splitserve.engine.args import EngineArgs
    EngineArgs.add_cli_args(p)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-prompts", type=int, default=1000)
    # --seed (an engine option) also seeds the prompts: use a fresh one per run (no prefix reuse).
    p.add_argument("--save-result", default=None, help="write the figures as JSON here")


def random_prompts(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000, vocab - 1000) for _ in range(length)] for _ in range(num)]


def run(args: argparse.Namespace) -> int:
    from splitserve.engine.llm import LLM
    from splitserve.engine.args import EngineArgs
    from splitserve.sampling_params import SamplingParams
    for name in ("input_len", "output_len", "num_prompts"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    t0 = time.perf_counter()
    llm = LLM(**vars(EngineArgs.from_namespace(args)))
    load_s = time.perf_counter() - t0
    vocab = llm.engine.config.model.vocab_size
    prompts = random_prompts(args.num_prompts, args.input_len, vocab, 0 if args.seed is None else args.seed)
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    n_in = sum(len(p) for p in prompts)
    result = {"num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len,
              "elapsed_s": elapsed, "requests_per_s": args.num_prompts / elapsed,
              "output_tokens_per_s": n_out / elapsed, "total_tokens_per_s": (n_in + n_out) / elapsed,
              "engine_start_s": load_s}
    print(f"Throughput: {result['requests_per_s']:.2f} requests/s, {result['total_tokens_per_s']:.1f} total tok/s, "
          f"{result['output_tokens_per_s']:.1f} output tok/s ({elapsed:.2f} s for {args.num_prompts} requests; "
          f"engine start {load_s:.1f} s)")
    if args.save_result:
        with open(args.save_result, "w") as f:
            json.dump(result, f, indent=2)
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("throughput", help="offline throughput, in-process")
    add_args(p)
    p.set_defaults(func=run)
