"""Speculative decoding: tokens/s at batch 1 and batch 16 with speculation off, n-gram and a draft model,
on copy-heavy prompts (real text, the default model) or random-weight shapes (nothing is accepted: the
cost of verifying and of proposing, and the back-off). Outputs are checked equal to speculation off
(greedy), and the mean acceptance length (accepted drafts per verify + 1) is printed.

    python benchmarks/spec_decode_bench.py                                  # default model, ngram k=4
    python benchmarks/spec_decode_bench.py --methods off,ngram,draft_model --draft default --k 4
    python benchmarks/spec_decode_bench.py --model benchmarks/configs/llama3-8b --random-weights \
        --tokenizer .devcarry/llama3-8b --methods off,ngram                 # Llama-3-8B shape, back-off
    ... --disable-by-batch-size 16                                          # batch 16 runs plain decode
    ... --random-weights ... --methods off,oracle --oracle-accept 0.73      # known acceptance (length ~3 at k=4)
    ... --random-weights ... --methods off,draft_model --draft benchmarks/configs/llama3.2-1b  # a 1B draft's cost

`oracle` measures the machinery (verify cost, rollback, scheduling) at a chosen acceptance without
trained weights: a first pass with speculation off records each prompt's greedy continuation, then
the n-gram proposer of the speculating engine is replaced by one that proposes the true next k tokens,
each kept with probability --oracle-accept and otherwise replaced by another token (so a draft run is
accepted up to its first replaced token). Expected acceptance length: 1 + a + a^2 + ... + a^k.

Each configuration builds its own engine (one at a time; memory is returned between them).
"""
from __future__ import annotations

import argparse
import gc
import time

import numpy as np
import torch

from splitserve import LLM, SamplingParams

PARAGRAPH = ("Speculative decoding lets a cheap proposer guess several tokens ahead; the large model then "
             "checks all of them in a single forward pass and keeps the longest prefix it agrees with, plus "
             "one token of its own. When the guesses are good the model emits several tokens per step, and "
             "when they are bad it loses little, because the verification costs about as much as one step.")


def copy_prompts(n: int) -> list[str]:
    """Prompts whose answers quote their input (the n-gram proposer's case)."""
    tasks = ["Fix the typos in this paragraph and repeat it in full:\n", "Repeat the following text exactly:\n",
             "Quote this paragraph, then summarise it in one line:\n", "Copy this text verbatim:\n"]
    return [f"{tasks[i % len(tasks)]}{PARAGRAPH.replace('the', 'teh', 1 + i % 3)}\nAnswer:\n" for i in range(n)]


class OracleProposer:
    """Proposes the reference greedy continuation of the request whose prompt the tokens start with,
    each token correct with probability `accept` (worker/spec_decode.NgramProposer's interface)."""

    def __init__(self, k: int, accept: float, continuations: dict[tuple, list[int]], key_len: int, seed: int = 0):
        self.k, self.accept, self.continuations, self.key_len = k, accept, continuations, key_len
        self.rng = np.random.default_rng(seed)

    def propose(self, tokens: np.ndarray) -> list[int]:
        for prompt_len, cont in self.continuations.get(tuple(tokens[:self.key_len].tolist()), ()):
            done = len(tokens) - prompt_len
            if 0 <= done < len(cont):
                drafts = list(cont[done:done + self.k])
                for j in range(len(drafts)):
                    if self.rng.random() >= self.accept:
                        drafts[j] = (drafts[j] + 1 + int(self.rng.integers(100))) % 1000 + 1000
                return drafts
        return []

    def propose_many(self, token_ids: np.ndarray, rows: np.ndarray, lengths: np.ndarray) -> list[list[int]]:
        return [self.propose(token_ids[r, :n]) for r, n in zip(rows.tolist(), lengths.tolist())]


def random_prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1000, 20000, length).tolist() for _ in range(n)]


def build(args, method: str) -> LLM:
    kw = dict(dtype=args.dtype, max_model_len=args.max_model_len, gpu_memory_utilization=args.gpu_memory_utilization,
              max_num_seqs=max(16, args.batch_sizes[-1]))
    if args.model:
        kw["model"] = args.model
    if args.random_weights:
        kw["random_weights"] = True
    if args.tokenizer:
        kw["tokenizer"] = args.tokenizer
    if method != "off":
        cfg = {"method": "ngram" if method == "oracle" else method, "num_speculative_tokens": args.k}
        if method in ("ngram", "oracle"):
            cfg.update(prompt_lookup_min=args.lookup_min, prompt_lookup_max=args.lookup_max)
        else:
            cfg["model"] = args.draft
        if args.disable_by_batch_size:
            cfg["disable_by_batch_size"] = args.disable_by_batch_size
        kw["speculative_config"] = cfg
    return LLM(**kw)


def prompts_for(args, batch: int):
    """The batch's prompts: token ids (oracle needs them: it keys continuations by prompt tokens) or text."""
    if args.prompt_len or "oracle" in args.methods:
        return [{"prompt_token_ids": p} for p in random_prompts(batch, args.prompt_len or 128, seed=batch)]
    return copy_prompts(batch)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the default model (SmolLM2-135M-Instruct)")
    ap.add_argument("--random-weights", action="store_true")
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--methods", default="off,ngram")
    ap.add_argument("--draft", default="default", help="draft_model's model")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--lookup-min", type=int, default=2)
    ap.add_argument("--lookup-max", type=int, default=4)
    ap.add_argument("--disable-by-batch-size", type=int, default=None)
    ap.add_argument("--batch-sizes", default="1,16")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--oracle-accept", type=float, default=0.73,
                    help="oracle: probability that each proposed token is the true next one")
    ap.add_argument("--prompt-len", type=int, default=0,
                    help="token-id prompts of this length (random) instead of the copy prompts; oracle uses them")
    args = ap.parse_args()
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    rows, reference = [], {}
    for method in args.methods.split(","):
        llm = build(args, method)
        llm.generate(copy_prompts(2), SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)  # warm-up
        if method == "oracle":
            if not reference:
                raise SystemExit("oracle needs a speculation-off run first: --methods off,oracle")
            conts: dict[tuple, list] = {}
            for batch in args.batch_sizes:
                for p, cont in zip(prompts_for(args, batch), reference[batch]):
                    ids = p["prompt_token_ids"]
                    conts.setdefault(tuple(ids[:32]), []).append((len(ids), cont))
            llm.engine.core.executor.runner.proposer = OracleProposer(args.k, args.oracle_accept, conts, 32)
        for batch in args.batch_sizes:
            prompts = prompts_for(args, batch)
            sched = llm.engine.core.scheduler
            d0, a0, n0 = sched.spec_num_draft_tokens, sched.spec_num_accepted_tokens, sched.spec_num_drafts
            times = []
            for _ in range(args.repeats):
                llm.engine.core.kv_manager.pool.reset_prefix_cache()
                t = time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False)
                times.append(time.perf_counter() - t)
            tokens = [o.outputs[0].token_ids for o in outs]
            same = "" if method == "off" else \
                f"{sum(a == b for a, b in zip(tokens, reference.get(batch, tokens)))}/{batch} equal to off"
            if method == "off":
                reference[batch] = tokens
            best = min(times)
            drafts = sched.spec_num_drafts - n0
            accept_len = (sched.spec_num_accepted_tokens - a0) / drafts + 1 if drafts else float("nan")
            rows.append((method, batch, batch * args.max_tokens / best, best, accept_len,
                         sched.spec_num_draft_tokens - d0, same))
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    print(f"\n{'method':<12} {'batch':>5} {'tok/s':>9} {'best s':>8} {'accept len':>10} {'drafts':>8}  check")
    for method, batch, tps, best, alen, drafts, same in rows:
        print(f"{method:<12} {batch:>5} {tps:>9.1f} {best:>8.3f} {alen:>10.2f} {drafts:>8}  {same}")


if __name__ == "__main__":
    main()
