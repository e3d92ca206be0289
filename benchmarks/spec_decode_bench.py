"""Speculative decoding, the machinery at known acceptance (an oracle drafter on random weights) and
n-gram drafts on real text; one engine per process.

    python benchmarks/spec_decode_bench.py            # the table: Llama-3-8B shape (bf16, k = 4) + default model text
    python benchmarks/spec_decode_bench.py --tiny     # the same at CPU scale (a 2-layer random model), to check it runs
    ... --parts oracle | text                         # one half only

Random-weight targets accept nothing from real drafters, so the first part uses an *oracle*: a first
process runs the target with speculation off and saves each prompt's greedy continuation and the
timings to a JSON file; a second process builds the speculating engine (method ngram, whose proposer
is replaced) and proposes the saved continuation. The verifier's acceptance is forced
(layers/rejection_sampler.py's measurement hook, set per phase): each draft accepted with probability
a, the token after the run the target's argmax; the nominal acceptance length at k drafts is
1 + a + ... + a^k, a solved for the asked length. Forcing is needed because random weights give
near-tied logits that a verify step rounds differently from a plain step (bf16): the target's own
greedy text with speculation on soon leaves the saved one, and every replayed draft after that is
wrong. Outputs of forced phases then differ from speculation off (`equal` is n/a). With
`--no-force-accept` the old replay runs instead (each saved token kept with probability a, else
replaced by a wrong one; the target's real greedy check decides). Measured in the second process, one
phase after another (the controller's estimates reset between phases):

- `verify/plain`: batch 1, adaptive off, a = 0 (every step verifies k + 1 tokens and emits one):
  its time per token over the plain decode step's (the first process's batch 1);
- `len 3.0`: tokens/s at each batch size, adaptive on (the default), over speculation off;
- `len 1.2`: batch 1, adaptive on, over speculation off (the back-off).

The second part runs the default model (SmolLM2-135M) on prompts that quote their source, batch 1,
greedy, in two processes (speculation off; ngram), and checks the outputs equal.

Each engine lives in its own process, so each gets the whole device (building a second engine in a
process that still holds the first's KV cache found no memory on the GPU).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

PARAGRAPH = ("Speculative decoding lets a cheap proposer guess several tokens ahead; the large model then "
             "checks all of them in a single forward pass and keeps the longest prefix it agrees with, plus "
             "one token of its own. When the guesses are good the model emits several tokens per step, and "
             "when they are bad it loses little, because the verification costs about as much as one step.")
TINY_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
               "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 2, "vocab_size": 49152, "max_position_embeddings": 2048,
               "rope_theta": 10000.0, "rms_norm_eps": 1e-05, "tie_word_embeddings": False,
               "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu", "torch_dtype": "float32"}


def copy_prompts(n: int) -> list[str]:
    """Prompts whose answers quote their input (the n-gram proposer's case)."""
    tasks = ["Fix the typo in this paragraph and repeat it in full:\n", "Repeat the following text exactly:\n",
             "Quote this paragraph, then summarise it in one line:\n", "Copy this text verbatim:\n"]
    return [f"{tasks[i % len(tasks)]}{PARAGRAPH.replace('the', 'teh', 1 + i % 3)}\nAnswer:\n" for i in range(n)]


def random_prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1000, 20000, length).tolist() for _ in range(n)]


def accept_rate(length: float, k: int) -> float:
    """a with 1 + a + ... + a^k = length (bisection)."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sum(mid ** j for j in range(k + 1)) < length else (lo, mid)
    return lo


class OracleProposer:
    """Proposes the saved greedy continuation of the request whose prompt the tokens start with, each
    token right with probability `accept` (worker/spec_decode.NgramProposer's interface)."""

    def __init__(self, k: int, accept: float, continuations: dict[tuple, list], key_len: int, seed: int = 0):
        self.k, self.accept, self.continuations, self.key_len = k, accept, continuations, key_len
        self.rng = np.random.default_rng(seed)

    def propose(self, tokens: np.ndarray) -> list[int]:
        for prompt_len, cont in self.continuations.get(tuple(tokens[:self.key_len].tolist()), ()):
            done = len(tokens) - prompt_len
            if 0 <= done < len(cont):
                drafts = list(cont[done:done + self.k])
                for j in range(len(drafts)):
                    if self.rng.random() >= self.accept:
                        wrong = 1000 + int(self.rng.integers(1000))
                        drafts[j] = wrong if wrong != drafts[j] else wrong + 1
                return drafts
        return []

    def propose_many(self, token_ids: np.ndarray, rows: np.ndarray, lengths: np.ndarray) -> list[list[int]]:
        return [self.propose(token_ids[r, :n]) for r, n in zip(rows.tolist(), lengths.tolist())]


# -- one engine per process -------------------------------------------------------------------------
def build(args, spec: dict | None, model: str | None, random_weights: bool, max_num_seqs: int):
    from splitserve import LLM
    kw = dict(dtype=args.dtype, max_model_len=args.max_model_len, gpu_memory_utilization=args.gpu_memory_utilization,
              max_num_seqs=max_num_seqs, random_weights=random_weights)
    if args.tiny:
        kw.update(cpu_kv_cache_gib=0.5)
    if spec is not None:
        kw["speculative_config"] = spec
    return LLM(model, **kw)


def timed(llm, prompts, params, repeats: int):
    """Best time of `repeats` runs (prefix cache reset before each) and the last run's token ids."""
    times = []
    for _ in range(repeats):
        llm.engine.core.kv_manager.pool.reset_prefix_cache()
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        times.append(time.perf_counter() - t)
    return min(times), [list(o.outputs[0].token_ids) for o in outs]


def greedy(args, max_tokens: int, ignore_eos: bool = True):
    from splitserve import SamplingParams
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=ignore_eos)


def role_off(args) -> dict:
    llm = build(args, None, args.model, True, max(args.batches))
    llm.generate(random_prompts(2, 16, 99), greedy(args, 8), use_tqdm=False)  # warm-up
    out = {}
    for b in args.batches:
        prompts = [{"prompt_token_ids": p} for p in random_prompts(b, args.prompt_len, seed=b)]
        secs, tokens = timed(llm, prompts, greedy(args, args.max_tokens), args.repeats)
        out[str(b)] = {"seconds": secs, "tokens": tokens}
        print(f"[off] batch {b}: {b * args.max_tokens / secs:.1f} tok/s", flush=True)
    return out


def role_oracle(args) -> dict:
    from dataclasses import replace

    from splitserve.core.spec_control import SpecController
    with open(args.reference) as f:
        ref = json.load(f)
    k = args.k
    spec = {"method": "ngram", "num_speculative_tokens": k}
    llm = build(args, spec, args.model, True, max(args.batches))
    llm.generate(random_prompts(2, 16, 99), greedy(args, 8), use_tqdm=False)  # warm-up
    sched = llm.engine.core.scheduler
    runner = llm.engine.core.executor.runner
    key = min(32, args.prompt_len)
    conts: dict[tuple, list] = {}
    for b in args.batches:
        for p, cont in zip(random_prompts(b, args.prompt_len, seed=b), ref[str(b)]["tokens"]):
            conts.setdefault(tuple(p[:key]), []).append((len(p), cont))
    phases = [("verify", 0.0, False, [1])] + [("len", args.accept_len, True, args.batches)] + \
             [("len", args.low_accept_len, True, [1])]
    out = []
    for name, length, adaptive, batches in phases:
        a = 0.0 if name == "verify" else accept_rate(length, k)
        if args.no_force_accept:
            runner.proposer = OracleProposer(k, a, conts, key)
        else:  # the saved continuation as is; the verifier accepts each draft with probability a
            runner.proposer = OracleProposer(k, 1.0, conts, key)
            runner.verifier.force_accept = a
        for b in batches:
            sched.spec_control = SpecController(replace(sched.spec, adaptive=adaptive))  # fresh estimates
            d0, a0, n0 = sched.spec_num_draft_tokens, sched.spec_num_accepted_tokens, sched.spec_num_drafts
            prompts = [{"prompt_token_ids": p} for p in random_prompts(b, args.prompt_len, seed=b)]
            secs, tokens = timed(llm, prompts, greedy(args, args.max_tokens), args.repeats)
            drafts = sched.spec_num_drafts - n0
            measured = (sched.spec_num_accepted_tokens - a0) / drafts + 1 if drafts else float("nan")
            # forced acceptance (a > 0) emits drafts the target did not choose: no equality to expect
            forced = not args.no_force_accept and a > 0
            same = None if forced else sum(x == y for x, y in zip(tokens, ref[str(b)]["tokens"]))
            row = {"phase": name, "length": length, "a": a, "adaptive": adaptive, "batch": b, "seconds": secs,
                   "measured_len": measured, "draft_tokens": sched.spec_num_draft_tokens - d0,
                   "verifies": drafts, "equal": same, "forced": not args.no_force_accept}
            out.append(row)
            print(f"[oracle] {row}", flush=True)
    return {"rows": out}


def role_text(args) -> dict:
    spec = None
    if args.spec == "ngram":
        spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    llm = build(args, spec, None, False, 8)
    llm.generate(copy_prompts(2), greedy(args, 8), use_tqdm=False)  # warm-up
    prompts = copy_prompts(args.text_prompts)
    params = greedy(args, args.text_max_tokens, ignore_eos=False)
    best, tokens = float("inf"), None
    for _ in range(args.repeats):
        llm.engine.core.kv_manager.pool.reset_prefix_cache()
        t = time.perf_counter()
        tokens = [list(llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids) for p in prompts]  # batch 1
        best = min(best, time.perf_counter() - t)
    sched = llm.engine.core.scheduler
    n = sched.spec_num_drafts
    length = sched.spec_num_accepted_tokens / n + 1 if n else float("nan")
    print(f"[text {args.spec}] {sum(map(len, tokens)) / best:.1f} tok/s", flush=True)
    return {"seconds": best, "tokens": tokens, "measured_len": length}


# -- the orchestrator -----------------------------------------------------------------------------
def child(args, role: str, out: str, *extra: str) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--role", role, "--result", out] + args.passthrough + list(extra)
    t = time.perf_counter()
    subprocess.run(cmd, check=True)
    print(f"[{role}] process done in {time.perf_counter() - t:.0f} s", flush=True)
    with open(out) as f:
        return json.load(f)


def report(args, off: dict | None, oracle: dict | None, text_off: dict | None, text_on: dict | None) -> None:
    print(f"\n## speculative decoding, k = {args.k} ({'tiny CPU model' if args.tiny else args.model}, {args.dtype})")
    if off and oracle:
        tps = {b: int(b) * args.max_tokens / v["seconds"] for b, v in off.items()}
        print(f"{'measure':<44} {'off':>10} {'spec':>10} {'ratio':>7} {'meas. len':>9} {'equal':>7} {'drafts/v':>8}")
        for r in oracle["rows"]:
            b = r["batch"]
            equal = "n/a" if r["equal"] is None else f"{r['equal']}/{b}"
            per_verify = r["draft_tokens"] / r["verifies"] if r["verifies"] else float("nan")
            spec_tps = b * args.max_tokens / r["seconds"]
            if r["phase"] == "verify":
                plain, verify = off[str(b)]["seconds"] / args.max_tokens, r["seconds"] / args.max_tokens
                print(f"{'verify step (k+1 tokens/seq) / plain step, b=1':<44} {plain * 1e3:>8.2f}ms "
                      f"{verify * 1e3:>8.2f}ms {verify / plain:>7.3f} {r['measured_len']:>9.2f} {equal:>7} {per_verify:>8.2f}")
                continue
            label = f"tok/s, b={b}, acceptance length {r['length']:.1f} (a={r['a']:.2f})"
            print(f"{label:<44} {tps[str(b)]:>10.1f} {spec_tps:>10.1f} {spec_tps / tps[str(b)]:>7.3f} "
                  f"{r['measured_len']:>9.2f} {equal:>7} {per_verify:>8.2f}")
    if text_off and text_on:
        n_off, n_on = sum(map(len, text_off["tokens"])), sum(map(len, text_on["tokens"]))
        t_off, t_on = n_off / text_off["seconds"], n_on / text_on["seconds"]
        same = sum(x == y for x, y in zip(text_off["tokens"], text_on["tokens"]))
        label = "default model, ngram, copy prompts, b=1, tok/s"
        print(f"{label:<44} {t_off:>10.1f} {t_on:>10.1f} {t_on / t_off:>7.3f} {text_on['measured_len']:>9.2f} "
              f"{str(same) + '/' + str(len(text_off['tokens'])):>7}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="CPU scale: a 2-layer random model, small batches")
    ap.add_argument("--parts", default="oracle,text")
    ap.add_argument("--model", default="benchmarks/configs/llama3-8b", help="the oracle part's (random weights)")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 (float32 with --tiny)")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--batches", default=None, help="default 1,16,64,256 (1,4,8 with --tiny)")
    ap.add_argument("--prompt-len", type=int, default=None, help="default 128 (32 with --tiny)")
    ap.add_argument("--max-tokens", type=int, default=None, help="default 128 (24 with --tiny)")
    ap.add_argument("--accept-len", type=float, default=3.0)
    ap.add_argument("--low-accept-len", type=float, default=1.2)
    ap.add_argument("--no-force-accept", action="store_true",
                    help="oracle: let the target's greedy check decide (needs numerics that reproduce the saved text)")
    ap.add_argument("--text-prompts", type=int, default=None, help="default 4 (2 with --tiny)")
    ap.add_argument("--text-max-tokens", type=int, default=None, help="default 192 (32 with --tiny)")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--role", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--result", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--reference", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--spec", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    passthrough = [a for a in sys.argv[1:]]
    t = args.tiny
    args.dtype = args.dtype or ("float32" if t else "bfloat16")
    args.batches = [int(b) for b in (args.batches or ("1,4,8" if t else "1,16,64,256")).split(",")]
    args.prompt_len = args.prompt_len or (32 if t else 128)
    args.max_tokens = args.max_tokens or (24 if t else 128)
    args.text_prompts = args.text_prompts or (2 if t else 4)
    args.text_max_tokens = args.text_max_tokens or (32 if t else 192)
    if args.role:
        if args.tiny and args.role in ("off", "oracle"):
            args.model = os.path.join(os.path.dirname(args.result), "tiny-model")
        result = {"off": role_off, "oracle": role_oracle, "text": role_text}[args.role](args)
        with open(args.result, "w") as f:
            json.dump(result, f)
        return
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="spec-bench-") as tmp:
        if t:
            os.makedirs(os.path.join(tmp, "tiny-model"))
            with open(os.path.join(tmp, "tiny-model", "config.json"), "w") as f:
                json.dump(TINY_CONFIG, f)
        args.passthrough = passthrough
        off = oracle = text_off = text_on = None
        parts = args.parts.split(",")
        if "oracle" in parts:
            off = child(args, "off", os.path.join(tmp, "off.json"))
            oracle = child(args, "oracle", os.path.join(tmp, "oracle.json"), "--reference", os.path.join(tmp, "off.json"))
        if "text" in parts:
            text_off = child(args, "text", os.path.join(tmp, "text_off.json"), "--spec", "off")
            text_on = child(args, "text", os.path.join(tmp, "text_ngram.json"), "--spec", "ngram")
        report(args, off, oracle, text_off, text_on)
    print(f"\ntotal {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
