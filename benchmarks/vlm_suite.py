"""`python benchmarks/vlm_bench.py --suite`: issue 41's decoder-only VLMs, each a vlm_bench.py run in its
own process (fresh device memory; one model's failure does not stop the others), then one table: each
VLM's output tok/s against the same engine on text-only prompts of the same token lengths (target
>= 0.92), and image-free CogVLM requests against its language model alone, a plain Llama (>= 0.98).

    python benchmarks/vlm_bench.py --suite                      # GPU, random weights, ~6 minutes on an H200
    python benchmarks/vlm_bench.py --suite --tiny --device cpu --num-prompts 4 --output-len 4 --ttft-runs 1

Other vlm_bench.py options given pass through to every run; --suite-models picks a subset by config name.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
# (label, config directory under benchmarks/configs)
SUITE = [("LLaVA-1.5-7B", "llava-1.5-7b"), ("LLaVA-NeXT-7B", "llava-next-7b"), ("VILA1.5-7B", "vila1.5-7b"),
         ("Fuyu-8B", "fuyu-8b"), ("Kosmos-2", "kosmos-2"), ("Phi-3-vision", "phi-3-vision"),
         ("CogVLM-17B", "cogvlm-17b"), ("BLIP-2 OPT-2.7B", "blip2-opt-2.7b"), ("NeVA (Nemotron-8B shape)", "neva-8b")]
# Shorter than a single model's run, so that the whole suite takes minutes; given options win.
DEFAULTS = {"--num-prompts": "128", "--ttft-runs": "3", "--ttft-warmup": "1"}
TIMEOUT_S = int(os.environ.get("VLM_SUITE_TIMEOUT_S", "240"))  # per run


def child_argv(argv: list[str]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in ("--suite", "--model", "--json-out", "--suite-models"):
            skip = a != "--suite"
        elif not a.startswith(("--model=", "--json-out=", "--suite-models=")):
            out.append(a)
    for flag, value in DEFAULTS.items():
        if not any(a == flag or a.startswith(flag + "=") for a in argv):
            out += [flag, value]
    return out


def run_one(args: list[str], log: str) -> tuple[dict | None, float, str]:
    """One vlm_bench.py process; (its JSON figures or None, wall seconds, why it failed)."""
    out = log + ".json"
    start = time.perf_counter()
    with open(log, "w") as f:
        try:
            rc = subprocess.run([sys.executable, os.path.join(HERE, "vlm_bench.py"), *args, "--json-out", out],
                                stdout=f, stderr=subprocess.STDOUT, timeout=TIMEOUT_S).returncode
        except subprocess.TimeoutExpired:  # subprocess.run has killed it
            return None, time.perf_counter() - start, f"timed out after {TIMEOUT_S} s"
    wall = time.perf_counter() - start
    if rc != 0 or not os.path.exists(out):
        with open(log) as f:
            tail = f.read().strip().splitlines()[-1:] or ["no output"]
        return None, wall, f"exit {rc}: {tail[0][:120]}"
    with open(out) as f:
        return json.load(f), wall, ""


def run_suite(parsed, argv: list[str]) -> int:
    picked = set(parsed.suite_models.split(",")) if parsed.suite_models else None
    common = child_argv(argv)
    rows, notes, total = [], [], time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for label, name in SUITE:
            if picked is not None and name not in picked:
                continue
            cfg = os.path.join(HERE, "configs", name)
            res, wall, why = run_one(["--model", cfg, *common], os.path.join(tmp, name))
            print(f"  {label}: {why or 'done'} ({wall:.0f} s)", flush=True)
            if res is None:
                rows.append((label, "—", "—", "—", "—", "—", "—", f"{wall:.0f}"))
                notes.append(f"{label}: {why} (log lines above are not kept; rerun it alone)")
                continue
            vlm, text = res["vlm"], res["text"]
            ratio = f"{vlm['output_tok_s'] / text['output_tok_s']:.3f}" if text else "—"
            rows.append((label, f"{vlm['mean_prompt_tokens']:.0f}", f"{vlm['images_encoded'] / vlm['elapsed_s']:.1f}",
                         f"{vlm['output_tok_s']:.0f}", f"{text['output_tok_s']:.0f}" if text else "—", ratio,
                         f"{res['ttft_ms']:.1f}", f"{wall:.0f}"))
            if name == "cogvlm-17b" and text:
                alone, wall2, why2 = run_one(["--model", cfg, *common, "--text-model", "--lengths-from",
                                              os.path.join(tmp, name) + ".json"], os.path.join(tmp, name + "-llama"))
                if alone is None:
                    notes.append(f"CogVLM's language model alone: {why2}")
                else:
                    rows.append(("  CogVLM image-free / Llama alone", f"{vlm['mean_prompt_tokens']:.0f}", "—",
                                 f"{text['output_tok_s']:.0f}", f"{alone['text']['output_tok_s']:.0f}",
                                 f"{text['output_tok_s'] / alone['text']['output_tok_s']:.3f}", "—", f"{wall2:.0f}"))
    head = ("model", "prompt tok", "images/s", "VLM tok/s", "text tok/s", "ratio", "TTFT ms", "wall s")
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    print(f"\nissue 41 VLM suite ({' '.join(common)}): output tok/s, VLM vs the same engine on text-only prompts "
          f"of equal lengths (target >= 0.92; CogVLM image-free vs Llama alone >= 0.98); {time.perf_counter() - total:.0f} s")
    for r in [head, *rows]:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)))
    for n in notes:
        print("note:", n)
    return 0 if not notes else 1
