"""Command line of the serving benchmark: `splitserve bench serve` and `splitserve bench sweep`.

The main CLI calls register(bench_subparsers) and then args.func(args), which returns the exit
code. `python -m splitserve.bench.cli serve ...` runs it standalone.

Exit codes: 0 the run finished with at least one successful request; 1 the server could not be
reached, the test request failed, or every request failed; 2 bad arguments or input files.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys

from splitserve.bench.datasets import DATASETS, BenchError


def _note(msg: str) -> None:
    # Notes go to stderr so stdout carries only the result table (easy to tee or diff).
    print(f"bench: {msg}", file=sys.stderr, flush=True)


def _add_common(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--base-url", default="http://127.0.0.1:8000",
                   help="server address, e.g. http://127.0.0.1:8000 (a trailing /v1 is fine)")
    g.add_argument("--model", default=None,
                   help="model name to send; default: the first model the server lists at /v1/models")
    g.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME",
                   help="LoRA adapters the server serves under these names: request i names adapter i mod N "
                        "(round robin, so a run spreads evenly over them)")
    g.add_argument("--endpoint", choices=["completions", "chat"], default="completions",
                   help="/v1/completions or /v1/chat/completions")
    g.add_argument("--tokenizer", default=None,
                   help="tokenizer for prompt building and token counts: a local dir, .gguf file or cached "
                        "HF repo; default: the --model value; 'default' = splitserve's default model")
    g.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="bearer token (default: $OPENAI_API_KEY)")
    g.add_argument("--connect-timeout", type=float, default=5.0,
                   help="seconds to wait for the server's first answer before giving up")
    g.add_argument("--request-timeout", type=float, default=600.0, help="total seconds allowed per request")
    g.add_argument("--no-test-request", action="store_true",
                   help="skip the single request sent before the run to catch a wrong model/endpoint early")

    g = p.add_argument_group("requests")
    g.add_argument("--dataset", choices=DATASETS, default="random")
    g.add_argument("--dataset-path", default=None, help="ShareGPT-format JSON file for --dataset sharegpt")
    g.add_argument("--num-prompts", type=int, default=100)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--ignore-eos", action="store_true",
                   help="ask the server to generate exactly max_tokens (vLLM/SGLang/llama.cpp/TRT-LLM extension)")
    g.add_argument("--temperature", type=float, default=None, help="sampling temperature (default: server's)")
    g.add_argument("--extra-body", default=None, help="JSON object merged into every request body")
    g.add_argument("--token-ids", action="store_true",
                   help="completions only: send random prompts as token-id lists, for exact input lengths")
    g.add_argument("--random-input-len", type=int, default=1024, help="mean prompt tokens (random, random-mm)")
    g.add_argument("--random-input-std", type=float, default=0.0, help="stdev of prompt tokens; 0 = fixed")
    g.add_argument("--random-output-len", type=int, default=128, help="mean output tokens (random, random-mm)")
    g.add_argument("--random-output-std", type=float, default=0.0, help="stdev of output tokens; 0 = fixed")
    g.add_argument("--sharegpt-output-len", type=int, default=None,
                   help="fixed max_tokens for sharegpt/synthetic-sharegpt instead of the reply's length")
    g.add_argument("--sharegpt-max-input-len", type=int, default=1024)
    g.add_argument("--sharegpt-max-total-len", type=int, default=2048)
    g.add_argument("--random-mm-num-images", type=int, default=1)
    g.add_argument("--random-mm-image-size", default="512x512", help="WIDTHxHEIGHT of generated images")

    g = p.add_argument_group("load")
    g.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the arrival gaps: 1 = Poisson, <1 burstier, >1 more even")
    g.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight at once")
    g.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def register(subparsers) -> None:
    """Add `serve` and `sweep` to the subparsers of `splitserve bench`."""
    p = subparsers.add_parser("serve", help="benchmark an OpenAI-compatible server",
                              description="Benchmark an OpenAI-compatible server (splitserve, vLLM, SGLang, "
                                          "trtllm-serve, llama.cpp) with streamed requests.")
    _add_common(p)
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests per second (Poisson with --burstiness 1); inf sends all at once")
    p.add_argument("--save-result", default=None, metavar="FILE.json", help="write config, metrics and per-request data")
    p.set_defaults(func=cmd_serve)

    p = subparsers.add_parser("sweep", help="benchmark at several request rates and plot latency vs throughput")
    _add_common(p)
    p.add_argument("--request-rates", default="1,2,4,8,inf", help="comma-separated rates, e.g. 1,2,4,8,inf")
    p.add_argument("--plot", default="sweep.png", metavar="FILE.png", help="latency vs throughput plot")
    p.add_argument("--save-result", default=None, metavar="FILE.json", help="write all runs' metrics")
    p.set_defaults(func=cmd_sweep)


def _guarded(fn):
    """Expected failures become a one-line message and an exit code, never a traceback."""
    def run(args) -> int:
        try:
            return fn(args)
        except BenchError as e:
            print(f"error: {e}", file=sys.stderr)
            return e.exit_code
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            return 130
    return run


def _check_out_path(path: str | None, flag: str) -> None:
    """Catch an unwritable output path before a long run, not after it."""
    if path:
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):
            raise BenchError(f"{flag} {path}: folder {folder} does not exist")


def _validate(args) -> dict:
    if args.num_prompts < 1:
        raise BenchError("--num-prompts must be at least 1")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise BenchError("--max-concurrency must be at least 1")
    if args.dataset == "random-mm" and args.endpoint != "chat":
        raise BenchError("--dataset random-mm sends images, which needs --endpoint chat")
    if args.token_ids and (args.endpoint != "completions" or args.dataset not in ("random", "synthetic-sharegpt")):
        raise BenchError("--token-ids works with --endpoint completions and --dataset random or synthetic-sharegpt")
    if args.dataset_path and args.dataset != "sharegpt":
        raise BenchError(f"--dataset-path is only read by --dataset sharegpt (got --dataset {args.dataset})")
    if args.request_timeout <= 0 or args.connect_timeout <= 0:
        raise BenchError("timeouts must be positive")
    extra = {}
    if args.extra_body:
        try:
            extra = json.loads(args.extra_body)
        except json.JSONDecodeError as e:
            raise BenchError(f"--extra-body is not valid JSON: {e}") from None
        if not isinstance(extra, dict):
            raise BenchError("--extra-body must be a JSON object")
    _check_out_path(args.save_result, "--save-result")
    return extra


def _prepare(args):
    """Everything before the timed run, cheapest checks first so bad input fails in milliseconds:
    arguments and dataset file, then the server, then the (possibly slow) tokenizer."""
    import numpy as np

    from splitserve.bench import datasets as ds
    from splitserve.bench.serve import BenchConfig, check_server, load_bench_tokenizer, normalize_base_url

    extra = _validate(args)
    pairs = ds.load_sharegpt_pairs(args.dataset_path) if args.dataset == "sharegpt" else None
    image_size = ds.parse_size(args.random_mm_image_size) if args.dataset == "random-mm" else None
    base_url = normalize_base_url(args.base_url)
    models = check_server(base_url, args.api_key, args.connect_timeout)
    model = args.model
    if model is None:
        if not models:
            raise BenchError(f"server at {base_url} lists no models at /v1/models; pass --model NAME")
        model = models[0]
        _note(f"model not given; using the server's first model: {model}")
    elif models and model not in models:
        _note(f"warning: {model!r} is not among the served models {models}; sending it anyway")

    tok_spec = args.tokenizer or model
    _note(f"loading tokenizer {tok_spec!r}")
    tokenizer = load_bench_tokenizer(tok_spec)

    rng = np.random.default_rng(args.seed)
    n = args.num_prompts
    if args.dataset == "random":
        samples = ds.random_requests(tokenizer, n, args.random_input_len, args.random_input_std,
                                     args.random_output_len, args.random_output_std, rng, args.token_ids)
    elif args.dataset == "random-mm":
        samples = ds.random_mm_requests(tokenizer, n, args.random_input_len, args.random_input_std,
                                        args.random_output_len, args.random_output_std, rng,
                                        args.random_mm_num_images, image_size)
    elif args.dataset == "synthetic-sharegpt":
        samples = ds.synthetic_sharegpt_requests(tokenizer, n, rng, args.token_ids, args.sharegpt_output_len)
    else:
        samples = ds.sharegpt_requests(pairs, tokenizer, n, rng, args.sharegpt_output_len,
                                       args.sharegpt_max_input_len, args.sharegpt_max_total_len)
        if len(samples) < n:
            _note(f"only {len(samples)} of {len(pairs)} conversations pass the length filter; "
                  f"running {len(samples)} requests, not {n}")
    if args.lora_modules:
        missing = [name for name in args.lora_modules if models and name not in models]
        if missing:
            _note(f"warning: LoRA modules {missing} are not among the served models {models}; sending them anyway")
        for i, sample in enumerate(samples):
            sample.model = args.lora_modules[i % len(args.lora_modules)]
    cfg = BenchConfig(base_url=base_url, model=model, endpoint=args.endpoint, request_rate=getattr(args, "request_rate", math.inf),
                      burstiness=args.burstiness, max_concurrency=args.max_concurrency, ignore_eos=args.ignore_eos,
                      temperature=args.temperature, extra_body=extra, api_key=args.api_key,
                      request_timeout=args.request_timeout, disable_tqdm=args.disable_tqdm)
    return cfg, samples, tokenizer, tok_spec


def _config_json(args, cfg, tok_spec: str, n_samples: int) -> dict:
    return {"base_url": cfg.base_url, "endpoint": cfg.endpoint, "model": cfg.model, "tokenizer": tok_spec,
            "dataset": args.dataset, "dataset_path": args.dataset_path, "num_prompts": n_samples,
            "seed": args.seed, "burstiness": cfg.burstiness, "max_concurrency": cfg.max_concurrency,
            "ignore_eos": cfg.ignore_eos, "temperature": cfg.temperature, "extra_body": cfg.extra_body,
            "random_input_len": args.random_input_len, "random_input_std": args.random_input_std,
            "random_output_len": args.random_output_len, "random_output_std": args.random_output_std,
            "token_ids": args.token_ids}


def _rate_json(rate: float):
    return "inf" if math.isinf(rate) else rate


def _write_json(path: str, obj: dict) -> None:
    try:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=2)
    except OSError as e:
        raise BenchError(f"cannot write {path}: {e}", 1) from None
    _note(f"saved {path}")


def _describe(args, cfg, samples) -> None:
    load = f"rate {cfg.request_rate:g} req/s" + (f", burstiness {cfg.burstiness:g}" if not math.isinf(cfg.request_rate) else "")
    if cfg.max_concurrency:
        load += f", max concurrency {cfg.max_concurrency}"
    mean_in = sum(s.prompt_len for s in samples) / len(samples)
    mean_out = sum(s.output_len for s in samples) / len(samples)
    _note(f"{len(samples)} {args.dataset} requests to {cfg.base_url} ({cfg.endpoint}, model {cfg.model}); "
          f"mean prompt {mean_in:.0f} tokens (client count), mean max_tokens {mean_out:.0f}; {load}")


@_guarded
def cmd_serve(args) -> int:
    from splitserve.bench.metrics import compute_metrics, format_table
    from splitserve.bench.serve import acceptance_length, benchmark, results_to_json, spec_decode_counters

    cfg, samples, tokenizer, tok_spec = _prepare(args)
    _describe(args, cfg, samples)
    spec_before = spec_decode_counters(cfg.base_url, args.api_key)
    [(results, duration)] = benchmark(cfg, samples, tokenizer, seed=args.seed, test_request=not args.no_test_request)
    metrics = compute_metrics(results, duration)
    print(format_table(metrics))
    accept_len = acceptance_length(spec_before, spec_decode_counters(cfg.base_url, args.api_key))
    if accept_len is not None:  # the server speculates: tokens per verify step over this run (and the test request)
        print(f"Mean acceptance length (speculative decoding): {accept_len:.2f}")
    if args.save_result:
        _write_json(args.save_result, {
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "config": {**_config_json(args, cfg, tok_spec, len(samples)), "request_rate": _rate_json(cfg.request_rate)},
            "metrics": metrics.to_dict(), "requests": results_to_json(results)})
    if metrics.completed == 0:
        _note("every request failed; see the errors above")
        return 1
    return 0


@_guarded
def cmd_sweep(args) -> int:
    from splitserve.bench.metrics import compute_metrics, format_table
    from splitserve.bench.serve import benchmark
    from splitserve.bench.sweep import format_sweep_table, parse_rates, plot_sweep

    rates = parse_rates(args.request_rates)
    _check_out_path(args.plot, "--plot")
    cfg, samples, tokenizer, tok_spec = _prepare(args)
    _describe(args, cfg, samples)
    _note(f"sweeping request rates {', '.join(f'{r:g}' for r in rates)}")
    runs = benchmark(cfg, samples, tokenizer, seed=args.seed, rates=rates, test_request=not args.no_test_request)
    points = []
    for rate, (results, duration) in zip(rates, runs):
        m = compute_metrics(results, duration)
        points.append((rate, m))
        print(format_table(m, title=f"Request rate {rate:g} req/s"))
    print(format_sweep_table(points))
    plot_sweep(points, args.plot, f"{cfg.model} via {cfg.endpoint}, {args.dataset}, {len(samples)} requests per rate")
    _note(f"saved {args.plot}")
    if args.save_result:
        _write_json(args.save_result, {
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "config": _config_json(args, cfg, tok_spec, len(samples)),
            "runs": [{"request_rate": _rate_json(rate), "metrics": m.to_dict()} for rate, m in points]})
    if all(m.completed == 0 for _, m in points):
        _note("every request failed; see the errors above")
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="splitserve bench", description="Serving benchmarks")
    register(parser.add_subparsers(dest="bench_command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
