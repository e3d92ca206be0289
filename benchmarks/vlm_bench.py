"""Vision-language serving figures for a config directory with random weights (no download):

  * time to first token for one 336x336 image + a short prompt (median of several runs; each run uses
    a fresh image and fresh text, so neither the encoder cache nor the prefix cache helps);
  * offline throughput for N requests from the benchmark client's `random-mm` dataset (one image
    each, text length from --input-len, --output-len generated tokens, ignore_eos): images/s and
    output tok/s;
  * the same engine on text-only prompts of the same token lengths (its language model alone), and
    the VLM's throughput as a share of that (the issue's target: >= 90%);
  * the share of forward steps that replayed CUDA graphs (decode graphs, piecewise graphs, eager).

Image preprocessing (the model's HF image processor) is included in TTFT and reported separately for
the throughput run, whose timer covers the engine only. An image is marked in the token-id prompts by
`mm_processor.placeholder_id`, which every VLM provides.

    python benchmarks/vlm_bench.py                      # GPU, benchmarks/configs/llava-1.5-7b
    python benchmarks/vlm_bench.py --model benchmarks/configs/fuyu-8b --num-prompts 1000
    python benchmarks/vlm_bench.py --tiny --num-prompts 8 --ttft-runs 3 --output-len 8   # CPU check
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "llava-1.5-7b")


def merge(base: dict, overrides: dict) -> dict:
    for key, value in overrides.items():
        base[key] = merge(base.get(key, {}), value) if isinstance(value, dict) else value
    return base


def write_tiny_config(model_dir: str, directory: str) -> str:
    """The model's config directory with its tiny_overrides.json merged in (tiny widths and depths, the
    same image geometry): keys naming a file of the directory ("llm/config.json",
    "archive/model_config.yaml": VILA's and NeVA's layouts) merge into that file, the others into
    config.json. Weights are random."""
    shutil.copytree(model_dir, directory, dirs_exist_ok=True, ignore=shutil.ignore_patterns("tiny_overrides.json"))
    with open(os.path.join(model_dir, "tiny_overrides.json")) as f:
        overrides = json.load(f)
    per_file = {"config.json": {k: v for k, v in overrides.items() if not k.endswith((".json", ".yaml"))}}
    per_file.update({k: v for k, v in overrides.items() if k.endswith((".json", ".yaml"))})
    for name, values in per_file.items():
        merge_file(os.path.join(directory, name), values)
    return directory


def merge_file(path: str, values: dict) -> None:
    import yaml
    with open(path) as f:
        cfg = yaml.safe_load(f) if path.endswith(".yaml") else json.load(f)
    merge(cfg, values)
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f) if path.endswith(".yaml") else json.dump(cfg, f)


def write_text_model_config(model_dir: str, directory: str) -> str:
    """The VLM's language model alone, as a Llama checkpoint directory (CogVLM without its visual
    expert and tower: the reference of image-free CogVLM requests)."""
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    text = dict(cfg.get("text_config") or {k: v for k, v in cfg.items() if k not in ("vision_config", "auto_map")})
    if text.get("model_type", "llama") != "llama":
        raise ValueError(f"--text-model: {model_dir}'s language model is not a Llama")
    text.update(architectures=["LlamaForCausalLM"], model_type="llama", torch_dtype=cfg.get("torch_dtype", "bfloat16"))
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(text, f)
    return directory


AVOID: set[int] = set()  # ids that mean something to the processor (the image marker)


def random_ids(rng: random.Random, n: int, lo: int = 1000, hi: int = 31000) -> list[int]:
    # The config ships no tokenizer (random weights): prompts are token ids drawn inside the vocabulary.
    ids = []
    while len(ids) < n:
        i = rng.randrange(lo, hi)
        if i not in AVOID:
            ids.append(i)
    return ids


def measure_ttft(llm, args, image_token: int) -> tuple[list[float], int]:
    import numpy as np

    from splitserve.bench.datasets import parse_size, random_image_uri
    from splitserve.sampling_params import SamplingParams
    rng, np_rng = random.Random(1), np.random.default_rng(1)
    width, height = parse_size(args.image_size)
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    times, prompt_len = [], 0
    for i in range(args.ttft_warmup + args.ttft_runs):
        lo, hi = vocab_range(llm)
        # The image right after BOS, as in the throughput prompts (CogVLM accepts it nowhere else).
        ids = [1, image_token] + random_ids(rng, 8 + args.ttft_prompt_len, lo, hi)
        request = {"prompt_token_ids": ids, "multi_modal_data": {"image": [random_image_uri(np_rng, width, height)]}}
        start = time.perf_counter()
        out = llm.generate(request, params, use_tqdm=False)[0]
        elapsed = time.perf_counter() - start
        prompt_len = len(out.prompt_token_ids)
        if i >= args.ttft_warmup:
            times.append(elapsed)
    return times, prompt_len


def vocab_range(llm) -> tuple[int, int]:
    vocab = llm.engine.config.model.vocab_size
    return min(1000, vocab // 4), min(31000, vocab - 1)


def measure_throughput(llm, args, image_token: int, text_only_lengths: list[int] | None = None) -> dict:
    """Images in every prompt, or (text_only_lengths) text-only prompts of those token lengths."""
    import numpy as np

    from splitserve.bench.datasets import parse_size, random_mm_requests
    from splitserve.multimodal.processor import offline_prompt
    from splitserve.sampling_params import SamplingParams
    np_rng = np.random.default_rng(args.seed)
    samples = random_mm_requests(llm.tokenizer, args.num_prompts, args.input_len, 0.0, args.output_len, 0.0,
                                 np_rng, num_images=1, size=parse_size(args.image_size))
    rng = random.Random(args.seed + (1 if text_only_lengths else 0))
    lo, hi = vocab_range(llm)
    start = time.perf_counter()
    if text_only_lengths:
        prompts = [{"prompt_token_ids": [1] + random_ids(rng, n - 1, lo, hi)} for n in text_only_lengths]
    else:
        prompts = [offline_prompt(llm.engine, {"prompt_token_ids": [1, image_token] + random_ids(rng, s.prompt_len, lo, hi),
                                               "multi_modal_data": {"image": s.images}}) for s in samples]
    preprocess_s = time.perf_counter() - start
    params = [SamplingParams(max_tokens=s.output_len, temperature=0, ignore_eos=True) for s in samples]
    runner = llm.engine.runner
    paths_before = dict(getattr(runner, "steps_by_path", {}))  # (older commits do not count them)
    # Encoder-decoder models encode their image in the encoder run (no image step encoder): one per request.
    encoded = (lambda: runner.mm.num_images_encoded) if runner.mm is not None else (lambda: 0)
    encoded_before = encoded()
    prefetched = (lambda: getattr(runner.mm, "num_images_prefetched", 0)) if runner.mm is not None else (lambda: 0)
    prefetched_before = prefetched()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    lengths = [len(o.prompt_token_ids) for o in outs]
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    paths = {k: v - paths_before[k] for k, v in getattr(runner, "steps_by_path", {}).items()}
    return {"elapsed_s": elapsed, "preprocess_s": preprocess_s, "requests_per_s": len(prompts) / elapsed,
            "output_tok_s": n_out / elapsed, "total_tok_s": (sum(lengths) + n_out) / elapsed,
            "prompt_lengths": lengths, "mean_prompt_tokens": sum(lengths) / len(prompts), "paths": paths,
            "images_prefetched": prefetched() - prefetched_before,
            "images_encoded": (encoded() - encoded_before) if runner.mm is not None
            else (0 if text_only_lengths else len(prompts))}


def path_shares(paths: dict) -> str:
    total = max(1, sum(paths.values()))
    return ", ".join(f"{k} {v} ({100 * v / total:.0f}%)" for k, v in paths.items())


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_CONFIG, help="config directory (random weights)")
    p.add_argument("--tiny", action="store_true",
                   help="merge the directory's tiny_overrides.json: a tiny model, same image geometry (CPU check)")
    p.add_argument("--no-text-only", action="store_true", help="skip the text-only run of the same lengths")
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
    p.add_argument("--no-prefetch", action="store_true",
                   help="encode every image in the step that admits its request (--mm-encoder-budget 0: the A/B "
                        "of encoding ahead)")
    p.add_argument("--json-out", default=None, help="also write the figures to this JSON file")
    p.add_argument("--text-model", action="store_true",
                   help="the model's language model alone (a Llama: CogVLM without its visual expert) on text-only "
                        "prompts of the lengths in --lengths-from")
    p.add_argument("--lengths-from", default=None, help="a --json-out file of a VLM run (its prompt lengths)")
    p.add_argument("--suite", action="store_true",
                   help="every decoder-only VLM of issue 41 (benchmarks/vlm_suite.py), one process each, one table")
    p.add_argument("--suite-models", default=None, help="with --suite: config names, comma-separated")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.suite:
        from benchmarks.vlm_suite import run_suite
        return run_suite(args, sys.argv[1:] if argv is None else list(argv))

    import torch

    from splitserve.engine.llm import LLM
    tmp = tempfile.TemporaryDirectory()
    model = write_tiny_config(args.model, os.path.join(tmp.name, "m")) if args.tiny else args.model
    if args.text_model:
        model = write_text_model_config(model, os.path.join(tmp.name, "text"))
    t0 = time.perf_counter()
    llm = LLM(model, random_weights=True, dtype=args.dtype, device=args.device, enforce_eager=args.enforce_eager,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              **({"mm_encoder_budget": 0} if args.no_prefetch else {}))
    start_s = time.perf_counter() - t0
    cfg = llm.engine.config
    result = {"model": os.path.basename(os.path.normpath(args.model)), "architecture": cfg.model.architecture,
              "start_s": start_s}
    if args.text_model:
        with open(args.lengths_from) as f:
            vlm_run = json.load(f)
        lengths = vlm_run["vlm"]["prompt_lengths"]
        AVOID.add(vlm_run["image_token"])  # the same prompts as the VLM's text-only run
        result["text"] = measure_throughput(llm, args, None, lengths)
        print(f"{result['model']} language model alone ({cfg.model.architecture}): "
              f"{result['text']['output_tok_s']:.1f} output tok/s")
        return finish(args, result, tmp)
    image_token = llm.engine.mm_processor.placeholder_id
    AVOID.add(image_token)
    result["image_token"] = image_token

    ttfts, ttft_prompt_len = measure_ttft(llm, args, image_token)
    tp = measure_throughput(llm, args, image_token)
    text = None if args.no_text_only else measure_throughput(llm, args, image_token, tp["prompt_lengths"])
    assert llm.engine.kv_manager.pool.is_whole()
    assert llm.engine.runner.mm is None or llm.engine.runner.mm.cache.is_whole()
    result.update(vlm=tp, text=text, ttft_ms=statistics.median(ttfts) * 1e3)

    device = torch.cuda.get_device_name() if cfg.device.startswith("cuda") else "cpu"
    print(f"\nsplitserve VLM benchmark: {'tiny ' if args.tiny else ''}{result['model']} "
          f"({cfg.model.architecture}), {cfg.model.dtype}, {device}, backend {cfg.attention_backend}, "
          f"engine start {start_s:.1f} s")
    rows = [
        (f"TTFT, 1 image {args.image_size} + text", f"median {statistics.median(ttfts) * 1e3:.1f} ms "
         f"(min {min(ttfts) * 1e3:.1f}, max {max(ttfts) * 1e3:.1f}; {len(ttfts)} runs; {ttft_prompt_len} prompt tokens)"),
        (f"throughput, {args.num_prompts} random-mm requests",
         f"{tp['requests_per_s']:.2f} req/s, {tp['output_tok_s']:.1f} output tok/s, {tp['total_tok_s']:.1f} total tok/s"),
        ("  run", f"{tp['elapsed_s']:.2f} s engine; {tp['preprocess_s']:.2f} s image preprocessing (not in the rate); "
         f"{tp['mean_prompt_tokens']:.0f} prompt tokens/request; output {args.output_len}; "
         f"{tp['images_encoded']} images encoded ({tp['images_prefetched']} ahead of admission), "
         f"{tp['images_encoded'] / tp['elapsed_s']:.1f} images/s"),
        ("  steps", path_shares(tp["paths"])),
    ]
    if text:
        rows += [
            ("text-only, same prompt lengths", f"{text['requests_per_s']:.2f} req/s, {text['output_tok_s']:.1f} output tok/s, "
             f"{text['total_tok_s']:.1f} total tok/s ({text['elapsed_s']:.2f} s)"),
            ("  steps", path_shares(text["paths"])),
            ("VLM / text-only output tok/s", f"{tp['output_tok_s'] / text['output_tok_s']:.3f}"),
        ]
    width = max(len(r[0]) for r in rows)
    print("-" * (width + 60))
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    return finish(args, result, tmp)


def finish(args, result: dict, tmp) -> int:
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f)
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
