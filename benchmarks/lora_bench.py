"""Multi-LoRA throughput on the Llama-3-8B shape (random bf16 weights), offline 1000 x 128 in / 128 out.

    python benchmarks/lora_bench.py [--configs disabled,unused,one,many] [--n 1000] [--repeats 2]
                                    [--adapters-dir DIR] [--cfg-only]

Configs (issue "Multi-LoRA"): LoRA disabled; enabled (16 slots, rank 16) but no request uses an
adapter (target >= 0.97x of disabled); every request uses one adapter (>= 0.85x); requests spread round
robin over 32 adapters with 16 slots (>= 0.75x). Adapters are random PEFT-format directories (rank 16,
alpha 32, on all seven projections of every layer), written once under --adapters-dir (84 MB each in
bf16). Each config is a fresh engine in a process of its own (its build time, which with LoRA
includes capturing the decode graphs with and without the delta, is in the table): one warm-up
generate (first kernel launches, adapters into host memory and slots), then `--repeats` timed runs
with fresh prompt seeds (no prefix-cache hits); the table also counts the adapters put into slots
during the timed runs (evictions). Prints a table last.
--cfg-only writes the adapters and checks one against the base model's shapes, without a GPU.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from splitserve import LLM, LoRARequest, SamplingParams  # noqa: E402

CONFIG_8B = os.path.join(os.path.dirname(__file__), "configs", "llama3-8b")
RANK = 16
PROJ = {"q": ("self_attn", "in", "q_out"), "k": ("self_attn", "in", "kv_out"), "v": ("self_attn", "in", "kv_out"),
        "o": ("self_attn", "q_out", "in"), "gate": ("mlp", "in", "inter"), "up": ("mlp", "in", "inter"),
        "down": ("mlp", "inter", "in")}


def write_adapter(path: str, seed: int) -> str:
    """A random rank-16 PEFT adapter for the 8B shape (A ~ N(0, 1/in), B ~ N(0, 0.02)): enough to move
    the logits, as a trained adapter would."""
    if os.path.exists(os.path.join(path, "adapter_model.safetensors")):
        return path
    from safetensors.torch import save_file
    cfg = json.load(open(os.path.join(CONFIG_8B, "config.json")))
    H, I = cfg["hidden_size"], cfg["intermediate_size"]
    hd = H // cfg["num_attention_heads"]
    dims = {"in": H, "q_out": cfg["num_attention_heads"] * hd, "kv_out": cfg["num_key_value_heads"] * hd, "inter": I}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for proj, (parent, din, dout) in PROJ.items():
            name = f"base_model.model.model.layers.{layer}.{parent}.{proj}_proj"
            tensors[f"{name}.lora_A.weight"] = (torch.randn(RANK, dims[din], generator=gen) / dims[din] ** 0.5).bfloat16()
            tensors[f"{name}.lora_B.weight"] = (torch.randn(dims[dout], RANK, generator=gen) * 0.02).bfloat16()
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": RANK, "lora_alpha": 2 * RANK, "target_modules": [f"{p}_proj" for p in PROJ],
                   "bias": "none", "base_model_name_or_path": "llama3-8b-random"}, f)
    return path


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000, vocab - 1000) for _ in range(length)] for _ in range(n)]


def run_config(name: str, adapters: list[str], n: int, repeats: int, inp: int, out: int, max_num_seqs: int) -> dict:
    lora_kwargs = {} if name == "disabled" else dict(enable_lora=True, max_loras=16, max_lora_rank=RANK,
                                                       max_cpu_loras=32)
    t0 = time.perf_counter()
    llm = LLM(CONFIG_8B, random_weights=True, dtype="bfloat16", max_model_len=4096, max_num_seqs=max_num_seqs,
              **lora_kwargs)
    build_s = time.perf_counter() - t0
    manager = llm.engine.core.lora
    vocab = llm.engine.config.model.vocab_size
    loras = [LoRARequest(f"adapter{i}", i + 1, p) for i, p in enumerate(adapters)]

    def requests(k):
        if name in ("disabled", "unused"):
            return None
        if name == "one":
            return loras[0]
        return [loras[i % 32] for i in range(k)]

    params = SamplingParams(max_tokens=out, temperature=0, ignore_eos=True)
    llm.generate(prompts(64, inp, vocab, 1), SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False,
                 lora_request=requests(64))  # warm-up: compiles, loads the adapters into slots
    loads_before = manager.num_slot_loads if manager is not None else 0
    times = []
    for r in range(repeats):
        ps = prompts(n, inp, vocab, 1000 + r)
        torch.cuda.synchronize()
        t = time.perf_counter()
        res = llm.generate(ps, params, use_tqdm=False, lora_request=requests(n))
        times.append(time.perf_counter() - t)
        assert all(len(o.outputs[0].token_ids) == out for o in res)
    loads = (manager.num_slot_loads - loads_before) if manager is not None else 0
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return {"times": times, "build_s": build_s, "slot_loads": loads}


def main() -> None:
    import logging
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="disabled,unused,one,many")
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--adapters-dir", default="/tmp/splitserve-lora-bench")
    ap.add_argument("--cfg-only", action="store_true")
    ap.add_argument("--child", action="store_true", help="internal: run one configuration, print its times")
    a = ap.parse_args()
    configs = a.configs.split(",")
    num_adapters = 32 if "many" in configs else 1
    adapters = [write_adapter(os.path.join(a.adapters_dir, f"a{i}"), i) for i in range(num_adapters)]
    if a.cfg_only:
        from splitserve.lora.adapter import LoRATargets, load_adapter
        from splitserve.models.loader import load_hf_config
        from splitserve.loading.resolve import resolve_model
        targets = LoRATargets.from_hf_config(load_hf_config(resolve_model(CONFIG_8B)))
        adapter = load_adapter(1, "a0", adapters[0], targets, RANK, torch.bfloat16)
        print(f"adapter ok: rank {adapter.rank}, {len(adapter.weights)} modules, {adapter.nbytes() / 2**20:.0f} MiB")
        return
    if len(configs) == 1 and a.child:
        result = run_config(configs[0], adapters, a.n, a.repeats, a.input_len, a.output_len, a.max_num_seqs)
        print("LORA_BENCH_TIMES " + json.dumps(result))
        return
    # Each configuration in a process of its own: an engine does not give its GPU memory back
    # (KV cache, compiled graphs) when it goes out of scope, so a second one in the same process OOMs.
    results = {}
    for name in configs:
        cmd = [sys.executable, os.path.abspath(__file__), "--child", "--configs", name, "--n", str(a.n),
               "--input-len", str(a.input_len), "--output-len", str(a.output_len), "--repeats", str(a.repeats),
               "--max-num-seqs", str(a.max_num_seqs), "--adapters-dir", a.adapters_dir]
        out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout
        results[name] = json.loads(out.rsplit("LORA_BENCH_TIMES ", 1)[1].splitlines()[0])
    total = a.n * a.output_len
    base = statistics.median(results["disabled"]["times"]) if "disabled" in results else None
    targets = {"unused": 0.97, "one": 0.85, "many": 0.75}
    print(f"\nLoRA throughput, Llama-3-8B shape (random bf16), {a.n} x {a.input_len} in / {a.output_len} out, "
          f"rank {RANK} on q,k,v,o,gate,up,down; {torch.cuda.get_device_name()}")
    print(f"{'config':<12} {'output tok/s':>14} {'vs disabled':>12} {'target':>8} {'build s':>8} "
          f"{'slot loads':>10}  runs (s)")
    for name, r in results.items():
        times = r["times"]
        m = statistics.median(times)
        ratio = f"{base / m:.3f}x" if base else "-"
        print(f"{name:<12} {total / m:>14,.0f} {ratio:>12} {targets.get(name, '-'):>8} {r['build_s']:>8.1f} "
              f"{r['slot_loads']:>10}  {', '.join(f'{t:.2f}' for t in times)}")


if __name__ == "__main__":
    main()
