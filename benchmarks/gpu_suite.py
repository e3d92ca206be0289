"""One device run: correctness of the fast path against torch_ref, then the issue-4 benchmarks.

    python benchmarks/gpu_suite.py --check [--tokenizer-dir DIR]  # greedy tokens: fast path vs torch_ref
    python benchmarks/gpu_suite.py --bench decode,prefill,tp128,tp1024 [--repeats 3] [--quantization fp8]
    ... [--tensor-parallel-size 2] [--config benchmarks/configs/llama3-70b]  # several GPUs, another shape
    ... --config benchmarks/configs/qwen3-8b  # another family (gemma2-9b; mixtral-8x7b needs an H200)
    ... [--kv-cache-dtype fp8]  # both: an FP8 KV cache (the check's torch_ref reference uses one too)
    ... --config benchmarks/configs/llama3-8b-gptq-int4  # a checkpoint's format: W4A16 (llama3-8b-w8a8-int8: INT8)

Benchmarks use the Llama-3-8B-shaped config in benchmarks/configs/llama3-8b (or --config) with random
bf16 weights, token-id prompts and ignore_eos (fixed output lengths); a fresh prompt seed per run so
nothing hits the prefix cache. The tokenizer is the config directory's own, else --tokenizer (default
.devcarry/llama3-8b); a model vocabulary larger than the tokenizer's is fine with token-id prompts.
Prints a table last.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

T_PROCESS_START = time.perf_counter()

import torch  # noqa: E402

from splitserve import LLM, SamplingParams  # noqa: E402

CONFIG_8B = os.path.join(os.path.dirname(__file__), "configs", "llama3-8b")
rows: list[tuple[str, str]] = []


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000, vocab - 1000) for _ in range(length)] for _ in range(n)]


def check(tokenizer_dir: str, kv_cache_dtype: str = "auto", quantization: str | None = None) -> None:
    """Greedy tokens of the fast path (Triton, compiled layers, CUDA graphs) vs the torch_ref backend
    run eagerly, on a random Llama checkpoint saved by transformers (GQA, head_dim 64): fp32 (should
    agree but for near-ties) and bf16."""
    import tempfile

    from transformers import AutoTokenizer

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tests.hf_reference import make_tiny_llama_dir
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    path = make_tiny_llama_dir(tempfile.mkdtemp(), tok, num_kv_heads=2, tie=False, hidden_size=512,
                               intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
                               max_position_embeddings=4096, initializer_range=0.05)
    rng = random.Random(0)
    p = [[rng.randrange(3, 40000) for _ in range(rng.randrange(5, 300))] for _ in range(24)]
    p += [p[0] + p[1][:k] for k in (3, 17, 40)]  # shared prefixes: prefix-cache hits
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    for dtype in ("float32", "bfloat16"):
        ref = LLM(path, dtype=dtype, attention_backend="torch_ref", enforce_eager=True, num_blocks=4096,
                  kv_cache_dtype=kv_cache_dtype, quantization=quantization)
        ref_out = [o.outputs[0].token_ids for o in ref.generate(p, params, use_tqdm=False)]
        del ref
        torch.cuda.empty_cache()
        fast = LLM(path, dtype=dtype, max_num_batched_tokens=512, num_blocks=4096,  # chunked prefill + decodes
                   kv_cache_dtype=kv_cache_dtype, quantization=quantization)
        fast_out = [o.outputs[0].token_ids for o in fast.generate(p, params, use_tqdm=False)]
        again = [o.outputs[0].token_ids for o in fast.generate(p, params, use_tqdm=False)]  # prefix-cache hits
        pool_whole = fast.engine.kv_manager.pool.is_whole()
        same = sum(a == b for a, b in zip(ref_out, fast_out))
        same2 = sum(a == b for a, b in zip(fast_out, again))
        prefix = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)) for a, b in zip(ref_out, fast_out)]
        rows.append((f"check {dtype}, KV {kv_cache_dtype}: fast == torch_ref (greedy, 48 tok)", f"{same}/{len(p)} equal; first diverging "
                     f"positions {[x for x in prefix if x < 48]}; rerun w/ prefix hits {same2}/{len(p)}; pool whole {pool_whole}"))
        del fast
        torch.cuda.empty_cache()


def bench_tokenizer(config: str, fallback: str) -> str | None:
    """The config directory's tokenizer if it has one, else the fallback directory."""
    if any(os.path.exists(os.path.join(config, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    if not os.path.isdir(fallback):
        raise SystemExit(f"{config} has no tokenizer and --tokenizer {fallback} is not a directory")
    return fallback


def bench(which: list[str], repeats: int, max_num_seqs: int, max_num_batched_tokens: int,
          kv_cache_dtype: str = "auto", quantization: str | None = None, config: str = CONFIG_8B,
          tensor_parallel_size: int = 1, tokenizer: str = ".devcarry/llama3-8b") -> None:
    t0 = time.perf_counter()
    llm = LLM(config, random_weights=True, dtype="bfloat16", max_model_len=4096, max_num_seqs=max_num_seqs,
              max_num_batched_tokens=max_num_batched_tokens, kv_cache_dtype=kv_cache_dtype,
              quantization=quantization, tensor_parallel_size=tensor_parallel_size,
              tokenizer=bench_tokenizer(config, tokenizer))
    rows.append(("model, ranks", f"{os.path.basename(os.path.normpath(config))}, tensor_parallel_size {tensor_parallel_size}"))
    rows.append(("quantization", llm.engine.config.model.quantization or "none (bf16)"))
    rows.append(("KV cache", f"{kv_cache_dtype}: {llm.engine.core.num_blocks} blocks of "
                 f"{llm.engine.config.cache.block_size} tokens"))
    engine_s = time.perf_counter() - t0
    vocab = llm.engine.config.model.vocab_size
    seed = iter(range(1000, 10**6))
    t = time.perf_counter()
    llm.generate(prompts(1, 128, vocab, next(seed)), SamplingParams(max_tokens=1, ignore_eos=True), use_tqdm=False)
    first = time.perf_counter() - t
    rows.append(("cold start: process start -> first token (random weights)",
                 f"{time.perf_counter() - T_PROCESS_START:.1f} s (engine build incl. compile+graphs {engine_s:.1f} s, "
                 f"first request {first:.2f} s)"))

    def timed(n, inp, out):
        ps = prompts(n, inp, vocab, next(seed))
        params = SamplingParams(max_tokens=out, temperature=0, ignore_eos=True)
        if tensor_parallel_size == 1:  # the ranks' processes answer a step when it is done
            torch.cuda.synchronize()
        t = time.perf_counter()
        res = llm.generate(ps, params, use_tqdm=False)
        el = time.perf_counter() - t
        assert all(len(o.outputs[0].token_ids) == out for o in res)
        return el

    if "decode" in which:
        per_tok = []
        for _ in range(repeats):
            full = timed(1, 128, 256)
            pre = timed(1, 128, 1)
            per_tok.append((full - pre) / 255 * 1e3)
        rows.append(("batch-1 decode, 128 in / 256 out", f"{statistics.median(per_tok):.2f} ms/token "
                     f"(runs {', '.join(f'{x:.2f}' for x in per_tok)}; target <= 5.6, vLLM 6.58)"))
    if "prefill" in which:
        r = [8 * 2048 / timed(8, 2048, 1) for _ in range(repeats)]
        rows.append(("prefill 8 x 2048, 1 new token", f"{statistics.median(r):,.0f} tok/s (runs {', '.join(f'{x:,.0f}' for x in r)}; "
                     f"target >= 46,000, vLLM 41,083)"))
    if "tp128" in which:
        r = [timed(1000, 128, 128) for _ in range(repeats)]
        m = statistics.median(r)
        rows.append(("offline 1000 x 128 in / 128 out", f"{128000 / m:,.0f} output tok/s, {256000 / m:,.0f} total tok/s, "
                     f"{m:.2f} s (runs {', '.join(f'{x:.2f}' for x in r)}; target >= 18,000 out, vLLM 12,127)"))
    if "tp1024" in which:
        r = [timed(1000, 1024, 128) for _ in range(repeats)]
        m = statistics.median(r)
        rows.append(("offline 1000 x 1024 in / 128 out", f"{1152000 / m:,.0f} total tok/s, {128000 / m:,.0f} output tok/s, "
                     f"{m:.2f} s (runs {', '.join(f'{x:.2f}' for x in r)}; target >= 38,000 total, vLLM 32,480)"))


def main() -> None:
    import logging
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--tokenizer-dir", default=".devcarry/tok", help="a saved HF tokenizer for the check model")
    ap.add_argument("--bench", default="", help="comma list of decode,prefill,tp128,tp1024 (or 'cold': start-up only)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-num-seqs", type=int, default=512)
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)
    ap.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8", "fp8_e4m3"),
                    help="the engines' KV-cache element type (EngineArgs.kv_cache_dtype)")
    ap.add_argument("--quantization", default=None,
                    help="passed to LLM(quantization=...): fp8 quantizes the random bf16 weights at load")
    ap.add_argument("--config", default=CONFIG_8B, help="the model's config directory (random weights)")
    ap.add_argument("--tensor-parallel-size", type=int, default=1, help="ranks (GPUs) of the benchmark engine")
    ap.add_argument("--tokenizer", default=".devcarry/llama3-8b",
                    help="the tokenizer directory when the config directory has none")
    args = ap.parse_args()
    try:
        if args.check:
            check(args.tokenizer_dir, args.kv_cache_dtype, args.quantization)
        if args.bench:
            bench(args.bench.split(","), args.repeats, args.max_num_seqs, args.max_num_batched_tokens,
                  args.kv_cache_dtype, args.quantization, args.config, args.tensor_parallel_size, args.tokenizer)
    finally:
        print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}")
        for name, value in rows:
            print(f"{name:60s} {value}")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
