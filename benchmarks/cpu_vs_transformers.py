"""CPU comparison on the default model: splitserve LLM.generate vs transformers.generate.

16 chat prompts x 64 new tokens, greedy, ignore_eos (fixed output lengths). transformers runs the same
prompts as one left-padded batch (its fastest offline mode) and one at a time. The two batched runs
alternate (splitserve, transformers, splitserve, ...) so that both see the same load on a shared
machine; the ratio reported is the median of the per-pair ratios.

    python benchmarks/cpu_vs_transformers.py [--num-prompts 16] [--new-tokens 64] [--repeats 3] [--no-single]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from splitserve import LLM, SamplingParams
from splitserve.loading.resolve import default_model_source

TOPICS = ["the sea", "a cat", "mountains", "rain", "a city at night", "coffee", "the moon", "trains",
          "autumn", "a library", "robots", "bread", "music", "winter", "a garden", "the desert"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-single", action="store_true", help="skip transformers one prompt at a time (slow)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's, the core count)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads or torch.get_num_threads())

    llm = LLM()
    prompts = [llm.apply_chat_template([{"role": "user", "content": f"Write a short story about {TOPICS[i % 16]}."}])
               for i in range(args.num_prompts)]
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)
    from transformers import AutoModelForCausalLM
    src = default_model_source()
    hf = AutoModelForCausalLM.from_pretrained(src.directory, gguf_file=src.gguf_file, dtype=torch.float32).eval()
    tok = llm.tokenizer
    width = max(map(len, prompts))
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    gen = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=pad)

    load_before = os.getloadavg()
    llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up
    ours, batched = [], []
    with torch.inference_mode():
        hf.generate(ids[:2], attention_mask=mask[:2], **gen)
    for _ in range(args.repeats):
        llm.engine.kv_manager.pool.reset_prefix_cache()
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        ours.append(time.perf_counter() - t)
        with torch.inference_mode():
            t = time.perf_counter()
            hf.generate(ids, attention_mask=mask, **gen)
            batched.append(time.perf_counter() - t)
    ours_tokens = [o.outputs[0].token_ids for o in outs]
    single, single_tokens = None, None
    if not args.no_single:
        with torch.inference_mode():
            t = time.perf_counter()
            single_tokens = [hf.generate(torch.tensor([p]), max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                                         do_sample=False, pad_token_id=pad)[0, len(p):].tolist() for p in prompts]
            single = time.perf_counter() - t
    load_after = os.getloadavg()
    n_out = args.num_prompts * args.new_tokens
    rows = [("splitserve LLM.generate", statistics.median(ours)),
            ("transformers generate, batched (left-padded)", statistics.median(batched))]
    if single is not None:
        rows.append(("transformers generate, one prompt at a time", single))
    print(f"\n{args.num_prompts} prompts x {args.new_tokens} new tokens, {torch.get_num_threads()} threads, fp32, "
          f"median of {args.repeats}")
    print(f"{'engine':48s} {'seconds':>8s} {'output tok/s':>13s}")
    for name, sec in rows:
        print(f"{name:48s} {sec:8.2f} {n_out / sec:13.1f}")
    ratios = [b / o for o, b in zip(ours, batched)]
    print("splitserve runs (s): " + " ".join(f"{x:.2f}" for x in ours))
    print("transformers batched runs (s): " + " ".join(f"{x:.2f}" for x in batched))
    print(f"splitserve speed / transformers batched, per pair: {' '.join(f'{r:.2f}' for r in ratios)}; "
          f"median {statistics.median(ratios):.2f}x")
    print("load average (1, 5, 15 min) before: %.2f %.2f %.2f, after: %.2f %.2f %.2f" % (*load_before, *load_after))
    if single_tokens is not None:
        same = sum(a == b for a, b in zip(ours_tokens, single_tokens))
        print(f"greedy outputs identical to transformers (one at a time): {same}/{args.num_prompts}")


if __name__ == "__main__":
    main()
