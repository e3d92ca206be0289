"""Image preprocessing throughput (images/s): the Hugging Face image processor (the reference; PIL and
numpy) vs the tensor path (multimodal/tensor_preprocess.py) on the GPU when there is one, else the CPU,
for LLaVA-1.5 (CLIP 336), Fuyu, Phi-3-vision (16 HD crops) and Pix2Struct/Deplot (its header rendered,
1024 patches), from the preprocessor configs in benchmarks/configs/.

Inputs: distinct 640x480 photo-like images, JPEG-encoded once and decoded before timing (decoding is
NOT included; --include-decode times PIL's decode of the JPEG bytes as part of each image's work).
Columns:
  hf        the HF processor, one image per call, on --workers threads (how the server's media pool
            runs it)
  call      the tensor path, one image per call on --workers threads, result copied to the host (the
            server's path: ProcessedImage tensors travel to the engine core in host memory)
  batch     the tensor path, --batch same-sized images per call, result left on the device (synced)
  batch+cpu the same with the result copied to the host

    python benchmarks/preprocess_bench.py                       # GPU machine: targets 2000/1000/1000/300
    python benchmarks/preprocess_bench.py --num-images 32 --hf-images 8 --models llava fuyu   # CPU check
"""
from __future__ import annotations

import argparse
import io
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402

CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")
DEPLOT_HEADER = "Generate underlying data table of the figure below:"
TARGETS = {"llava": 2000, "fuyu": 1000, "phi3v": 1000, "pix2struct": 300}


def make_jpegs(n: int, size: tuple[int, int], seed: int = 0) -> list[bytes]:
    from PIL import Image
    rng = np.random.default_rng(seed)
    w, h = size
    out = []
    for _ in range(n):
        small = Image.fromarray(rng.integers(0, 256, (h // 16, w // 16, 3), dtype=np.uint8))
        buf = io.BytesIO()
        small.resize((w, h), Image.BICUBIC).save(buf, "JPEG", quality=90)
        out.append(buf.getvalue())
    return out


def decode(data: bytes):
    from PIL import Image
    return Image.open(io.BytesIO(data)).convert("RGB")


def build(model: str, device: str):
    """(hf_call(img), tensor_call(img) -> host tensor, tensor processor, batch_fn(list) -> device results)."""
    from splitserve.multimodal.processor import load_image_processor
    from splitserve.multimodal.tensor_preprocess import tensor_processor_for
    if model == "phi3v":
        from splitserve.models.phi3v.processor import Phi3VImageProcessor
        hf = Phi3VImageProcessor.from_directory(os.path.join(CONFIGS, "phi-3-vision"), 336)
    else:
        folder = {"llava": "llava-1.5-7b", "fuyu": "fuyu-8b", "pix2struct": "pix2struct-deplot"}[model]
        hf = load_image_processor(os.path.join(CONFIGS, folder))
    fast = tensor_processor_for(hf, device)
    if fast is None:
        raise SystemExit(f"{model}: no tensor path for {type(hf).__name__}")
    if model == "pix2struct":
        from splitserve.models.pix2struct.processor import default_font_path, render_header
        font = default_font_path()

        def hf_call(img):
            return hf(images=[render_header(hf, img, DEPLOT_HEADER, font)], return_tensors="pt", is_vqa=False)

        def tensor_call(img):
            return fast.flattened(img, DEPLOT_HEADER, font).cpu()

        def batch_fn(imgs):
            return [fast.flattened(t, DEPLOT_HEADER, font) for t in fast.to_device(imgs)]
    else:
        def hf_call(img):
            return hf(images=[img], return_tensors="pt")

        def tensor_call(img):
            return fast(images=[img])

        def batch_fn(imgs):
            return fast.run_many(imgs)
    return hf_call, tensor_call, batch_fn


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def rate(fn, items: list, workers: int) -> float:
    """Images/s of fn over items on a pool of `workers` threads (one warm-up call first)."""
    fn(items[0])
    with ThreadPoolExecutor(workers) as pool:
        t0 = time.perf_counter()
        list(pool.map(fn, items))
        return len(items) / (time.perf_counter() - t0)


def batch_rate(batch_fn, items: list, batch: int, device: str, to_host: bool, prepare) -> float:
    def run(chunk):
        out = batch_fn([prepare(x) for x in chunk])
        if to_host:
            out = [o.cpu() for o in out]
        return out
    run(items[:batch])
    sync(device)
    t0 = time.perf_counter()
    for i in range(0, len(items), batch):
        run(items[i:i + batch])
    sync(device)
    return len(items) / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=list(TARGETS), choices=list(TARGETS))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--num-images", type=int, default=None, help="images per tensor-path run (GPU 2048, CPU 64)")
    p.add_argument("--hf-images", type=int, default=None, help="images per HF run (GPU 256, CPU 16)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1))
    p.add_argument("--size", type=int, nargs=2, default=(640, 480), metavar=("W", "H"))
    p.add_argument("--include-decode", action="store_true", help="time the JPEG decode as part of each image")
    args = p.parse_args()
    gpu = args.device.startswith("cuda")
    n = args.num_images or (2048 if gpu else 64)
    n_hf = args.hf_images or (256 if gpu else 16)
    jpegs = make_jpegs(min(n, 256), tuple(args.size))
    if args.include_decode:
        items, prepare = [jpegs[i % len(jpegs)] for i in range(n)], decode
    else:
        decoded = [decode(j) for j in jpegs]
        items, prepare = [decoded[i % len(decoded)] for i in range(n)], (lambda x: x)
    print(f"device {args.device} ({torch.cuda.get_device_name() if gpu else f'{os.cpu_count()} CPUs'}), "
          f"{args.workers} worker threads, {args.size[0]}x{args.size[1]} images, decoding "
          f"{'included' if args.include_decode else 'not included'}, torch {torch.__version__}")
    print(f"{'model':<11}{'hf':>9}{'call':>9}{'batch':>9}{'batch+cpu':>11}{'target':>8}  images/s")
    for model in args.models:
        hf_call, tensor_call, batch_fn = build(model, args.device)
        hf = rate(lambda x: hf_call(prepare(x)), items[:n_hf], args.workers)
        call = rate(lambda x: tensor_call(prepare(x)), items, args.workers)
        dev = batch_rate(batch_fn, items, args.batch, args.device, False, prepare)
        host = batch_rate(batch_fn, items, args.batch, args.device, True, prepare)
        print(f"{model:<11}{hf:>9.0f}{call:>9.0f}{dev:>9.0f}{host:>11.0f}{TARGETS[model]:>8}", flush=True)


if __name__ == "__main__":
    main()
