"""What structured outputs cost: offline LLM.generate throughput with none vs a share of the requests
constrained by a JSON schema.

    python benchmarks/structured_overhead.py                          # default model, CPU-sized run
    python benchmarks/structured_overhead.py --model <dir> --num-prompts 1024 --input-len 256 \\
        --output-len 256 --fraction 0.25 --random-weights              # the GPU run for BENCHMARKS.md

Every request generates exactly --output-len tokens, so the runs do the same model work: plain
requests ignore EOS, and constrained ones follow a schema that cannot end sooner (an array with a
large minItems). --schema picks it:
- bounded-strings (the default, the figures of earlier sessions): at least 200 strings of at most 12
  characters. Nearly every token is inside a length-bounded string, xgrammar's most expensive state
  (~0.4 ms per mask on Llama-3's 128k vocabulary, one thread): a worst case.
- objects: at least 100 objects shaped like an extraction schema (name, email: strings; age: an
  integer; role: an enum; active: a boolean; tags: up to 3 strings), the kind of schema vLLM's
  structured-output benchmark sends. Most tokens are in keys, numbers and unbounded strings, far
  cheaper to mask (benchmarks/grammar_fill.py --schema objects prints the per-mask cost).
The constrained requests are spread evenly through the batch. Prints output
tokens/s of each run (best of --repeats, after a warm-up run) and the relative cost.
--structured-outputs-fill inline measures the fill on the engine core's thread (before the grammar
process).
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from splitserve import LLM, SamplingParams
from splitserve.sampling_params import StructuredOutputsParams

LONG_ARRAY = {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 200}
# One object is at least ~20 tokens, so 100 of them outlast any --output-len up to ~2000.
RECORD = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "email": {"type": "string"},
        "age": {"type": "integer"},
        "role": {"enum": ["admin", "editor", "viewer", "guest"]},
        "active": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
    },
    "required": ["name", "email", "age", "role", "active", "tags"],
}
OBJECT_ARRAY = {"type": "array", "items": RECORD, "minItems": 100}
SCHEMAS = {"bounded-strings": LONG_ARRAY, "objects": OBJECT_ARRAY}


def add_schema_option(ap) -> None:
    ap.add_argument("--schema", choices=tuple(SCHEMAS), default="bounded-strings",
                    help="the constrained requests' JSON schema (see the module's docstring)")


def build_requests(llm: LLM, args, fraction: float) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = np.random.default_rng(0)
    vocab = len(llm.tokenizer)
    prompts = [rng.integers(100, vocab - 100, args.input_len).tolist() for _ in range(args.num_prompts)]
    plain = SamplingParams(temperature=args.temperature, max_tokens=args.output_len, ignore_eos=True)
    constrained = SamplingParams(temperature=args.temperature, max_tokens=args.output_len,
                                 structured_outputs=StructuredOutputsParams(json=SCHEMAS[args.schema]))
    num_constrained = round(fraction * args.num_prompts)
    marked = set(np.linspace(0, args.num_prompts, num_constrained, endpoint=False).astype(int).tolist()) \
        if num_constrained else set()
    return prompts, [constrained if i in marked else plain for i in range(args.num_prompts)]


def run(llm: LLM, prompts, params) -> tuple[float, int]:
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return elapsed, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model path (default: the default SmolLM2 GGUF)")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--fraction", type=float, default=0.25, help="share of constrained requests")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--random-weights", action="store_true", help="--model is a config directory (no weights)")
    ap.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None)
    add_schema_option(ap)
    ap.add_argument("--structured-outputs-fill", choices=("process", "inline"), default="process",
                    help="masks filled in the grammar process (default) or on the engine core's thread")
    args = ap.parse_args()

    extra = dict(random_weights=True, dtype="bfloat16", max_model_len=4096) if args.random_weights else {}
    llm = LLM(args.model, max_num_seqs=args.max_num_seqs, async_scheduling=args.async_scheduling,
              structured_outputs_fill=args.structured_outputs_fill, **extra)
    results = {}
    for fraction in (0.0, args.fraction):
        prompts, params = build_requests(llm, args, fraction)
        run(llm, prompts[:max(8, args.num_prompts // 8)], params[:max(8, args.num_prompts // 8)])  # warm-up, compiles
        best = None
        for _ in range(args.repeats):
            elapsed, tokens = run(llm, prompts, params)
            assert tokens == args.num_prompts * args.output_len, "a request ended before --output-len"
            best = elapsed if best is None else min(best, elapsed)
        results[fraction] = tokens / best
        print(f"constrained {fraction:4.0%}: {tokens} output tokens in {best:.2f} s = {tokens / best:,.0f} tok/s",
              flush=True)
    base, constrained = results[0.0], results[args.fraction]
    print(f"structured outputs ({args.schema}) at {args.fraction:.0%} of requests cost "
          f"{100 * (1 - constrained / base):.1f}% of the throughput")


if __name__ == "__main__":
    main()
