"""Image preprocessing as tensor ops on a device (the GPU where the model runs on one): resize,
centre crop, pad, rescale, normalise and patchify, for the image processors whose steps are known.

The Hugging Face (PIL/numpy) image processor stays the reference; these classes read its settings and
answer its call (`proc(images=[img], return_tensors="pt")` -> the same keys, CPU tensors) so the
front's model hooks run unchanged. Differences from the reference, measured in
tests/multimodal/test_tensor_preprocess.py: PIL resamples in 8-bit fixed point, torch in float
(both with the same antialiased bilinear/bicubic kernels, a = -0.5), so a resized pixel may differ by
one or two levels of 255 after rounding; anything that is not a resize is exact to float32 rounding.

Torch ops, not torchvision: torchvision's v2 `resize` on tensors is this same `interpolate(...,
antialias=True)`, and the CPU build of torchvision does not load against every torch build.
`tensor_processor_for` answers None for a processor it does not know (the caller keeps HF's).
"""
from __future__ import annotations

import logging
import math
from functools import lru_cache

import numpy as np
import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

# PIL's resampling filter numbers (PIL.Image.Resampling) -> interpolate's antialiased mode.
_PIL_MODES = {2: "bilinear", 3: "bicubic"}
PREPROCESS_CHOICES = ("auto", "hf", "cpu", "cuda")


def resolve_preprocess_device(setting: str | None, engine_device: str) -> str | None:
    """The device the tensor path runs on, None for the HF processor. auto: the GPU when the engine
    runs on one (the fast path), else HF's (the reference, exact on CPU)."""
    setting = setting or "auto"
    if setting == "auto":
        return engine_device if engine_device.startswith("cuda") else None
    if setting == "hf":
        return None
    if setting == "cpu" or setting.startswith("cuda"):
        if setting.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"mm_preprocess {setting!r} needs a GPU, and torch sees none")
        return setting
    raise ValueError(f"mm_preprocess must be one of {', '.join(PREPROCESS_CHOICES)} (or cuda:N), got {setting!r}")


# -- the ops -----------------------------------------------------------------------------------------
def to_uint8_chw(img, device=None) -> torch.Tensor:
    """A PIL image, an HWC uint8 array or a CHW/HWC uint8 tensor -> [3, H, W] uint8 (on `device`;
    None: where it is). The 8-bit image is what crosses to the GPU (a quarter of float's bytes)."""
    if isinstance(img, torch.Tensor):
        t = img if img.shape[0] in (1, 3) else img.permute(2, 0, 1)
    else:
        if not isinstance(img, np.ndarray):
            img = np.asarray(img if img.mode == "RGB" else img.convert("RGB"))
        if img.ndim == 2:
            img = img[:, :, None]
        t = torch.from_numpy(np.array(img, copy=not img.flags.writeable, order="C")).permute(2, 0, 1)
    if t.dtype != torch.uint8:
        raise ValueError(f"expected 8-bit pixels, got {t.dtype}")
    if t.shape[0] == 1:
        t = t.expand(3, -1, -1)
    return t if device is None else t.to(device, non_blocking=True)


def resize_like_pil(x: torch.Tensor, size: tuple[int, int], resample: int) -> torch.Tensor:
    """[..., C, H, W] (8-bit values, any dtype) -> float32 [..., C, h, w] of whole values 0..255, as
    PIL resizes an 8-bit image: antialiased filter, rounded back to 8 bits. The same size is a copy
    (PIL does not resample then)."""
    mode = _PIL_MODES.get(int(resample))
    if mode is None:
        raise ValueError(f"PIL resampling filter {resample} has no tensor equivalent here")
    x = x.float()
    if tuple(x.shape[-2:]) == tuple(size):
        return x
    lead = x.shape[:-3]
    y = x.reshape(-1, *x.shape[-3:])
    # PIL resamples in two passes, each rounded to 8 bits (half up), in an order this does not know
    # exactly: measured on Pillow 13, it is along columns first mostly when that axis' filter window
    # is the wider one (right for 93% of random shapes; 640x480 and 480x640 to CLIP's 336 are
    # exact). A wrong order moves up to ~30% of values by one level of 255.
    h, w = y.shape[-2:]
    support = 1.0 if mode == "bilinear" else 2.0
    rows_first = _window(w, size[1], support) >= _window(h, size[0], support)
    for axis in ("w", "h") if rows_first else ("h", "w"):
        target = (y.shape[-2], size[1]) if axis == "w" else (size[0], y.shape[-1])
        if target != tuple(y.shape[-2:]):
            y = F.interpolate(y, size=target, mode=mode, antialias=True, align_corners=False)
            y = y.add_(0.5).floor_().clamp_(0, 255)
    return y.reshape(*lead, *y.shape[-3:])


def _window(size_in: int, size_out: int, support: float) -> int:
    """Taps of PIL's filter along one axis: a shrink widens it by the scale."""
    return int(math.ceil(support * max(size_in / size_out, 1.0))) * 2 + 1


def normalize(x: torch.Tensor, scale: float | None, mean, std) -> torch.Tensor:
    """(x * scale - mean) / std per channel over [..., C, H, W]; scale/mean None skip that step.
    In HF's order of float32 operations (rescale, then subtract and divide), so results agree to
    float32 rounding."""
    x = x.float()
    if scale is not None:
        x = x * scale
    if mean is not None:
        m = torch.tensor(mean, dtype=torch.float32).reshape(-1, 1, 1).to(x.device, non_blocking=True)
        s = torch.tensor(std, dtype=torch.float32).reshape(-1, 1, 1).to(x.device, non_blocking=True)
        x = x.sub(m).div_(s)
    return x


def shortest_edge_size(h: int, w: int, edge: int) -> tuple[int, int]:
    """transformers' resize to a shortest edge (default_to_square=False): the long side truncated."""
    short, long = (w, h) if w <= h else (h, w)
    new_short, new_long = edge, int(edge * long / short)
    return (new_long, new_short) if w <= h else (new_short, new_long)


def center_crop(x: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    h, w = x.shape[-2:]
    ch, cw = size
    if ch > h or cw > w:
        raise ValueError(f"centre crop {ch}x{cw} is larger than the image {h}x{w}")
    top, left = (h - ch) // 2, (w - cw) // 2
    return x[..., top:top + ch, left:left + cw]


def group_by_size(images: list[torch.Tensor]) -> dict[tuple[int, int], list[int]]:
    """Indices of same-sized images, so each group runs as one batch."""
    groups: dict[tuple[int, int], list[int]] = {}
    for i, t in enumerate(images):
        groups.setdefault(tuple(t.shape[-2:]), []).append(i)
    return groups


def _run_grouped(fn, images: list[torch.Tensor], device) -> list:
    """fn over same-sized groups: each group stacked where the images are (the host) and copied to
    the device in one transfer."""
    out: list = [None] * len(images)
    for idx in group_by_size(images).values():
        batch = torch.stack([images[i] for i in idx]) if len(idx) > 1 else images[idx[0]][None]
        results = fn(batch.to(device, non_blocking=True))
        for i, r in zip(idx, results):
            out[i] = r
    return out


def _hw(size) -> tuple[int, int]:
    """(height, width) of an HF size (a dict or a SizeDict)."""
    if isinstance(size, dict):
        return int(size["height"]), int(size["width"])
    return int(size.height), int(size.width)


# -- processors --------------------------------------------------------------------------------------
class TensorProcessorBase:
    """Shared: the device, the HF-shaped call, batch entry points. `run_batch` maps a same-sized
    [N, 3, H, W] uint8 batch on the device to N results (left on the device)."""

    def __init__(self, device):
        self.device = torch.device(device)

    def to_device(self, images: list) -> list[torch.Tensor]:
        return [to_uint8_chw(img, self.device) for img in images]

    def run_many(self, images: list) -> list:
        """Any images (PIL/arrays/tensors) -> results on the device, same-sized ones batched."""
        return _run_grouped(self.run_batch, [to_uint8_chw(img) for img in images], self.device)

    def run_batch(self, batch: torch.Tensor) -> list:
        raise NotImplementedError


class ClipStyleTensorProcessor(TensorProcessorBase):
    """The resize -> centre crop -> rescale -> normalise pipeline of CLIP / SigLIP image processors
    (LLaVA-1.5, VILA, NeVA): settings read from the HF processor. Output: pixel_values [N, 3, h, w]."""

    def __init__(self, hf, device):
        super().__init__(device)
        self.do_resize, self.resample = bool(hf.do_resize), int(hf.resample)
        size = hf.size
        self.shortest_edge = getattr(size, "shortest_edge", None)
        self.fixed = (size.height, size.width) if getattr(size, "height", None) else None
        if self.do_resize and self.shortest_edge is None and self.fixed is None:
            raise ValueError(f"unsupported resize size {size}")
        if self.do_resize and getattr(size, "longest_edge", None):
            raise ValueError("a longest_edge bound is not implemented in the tensor path")
        crop = getattr(hf, "crop_size", None)
        self.crop = (crop.height, crop.width) if getattr(hf, "do_center_crop", False) and crop else None
        self.scale = float(hf.rescale_factor) if hf.do_rescale else None
        self.mean = tuple(hf.image_mean) if hf.do_normalize else None
        self.std = tuple(hf.image_std) if hf.do_normalize else None
        self.image_mean = hf.image_mean  # read by model hooks (NeVA's square fill)
        if getattr(hf, "do_pad", None):
            raise ValueError("padding is not implemented in the tensor path")
        _PIL_MODES[self.resample]  # an unknown filter is refused here, not on the first image

    def run_batch(self, batch: torch.Tensor) -> torch.Tensor:
        h, w = batch.shape[-2:]
        x = batch
        if self.do_resize:
            size = self.fixed or shortest_edge_size(h, w, self.shortest_edge)
            x = resize_like_pil(x, size, self.resample)
        if self.crop is not None:
            x = center_crop(x, self.crop)
        return normalize(x.float(), self.scale, self.mean, self.std)

    def __call__(self, images, return_tensors: str = "pt", **kwargs) -> dict:
        pixels = torch.stack(self.run_many(list(images)))
        return {"pixel_values": pixels.cpu()}


class FuyuTensorProcessor(TensorProcessorBase):
    """FuyuImageProcessor: shrink to fit its canvas (bilinear) if larger, pad with 8-bit value
    `padding_value` (1, below the image and right of it), rescale and normalise. The canvas is cut
    to whole patches around the image (what the Fuyu hook keeps of HF's full canvas)."""

    def __init__(self, hf, device):
        super().__init__(device)
        self.max_h, self.max_w = _hw(hf.size)
        self.ph, self.pw = _hw(hf.patch_size)
        self.resample = int(hf.resample)
        self.pad_value = float(hf.padding_value)
        if getattr(hf, "padding_mode", "constant") != "constant":
            raise ValueError("only constant padding is implemented in the tensor path")
        self.scale = float(hf.rescale_factor) if hf.do_rescale else None
        self.mean = hf.image_mean if hf.do_normalize else None
        self.std = hf.image_std if hf.do_normalize else None
        if self.mean is not None and not isinstance(self.mean, (int, float)):
            self.mean, self.std = tuple(self.mean), tuple(self.std)

    def fitted_size(self, h: int, w: int) -> tuple[int, int]:
        if h <= self.max_h and w <= self.max_w:
            return h, w
        f = min(self.max_h / h, self.max_w / w)
        return int(h * f), int(w * f)

    def run_batch(self, batch: torch.Tensor) -> list[torch.Tensor]:
        h, w = self.fitted_size(*batch.shape[-2:])
        x = resize_like_pil(batch, (h, w), self.resample)
        ch = min(self.max_h, -(-h // self.ph) * self.ph)
        cw = min(self.max_w, -(-w // self.pw) * self.pw)
        x = F.pad(x, (0, cw - w, 0, ch - h), value=self.pad_value)
        mean, std = self.mean, self.std
        if isinstance(mean, (int, float)):
            mean, std = (mean,) * 3, (std,) * 3
        return list(normalize(x, self.scale, mean, std))

    def __call__(self, images, return_tensors: str = "pt", **kwargs) -> dict:
        tensors = [to_uint8_chw(img) for img in images]
        sizes = [self.fitted_size(*t.shape[-2:]) for t in tensors]
        out = _run_grouped(self.run_batch, tensors, self.device)
        return {"images": [[t.cpu()] for t in out], "image_unpadded_heights": [[h] for h, _ in sizes],
                "image_unpadded_widths": [[w] for _, w in sizes]}


class Pix2StructTensorProcessor(TensorProcessorBase):
    """Pix2StructImageProcessor: (VQA models) the header text rendered above the image, the image
    normalised by its own mean and std, resized (bilinear, antialiased, in float) to the most whole
    patches within max_patches, cut into patches with 1-based row and column ids. The header's text
    is drawn by PIL once per (text, font) and kept; its resize and the paste are tensor ops.
    `flattened(img, header)` gives the real patches only, [rows * cols, 2 + patch pixels]."""

    def __init__(self, hf, device):
        super().__init__(device)
        self.ph, self.pw = _hw(hf.patch_size)
        self.max_patches = int(hf.max_patches)
        self.do_normalize = bool(hf.do_normalize)

    def with_header(self, x: torch.Tensor, header: str, font_path: str | None) -> torch.Tensor:
        """[3, H, W] uint8 -> the header (PIL's default bicubic resize) above the image, both widened
        to the wider of the two, as transformers' render_header composes them."""
        head = _rendered_header(header, font_path, self.device)
        hh, hw = head.shape[-2:]
        h, w = x.shape[-2:]
        new_w = max(hw, w)
        new_h, new_hh = int(h * (new_w / w)), int(hh * (new_w / hw))
        return torch.cat([resize_like_pil(head, (new_hh, new_w), 3), resize_like_pil(x, (new_h, new_w), 3)], dim=-2)

    def patches(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        if self.do_normalize:
            mean = x.mean()
            std = x.std(correction=0)
            x = (x - mean) / torch.clamp(std, min=1.0 / math.sqrt(x.numel()))
        _, h, w = x.shape
        ph, pw, mp = self.ph, self.pw, self.max_patches
        scale = math.sqrt(mp * (ph / h) * (pw / w))
        rows = max(min(int(scale * h / ph), mp), 1)
        cols = max(min(int(scale * w / pw), mp), 1)
        x = F.interpolate(x[None], size=(rows * ph, cols * pw), mode="bilinear", align_corners=False,
                          antialias=True)[0]
        # [C, rows, ph, cols, pw] -> [rows, cols, ph, pw, C]: channels innermost, as HF's unfold order.
        p = x.reshape(3, rows, ph, cols, pw).permute(1, 3, 2, 4, 0).reshape(rows * cols, -1)
        r = torch.arange(1, rows + 1, device=x.device, dtype=torch.float32).repeat_interleave(cols)
        c = torch.arange(1, cols + 1, device=x.device, dtype=torch.float32).repeat(rows)
        return torch.cat([r[:, None], c[:, None], p], dim=1)

    def flattened(self, img, header: str | None = None, font_path: str | None = None) -> torch.Tensor:
        x = to_uint8_chw(img, self.device)
        if header is not None:
            x = self.with_header(x, header, font_path)
        return self.patches(x)

    def run_batch(self, batch: torch.Tensor) -> list[torch.Tensor]:
        # Per image: each has its own mean and std; the resize and cut are cheap next to the copy.
        return [self.patches(x) for x in batch]

    def __call__(self, images, return_tensors: str = "pt", **kwargs) -> dict:
        out = [p.cpu() for p in self.run_many(list(images))]
        return {"flattened_patches": out, "attention_mask": [torch.ones(p.shape[0]) for p in out]}


@lru_cache(maxsize=64)
def _rendered_header(header: str, font_path: str | None, device) -> torch.Tensor:
    """The header's text drawn by transformers' `render_text` (PIL; the only CPU step), on the device."""
    from transformers.models.pix2struct import image_processing_pil_pix2struct as p2s
    if font_path is None:
        raise ValueError("Pix2Struct header rendering needs a TrueType font: set SPLITSERVE_PIX2STRUCT_FONT")
    return to_uint8_chw(p2s.render_text(header, font_path=font_path), device)


# HF image processor class (its PIL flavour's name without the suffix) -> the tensor processor.
_BY_HF_CLASS = {
    "CLIPImageProcessor": ClipStyleTensorProcessor,
    "SiglipImageProcessor": ClipStyleTensorProcessor,
    "BlipImageProcessor": ClipStyleTensorProcessor,
    "FuyuImageProcessor": FuyuTensorProcessor,
    "Pix2StructImageProcessor": Pix2StructTensorProcessor,
}


def tensor_processor_for(image_processor, device):
    """The tensor-op version of a front's image processor on `device`, or None (keep the HF one) for
    a processor without one, or with a setting the tensor path lacks (logged once, here)."""
    own = getattr(image_processor, "on_device", None)  # a model's own processor (Phi-3-vision)
    if own is not None:
        return own(device)
    name = type(image_processor).__name__
    name = name[:-3] if name.endswith("Pil") else name
    cls = _BY_HF_CLASS.get(name)
    if cls is None:
        logger.info("image preprocessing: no tensor path for %s; using the Hugging Face processor", name)
        return None
    try:
        return cls(image_processor, device)
    except (ValueError, AttributeError, KeyError, TypeError) as e:
        logger.info("image preprocessing: %s's settings are not covered by the tensor path (%s); using the "
                    "Hugging Face processor", name, e)
        return None
