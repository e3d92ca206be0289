"""Vision-language serving figures on a LLaVA-1.5-7B-shaped model with random weights (no download):

  * time to first token for one 336x336 image + a short prompt (median of several runs; each run uses
    a fresh image and fresh text, so neither the encoder cache nor the prefix cache helps);
  * offline throughput for N requests from the benchmark client's `random-mm` dataset (one image
    each, text length from --input-len, --output-len generated tokens, ignore_eos).

Image preprocessing (HF CLIP processor) is included in TTFT and reported separately for the
throughput run, whose timer covers the engine only.

    python benchmarks/vlm_bench.py                      # GPU, benchmarks/configs/llava-1.5-7b
    python benchmarks/vlm_bench.py --tiny --num-prompts 8 --ttft-runs 3 --output-len 8   # CPU check
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "llava-1.5-7b")


def write_tiny_config(directory: str) -> str:
    """A LLaVA-1.5-shaped model small enough for a CPU: same tower geometry (336 px, 14 px patches,
    576 image tokens), tiny widths and depths. Only config files are written; weights are random."""
    import json
    import shutil
    with open(os.path.join(DEFAULT_CONFIG, "config.json")) as f:
        cfg = json.load(f)
    cfg["text_config"].update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=4)
    cfg["vision_config"].update(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4)
    cfg["torch_dtype"] = "float32"
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(cfg, f)
    shutil.copy(os.path.join(DEFAULT_CONFIG, "preprocessor_config.json"), directory)
    return directory


def random_ids(rng: random.Random, n: int, lo: int = 1000, hi: int = 31000) -> list[int]:
    # The config ships no tokenizer (random weights): prompts are token ids drawn inside the vocabulary.
    return [rng.randrange(lo, hi) for _ in range(n)]


def measure_ttft(llm, args, image_token: int) -> tuple[list[float], int]:
    import numpy as np

    from splitserve.bench.datasets import random_image_uri
    from splitserve.sampling_params import SamplingParams
    rng, np_rng = random.Random(1), np.random.default_rng(1)
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    times, prompt_len = [], 0
    for i in range(args.ttft_warmup + args.ttft_runs):
        ids = [1] + random_ids(rng, 8) + [image_token] + random_ids(rng, args.ttft_prompt_len)
        request = {"prompt_token_ids": ids, "multi_modal_data": {"image": [random_image_uri(np_rng, 336, 336)]}}
        start = time.perf_counter()
        out = llm.generate(request, params, use_tqdm=False)[0]
        elapsed = time.perf_counter() - start
        prompt_len = len(out.prompt_token_ids)
        if i >= args.ttft_warmup:
            times.append(elapsed)
    return times, prompt_len


def measure_throughput(llm, args, image_token: int) -> dict:
    import numpy as np

    from splitserve.bench.datasets import parse_size, random_mm_requests
    from splitserve.multimodal.processor import offline_prompt
    from splitserve.sampling_params import SamplingParams
    np_rng = np.random.default_rng(args.seed)
    samples = random_mm_requests(llm.tokenizer, args.num_prompts, args.input_len, 0.0, args.output_len, 0.0,
                                 np_rng, num_images=1, size=parse_size(args.image_size))
    rng = random.Random(args.seed)
    start = time.perf_counter()
    prompts = [offline_prompt(llm.engine, {"prompt_token_ids": [1, image_token] + random_ids(rng, s.prompt_len),
                                           "multi_modal_data": {"image": s.images}}) for s in samples]
    preprocess_s = time.perf_counter() - start
    params = [SamplingParams(max_tokens=s.output_len, temperature=0, ignore_eos=True) for s in samples]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    n_in = sum(len(p) for p in prompts)
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"elapsed_s": elapsed, "preprocess_s": preprocess_s, "requests_per_s": len(prompts) / elapsed,
            "output_tok_s": n_out / elapsed, "total_tok_s": (n_in + n_out) / elapsed,
            "mean_prompt_tokens": n_in / len(prompts), "images_encoded": llm.engine.runner.mm.num_images_encoded}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_CONFIG, help="config directory (random weights)")
    p.add_argument("--tiny", action="store_true", help="a tiny model of the same image geometry (CPU check)")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--ttft-runs", type=int, default=10)
    p.add_argument("--ttft-warmup", type=int, default=2)
    p.add_argument("--ttft-prompt-len", type=int, default=16, help="text tokens after the image")
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--input-len", type=int, default=64, help="random-mm text tokens per request")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--image-size", default="336x336", help="random-mm image WIDTHxHEIGHT")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    import torch

    from splitserve.engine.llm import LLM
    tmp = tempfile.TemporaryDirectory() if args.tiny else None
    model = write_tiny_config(tmp.name) if tmp else args.model
    t0 = time.perf_counter()
    llm = LLM(model, random_weights=True, dtype=args.dtype, device=args.device, enforce_eager=args.enforce_eager,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens)
    start_s = time.perf_counter() - t0
    image_token = llm.engine.mm_processor.placeholder_id
    cfg = llm.engine.config

    ttfts, ttft_prompt_len = measure_ttft(llm, args, image_token)
    tp = measure_throughput(llm, args, image_token)
    assert llm.engine.kv_manager.pool.is_whole() and llm.engine.runner.mm.cache.is_whole()

    device = torch.cuda.get_device_name() if cfg.device.startswith("cuda") else "cpu"
    print(f"\nsplitserve VLM benchmark: {'tiny ' if args.tiny else ''}{os.path.basename(os.path.normpath(args.model))} "
          f"({cfg.model.architecture}), {cfg.model.dtype}, {device}, backend {cfg.attention_backend}, "
          f"engine start {start_s:.1f} s")
    rows = [
        ("TTFT, 1 image 336x336 + text", f"median {statistics.median(ttfts) * 1e3:.1f} ms "
         f"(min {min(ttfts) * 1e3:.1f}, max {max(ttfts) * 1e3:.1f}; {len(ttfts)} runs; {ttft_prompt_len} prompt tokens)"),
        (f"throughput, {args.num_prompts} random-mm requests",
         f"{tp['requests_per_s']:.2f} req/s, {tp['output_tok_s']:.1f} output tok/s, {tp['total_tok_s']:.1f} total tok/s"),
        ("  run", f"{tp['elapsed_s']:.2f} s engine; {tp['preprocess_s']:.2f} s image preprocessing (not in the rate); "
         f"{tp['mean_prompt_tokens']:.0f} prompt tokens/request incl. 576 image tokens; output {args.output_len}"),
    ]
    width = max(len(r[0]) for r in rows)
    print("-" * (width + 60))
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    if tmp:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
