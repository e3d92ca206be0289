"""How fast a VLM's image side runs alone: `model.encode_images` on batches of one generated image
(its model FLOPs counted by torch's FlopCounterMode), eagerly and with every module of the image
side compiled (`--compile`), and the kernels that take its time (`--profile`). Random weights from a
config directory, as vlm_bench.py builds them.

    python benchmarks/tower_bench.py --model benchmarks/configs/blip2-opt-2.7b --batches 1,16,64 --compile
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.vlm_bench import write_tiny_config  # noqa: E402


def one_image_item(llm, size: tuple[int, int]):
    """The processor's ImageItem for one random image (pixels as the model's processor makes them)."""
    import numpy as np
    from PIL import Image

    from splitserve.multimodal.processor import offline_prompt
    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))
    marker = llm.engine.mm_processor.placeholder_id
    prompt = offline_prompt(llm.engine, {"prompt_token_ids": [1, marker, 1000, 1001], "multi_modal_data": {"image": image}})
    return prompt["mm_items"][0] if isinstance(prompt, dict) else prompt.mm_items[0]


def image_side_modules(model) -> list:
    """The top-level submodules that encode_images uses: everything but the decoder and its head."""
    skip = {"model", "language_model", "lm_head", "decoder", "layers", "embed_tokens", "norm"}
    return [(name, mod) for name, mod in model.named_children() if name not in skip]


def sync() -> None:
    import torch
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_encode(model, items, repeats: int) -> float:
    model.encode_images(items)
    sync()
    start = time.perf_counter()
    for _ in range(repeats):
        model.encode_images(items)
    sync()
    return (time.perf_counter() - start) / repeats


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--image-size", default="336x336")
    p.add_argument("--compile", action="store_true", help="also time with the image side's modules compiled")
    p.add_argument("--profile", type=int, default=0, help="print the top kernels of one batch of this size")
    args = p.parse_args(argv)

    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from splitserve.engine.llm import LLM
    tmp = tempfile.TemporaryDirectory() if args.tiny else None
    model_dir = write_tiny_config(args.model, tmp.name) if tmp else args.model
    llm = LLM(model_dir, random_weights=True, enforce_eager=True, max_num_seqs=8, num_blocks=64)
    model = llm.engine.runner.model
    w, h = (int(x) for x in args.image_size.split("x"))
    item = one_image_item(llm, (w, h))
    batches = [int(b) for b in args.batches.split(",")]
    with torch.inference_mode():
        with FlopCounterMode(display=False) as counter:
            model.encode_images([item])
        flops = counter.get_total_flops()
        rows = []
        for b in batches:
            rows.append(("eager", b, time_encode(model, [item] * b, args.repeats)))
        if args.profile:
            from torch.profiler import ProfilerActivity, profile
            model.encode_images([item] * args.profile)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                model.encode_images([item] * args.profile)
                sync()
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15))
        if args.compile:
            for _, mod in image_side_modules(model):  # in place: containers keep their indexing
                for part in (mod.values() if isinstance(mod, torch.nn.ModuleDict) else
                             mod if isinstance(mod, torch.nn.ModuleList) else [mod]):
                    part.compile(dynamic=True)
            for b in batches:
                rows.append(("compiled", b, time_encode(model, [item] * b, args.repeats)))
    print(f"\nimage side of {os.path.basename(os.path.normpath(args.model))}: {flops / 1e12:.3f} TFLOP per image "
          f"({item.num_tokens} features), {torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'}")
    print("| variant | images per batch | ms per batch | ms per image | TFLOP/s |")
    print("|---|---|---|---|---|")
    for variant, b, s in rows:
        print(f"| {variant} | {b} | {s * 1e3:.2f} | {s * 1e3 / b:.3f} | {flops * b / s / 1e12:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
