"""Tensor-op preprocessing (multimodal/tensor_preprocess.py) vs the Hugging Face PIL processors it
replaces, on CPU. The stated tolerance:

- a resize: PIL rounds to 8 bits in fixed point after each pass, torch in float; a pixel may differ by
  up to 2 levels of 255 (seen: 1 for shrinking, 2 for upscaling), i.e. 2 / 255 / std after normalising
  (CLIP std 0.26: 0.030). Where the tensor path guesses PIL's order of passes right (most shapes,
  640x480 either way up to CLIP's 336 among them), at most 0.1% of values differ (5% for
  Phi-3-vision's 2.1x bilinear upscale, whose global view, resampled again, reaches 3 levels); where it guesses wrong (BLIP's 480x640 -> 224x224 here), up
  to 30%, by one level;
- no resize, or a resize in float on both sides (Fuyu below its canvas, Pix2Struct's patch
  resize): equal to float32 rounding (1e-5);
- Pix2Struct's header (text drawn by PIL, then both parts resized bicubic): 0.03 after its per-image
  normalisation (seen: 0.012).
Shapes, image sizes and token-deciding numbers (Fuyu's unpadded size, Phi-3's HD size) are exact.
"""
from __future__ import annotations

import io

import numpy as np
import pytest
import torch
import transformers
from PIL import Image

from splitserve.multimodal.tensor_preprocess import (ClipStyleTensorProcessor, resolve_preprocess_device,
                                                     tensor_processor_for)

CLIP_MEAN, CLIP_STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
# (width, height): landscape, portrait, odd, square-and-large
SIZES = [(640, 480), (480, 640), (333, 517), (1000, 1000)]


def photo(seed: int, size: tuple[int, int]) -> Image.Image:
    """A JPEG-decoded image with photo-like smooth content (what clients send)."""
    rng = np.random.default_rng(seed)
    w, h = size
    small = Image.fromarray(rng.integers(0, 256, (max(h // 8, 1), max(w // 8, 1), 3), dtype=np.uint8))
    buf = io.BytesIO()
    small.resize((w, h), Image.BICUBIC).save(buf, "JPEG", quality=90)
    return Image.open(io.BytesIO(buf.getvalue())).convert("RGB")


def noise(seed: int, size: tuple[int, int]) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


IMAGES = [photo(i, s) for i, s in enumerate(SIZES)] + [noise(9, (97, 61))]


def assert_resize_close(ref: torch.Tensor, got: torch.Tensor, std: float, levels: int = 2, share: float = 0.35):
    assert got.shape == ref.shape and got.dtype == torch.float32
    diff = (ref - got).abs()
    assert diff.max().item() <= levels / 255 / std + 1e-5
    assert (diff > 1e-4).float().mean().item() <= share


def pil(name: str, **kwargs):
    return getattr(transformers, f"{name}Pil")(**kwargs)


@pytest.mark.parametrize("name,kwargs,std", [
    ("CLIPImageProcessor", dict(size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336}), min(CLIP_STD)),
    ("SiglipImageProcessor", dict(size={"height": 384, "width": 384}), 0.5),
    ("BlipImageProcessor", dict(size={"height": 224, "width": 224}), min(CLIP_STD)),
])
def test_clip_style_pixels_match_hf(name, kwargs, std):
    hf = pil(name, **kwargs)
    fast = tensor_processor_for(hf, "cpu")
    assert isinstance(fast, ClipStyleTensorProcessor)
    for img in IMAGES:
        ref = hf(images=[img], return_tensors="pt")["pixel_values"]
        assert_resize_close(ref, fast(images=[img])["pixel_values"], std)
    if name == "CLIPImageProcessor":  # LLaVA-1.5's case, both orientations: PIL's order guessed right
        for img in IMAGES[:2]:
            ref = hf(images=[img], return_tensors="pt")["pixel_values"]
            assert_resize_close(ref, fast(images=[img])["pixel_values"], std, levels=1, share=0.002)


def test_same_sized_images_run_as_one_batch_with_the_same_result():
    hf = pil("CLIPImageProcessor", size={"shortest_edge": 224}, crop_size={"height": 224, "width": 224})
    fast = tensor_processor_for(hf, "cpu")
    imgs = [photo(i, (640, 480)) for i in range(3)] + [photo(7, (480, 640))]
    batched = fast.run_many(imgs)
    for img, got in zip(imgs, batched):
        assert torch.equal(got, fast(images=[img])["pixel_values"][0])


def test_fuyu_canvas_and_unpadded_size_match_hf():
    hf = pil("FuyuImageProcessor")
    fast = tensor_processor_for(hf, "cpu")
    for img in IMAGES + [photo(5, (2000, 1200))]:  # the last one is shrunk to the 1080x1920 canvas
        ref, got = hf(images=[img]), fast(images=[img])
        assert got["image_unpadded_heights"] == ref["image_unpadded_heights"]
        assert got["image_unpadded_widths"] == ref["image_unpadded_widths"]
        canvas = torch.as_tensor(np.asarray(ref["images"][0][0]))
        cut = got["images"][0][0]
        h, w = cut.shape[-2:]
        assert h % 30 == 0 and w % 30 == 0  # whole patches, padded as HF pads (value 1 before normalising)
        if max(img.size) <= 1080:
            assert (canvas[:, :h, :w] - cut).abs().max().item() <= 1e-5
        else:
            assert_resize_close(canvas[:, :h, :w], cut, 0.5)


def test_phi3v_crops_match_its_reference_processor():
    from splitserve.models.phi3v.processor import Phi3VImageProcessor
    ref = Phi3VImageProcessor(16, 336)
    fast = tensor_processor_for(ref, "cpu")
    for img in IMAGES:
        a, b = ref(images=[img]), fast(images=[img])
        assert b["image_sizes"].tolist() == a["image_sizes"].tolist()
        # The global view resamples the HD image again (bicubic, in float): its taps add up a little
        # more than one level (seen 0.034 = 2.3 levels).
        assert_resize_close(a["pixel_values"], b["pixel_values"], min(CLIP_STD), levels=3, share=0.08)


def test_pix2struct_patches_match_hf():
    hf = pil("Pix2StructImageProcessor", max_patches=2048)
    fast = tensor_processor_for(hf, "cpu")
    for img in IMAGES:
        ref = hf(images=[img], return_tensors="pt")
        n = int(ref["attention_mask"][0].sum())
        got = fast(images=[img])["flattened_patches"][0]
        assert got.shape == (n, 2 + 16 * 16 * 3)
        assert (ref["flattened_patches"][0, :n] - got).abs().max().item() <= 1e-5


def test_pix2struct_header_matches_hf_render_header():
    from splitserve.models.pix2struct.processor import default_font_path, render_header
    font = default_font_path()
    if font is None:
        pytest.skip("no TrueType font on this machine")
    hf = pil("Pix2StructImageProcessor", max_patches=1024, is_vqa=True)
    fast = tensor_processor_for(hf, "cpu")
    header = "Generate underlying data table of the figure below:"
    for img in IMAGES:
        ref = hf(images=[render_header(hf, img, header, font)], return_tensors="pt", is_vqa=False)
        n = int(ref["attention_mask"][0].sum())
        got = fast.flattened(img, header, font)
        assert got.shape[0] == n
        assert (ref["flattened_patches"][0, :n] - got).abs().max().item() <= 0.03


def test_unknown_or_unsupported_processors_keep_hf():
    next_proc = pil("LlavaNextImageProcessor")  # any-resolution tiling: no tensor path (yet)
    assert tensor_processor_for(next_proc, "cpu") is None
    lanczos = pil("CLIPImageProcessor", resample=Image.Resampling.LANCZOS)
    assert tensor_processor_for(lanczos, "cpu") is None


def test_preprocess_setting():
    assert resolve_preprocess_device("auto", "cpu") is None  # the HF reference on CPU engines
    assert resolve_preprocess_device("auto", "cuda") == "cuda"
    assert resolve_preprocess_device("hf", "cuda") is None
    assert resolve_preprocess_device("cpu", "cuda") == "cpu"
    with pytest.raises(ValueError, match="mm_preprocess"):
        resolve_preprocess_device("gpu", "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs a GPU"):
            resolve_preprocess_device("cuda", "cpu")
