"""Launch choices of the LoRA shrink/expand kernels at Llama-3-8B shapes (rank 16, 16 slots), on the GPU.

For each step size (32, 256 tokens) and layout (one adapter for every token, 16 adapters), times
each op of one 8B step -- 32 layers x qkv / o / gate_up / down, distinct weights per layer so they
stream from memory as in the model -- as one CUDA graph, for several launch variants of the shrink
(split_k, block_k, warps) and of the expand (block_n, column blocks per program, warps). Every
variant's result is checked against the torch reference (kernels/lora/lora_add.lora_add_ref) first. Prints the
best variant per (step size, layout, kernel) and the whole delta with the default and the best.

    python benchmarks/lora_kernel_sweep.py
"""
from __future__ import annotations

import itertools
import math
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from splitserve.kernels.lora import shrink_expand as kernels  # noqa: E402
from splitserve.kernels.lora.lora_add import TILE, LoRALayout, fill_layout, lora_add_ref, max_tiles  # noqa: E402

H, KV, INTER, R, S, LAYERS = 4096, 1024, 14336, 16, 16, 32
SHAPES = {"qkv": (H, [H, KV, KV]), "o": (H, [H]), "gate_up": (H, [INTER, INTER]), "down": (INTER, [H])}
SHRINK = [dict(split_k=sk, block_k=bk, num_warps=w) for sk, bk, w in
          itertools.product([8, 16], [256], [4])]
EXPAND = [dict(block_n=bn, n_iters=1, num_warps=w, dot=dot) for bn, w, dot in
          itertools.product([128, 256, 512], [4, 8], ["tf32", "low"])]


def graph_time(fn, reps: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(3):
        g.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        g.replay()
    end.record()
    end.synchronize()
    del g
    return start.elapsed_time(end) / reps


def main() -> None:
    dev = torch.device("cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights = {name: [((torch.randn(S, len(sh) * R, K, generator=gen, device=dev) / math.sqrt(K)).bfloat16(),
                       (torch.randn(S, sum(sh), R, generator=gen, device=dev) * 0.05).bfloat16())
                      for _ in range(LAYERS)] for name, (K, sh) in SHAPES.items()}
    best_rows, total_rows = [], []
    for T, case in [(32, "one adapter"), (32, "16 adapters"), (256, "one adapter"), (256, "16 adapters"),
                    (2048, "one adapter")]:
        layout, host = LoRALayout(T, S, dev), LoRALayout(T, S, "cpu")
        slots = np.zeros(T, dtype=np.int64) if case == "one adapter" else np.arange(T) % S
        fill_layout(host, slots)
        layout.buffer.copy_(host.buffer)
        grid_tiles = max_tiles(T, S)
        args = (layout.num_tiles, layout.tile_slots, layout.token_rows, grid_tiles)
        xs = {name: torch.randn(T, K, generator=gen, device=dev).bfloat16() for name, (K, _) in SHAPES.items()}
        bases = {name: torch.randn(T, sum(sh), generator=gen, device=dev).bfloat16() for name, (_, sh) in SHAPES.items()}
        outs = {name: base.clone() for name, base in bases.items()}  # the timed graphs add into these
        refs = {}
        for name, (K, sh) in SHAPES.items():
            ref = bases[name].clone()
            a, b = weights[name][0]
            lora_add_ref(ref, xs[name], a, b, sh, R, layout.token_slots.cpu())
            refs[name] = ref

        def check(name, shrink_kw, expand_kw) -> bool:
            K, sh = SHAPES[name]
            a, b = weights[name][0]
            out = bases[name].clone()
            part = kernels.lora_shrink(xs[name], a, *args, TILE, **shrink_kw)
            kernels.lora_expand_(out, part, b, *args, sh, R, TILE, **expand_kw)
            err = (out.float() - refs[name].float()).abs().max().item()
            return err <= 0.02 * refs[name].float().abs().max().item()

        def whole(shrink_kw, expand_kw, which=("shrink", "expand")):
            parts = {name: kernels.lora_shrink(xs[name], weights[name][0][0], *args, TILE, **shrink_kw)
                     for name in SHAPES}

            def step():
                for name, (K, sh) in SHAPES.items():
                    for a, b in weights[name]:
                        part = (kernels.lora_shrink(xs[name], a, *args, TILE, **shrink_kw)
                                if "shrink" in which else parts[name])
                        if "expand" in which:
                            kernels.lora_expand_(outs[name], part, b, *args, sh, R, TILE, **expand_kw)
            return graph_time(step)

        default_total = whole({}, {})
        results = {}
        for kind, variants in (("shrink", SHRINK), ("expand", EXPAND)):
            for kw in variants:
                try:
                    ok = all(check(n, kw if kind == "shrink" else {}, kw if kind == "expand" else {}) for n in SHAPES)
                    t = whole(kw if kind == "shrink" else {}, kw if kind == "expand" else {}, (kind,))
                except Exception as e:  # a variant Triton cannot compile (resources): skip it
                    print(f"{T} {case} {kind} {kw}: {type(e).__name__}", flush=True)
                    continue
                results.setdefault(kind, []).append((t, kw, ok))
                print(f"{T:>4} {case:<12} {kind:<6} {t:7.3f} ms {'ok ' if ok else 'BAD'} {kw}", flush=True)
        default_shrink = whole({}, {}, ("shrink",))
        default_expand = whole({}, {}, ("expand",))
        best = {}
        for kind in ("shrink", "expand"):
            good = sorted((r for r in results[kind] if r[2]), key=lambda r: r[0]) or [(float("nan"), {}, False)]
            best[kind] = good[0]
            dflt = default_shrink if kind == "shrink" else default_expand
            best_rows.append(f"{T:>4} | {case:<12} | {kind:<6} | default {dflt:.3f} ms | best {good[0][0]:.3f} ms {good[0][1]}")
        best_total = whole(best["shrink"][1], best["expand"][1])
        total_rows.append(f"{T:>4} | {case:<12} | whole delta: default {default_total:.3f} ms, "
                          f"best pair {best_total:.3f} ms")
    print(f"\nLoRA kernel sweep on {torch.cuda.get_device_name()} ({LAYERS} layers x 4 ops, rank {R}, {S} slots, TILE {TILE})")
    for row in best_rows + total_rows:
        print(row)


if __name__ == "__main__":
    main()
