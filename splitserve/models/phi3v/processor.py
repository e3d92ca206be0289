"""Phi-3-vision, the front's side: the HD-crop image processor (the published one, in PIL + torch),
prompts with `<|image_N|>` markers, and the token count of an image's crops. Built from the config
alone (no model code)."""
from __future__ import annotations

import json
import math
import os
import re

import numpy as np
import torch
import torch.nn.functional as F

from splitserve.models.prompt_hooks import ImagePromptHooks
from splitserve.multimodal.media import MediaError
from splitserve.multimodal.processor import IMAGE_MARKER
from splitserve.multimodal.tensor_preprocess import TensorProcessorBase, normalize, resize_like_pil

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
_NUMBERED_MARKER = re.compile(r"<\|image_(\d+)\|>")
# -- image processing -----------------------------------------------------------------------------
def hd_size(width: int, height: int, num_crops: int, side: int) -> tuple[int, int, int, int]:
    """(resized width, height, padded width, height) of the HD transform: the largest whole number
    of crops across the longer side such that the crops fit in num_crops; the shorter side scales
    along and is padded up to whole crops (centred)."""
    transposed = width < height
    if transposed:
        width, height = height, width
    ratio = width / height
    scale = 1
    while scale * math.ceil(scale / ratio) <= num_crops:
        scale += 1
    scale -= 1
    new_w = int(scale * side)
    new_h = int(new_w / ratio)
    if new_h < 1:
        raise MediaError(f"image of {width}x{height} is too elongated for {num_crops} HD crops")
    padded_h = int(math.ceil(new_h / side) * side)
    if transposed:
        return new_h, new_w, padded_h, new_w
    return new_w, new_h, new_w, padded_h


class Phi3VImageProcessor:
    """The published Phi3VImageProcessor in PIL + torch: `__call__(images=[img], return_tensors="pt")`
    gives pixel_values [1, 1 + crops, 3, S, S] (the global view first) and image_sizes [[H, W]],
    the padded HD size from which the model counts crops and tokens."""

    def __init__(self, num_crops: int, side: int, mean=OPENAI_CLIP_MEAN, std=OPENAI_CLIP_STD):
        if num_crops < 1:
            raise ValueError(f"num_crops must be at least 1, got {num_crops}")
        self.num_crops, self.side = num_crops, side
        self.mean = torch.tensor(mean, dtype=torch.float32).view(3, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32).view(3, 1, 1)

    @classmethod
    def from_directory(cls, directory: str, side: int) -> "Phi3VImageProcessor":
        path = os.path.join(directory, "preprocessor_config.json")
        cfg = {}
        if os.path.isfile(path):
            with open(path) as f:
                cfg = json.load(f)
        return cls(int(cfg.get("num_crops", 1)), side, cfg.get("image_mean") or OPENAI_CLIP_MEAN,
                   cfg.get("image_std") or OPENAI_CLIP_STD)

    def hd_image(self, img):
        """Resize and pad as the published code does, in its order: a tall image is transposed
        first, so PIL's two resampling passes (rounded to 8 bits between them) run as they do there."""
        from PIL import Image
        img = img.convert("RGB")
        transposed = img.size[0] < img.size[1]
        if transposed:
            img = img.transpose(Image.Transpose.TRANSPOSE)
        new_w, new_h, pad_w, pad_h = hd_size(img.size[0], img.size[1], self.num_crops, self.side)
        resized = img.resize((new_w, new_h), Image.BILINEAR)
        canvas = Image.new("RGB", (pad_w, pad_h), (255, 255, 255))
        canvas.paste(resized, (0, (pad_h - new_h) // 2))  # white rows above and below, the extra one below
        return canvas.transpose(Image.Transpose.TRANSPOSE) if transposed else canvas

    def __call__(self, images, return_tensors: str = "pt") -> dict:
        pixels, sizes = [], []
        s = self.side
        for img in images:
            hd = self.hd_image(img)
            x = torch.from_numpy(np.asarray(hd, dtype=np.float32) / 255.0).permute(2, 0, 1)
            x = (x - self.mean) / self.std
            h, w = x.shape[1:]
            glob = F.interpolate(x[None], size=(s, s), mode="bicubic")
            crops = x.view(3, h // s, s, w // s, s).permute(1, 3, 0, 2, 4).reshape(-1, 3, s, s)
            pixels.append(torch.cat([glob, crops]))
            sizes.append([h, w])
        if len(pixels) != 1:  # the engine processes one image at a time; crop counts differ
            raise ValueError("Phi3VImageProcessor takes one image per call")
        return {"pixel_values": pixels[0][None], "image_sizes": torch.tensor(sizes)}

    def on_device(self, device) -> "Phi3VTensorProcessor":
        """The tensor-op version (multimodal/tensor_preprocess.py finds it by this name)."""
        return Phi3VTensorProcessor(self, device)


class Phi3VTensorProcessor(TensorProcessorBase):
    """Phi3VImageProcessor as tensor ops on a device: the same HD resize (bilinear as PIL's, rounded
    to 8 bits per pass, a tall image transposed first), white padding, normalisation, the bicubic
    global view and the crops. Same call and outputs (CPU tensors)."""

    def __init__(self, reference: Phi3VImageProcessor, device):
        super().__init__(device)
        self.num_crops, self.side = reference.num_crops, reference.side
        self.mean, self.std = reference.mean.flatten().tolist(), reference.std.flatten().tolist()

    def run_batch(self, batch: torch.Tensor) -> list[torch.Tensor]:
        """[N, 3, H, W] uint8 -> N tensors [1 + crops, 3, S, S] (the global view first)."""
        s = self.side
        x = batch
        transposed = x.shape[-1] < x.shape[-2]
        if transposed:
            x = x.transpose(-1, -2)
        new_w, new_h, pad_w, pad_h = hd_size(x.shape[-1], x.shape[-2], self.num_crops, s)
        x = resize_like_pil(x, (new_h, new_w), 2)
        top = (pad_h - new_h) // 2  # white rows above and below, the extra one below
        x = F.pad(x, (0, pad_w - new_w, top, pad_h - new_h - top), value=255.0)
        if transposed:
            x = x.transpose(-1, -2)
        x = normalize(x, 1 / 255.0, self.mean, self.std)
        n, _, h, w = x.shape
        glob = F.interpolate(x, size=(s, s), mode="bicubic")
        crops = x.reshape(n, 3, h // s, s, w // s, s).permute(0, 2, 4, 1, 3, 5).reshape(n, -1, 3, s, s)
        return list(torch.cat([glob[:, None], crops], dim=1))

    def __call__(self, images, return_tensors: str = "pt") -> dict:
        if len(images) != 1:  # as the reference: crop counts differ between images
            raise ValueError("Phi3VImageProcessor takes one image per call")
        x = self.to_device(list(images))[0]
        pixels = self.run_batch(x[None])[0]
        return {"pixel_values": pixels[None].cpu(), "image_sizes": torch.tensor([self.padded_size(*x.shape[-2:])])}

    def padded_size(self, h: int, w: int) -> list[int]:
        """[H, W] of the padded HD image (what the model counts crops from)."""
        if w < h:
            _, _, pad_w, pad_h = hd_size(h, w, self.num_crops, self.side)
            return [pad_w, pad_h]
        _, _, pad_w, pad_h = hd_size(w, h, self.num_crops, self.side)
        return [pad_h, pad_w]


# -- prompts --------------------------------------------------------------------------------------
def tokenize_phi3v_prompt(tokenizer, text: str, marker_id: int) -> list[int]:
    """Text with `<|image_N|>` markers (N = 1, 2, ... in order), or generic `<image>` markers (what
    chat content parts become, numbered in order), -> ids with one marker_id per image. Each chunk
    between markers is tokenized with the tokenizer's special tokens, as the published processor does."""
    numbered = [int(n) for n in _NUMBERED_MARKER.findall(text)]
    if numbered and IMAGE_MARKER in text:
        raise MediaError(f"the prompt mixes <|image_N|> and {IMAGE_MARKER} image markers")
    if numbered != list(range(1, len(numbered) + 1)):
        raise MediaError(f"Phi-3-vision image markers must be <|image_1|>, <|image_2|>, ... each once and in "
                         f"order; got {['<|image_%d|>' % n for n in numbered]}")
    chunks = _NUMBERED_MARKER.split(text)[::2] if numbered else text.split(IMAGE_MARKER)
    ids: list[int] = []
    for i, chunk in enumerate(chunks):
        if i:
            ids.append(marker_id)
        ids.extend(tokenizer.encode(chunk, add_special_tokens=True))
    return ids


class Phi3VProcessing(ImagePromptHooks):
    image_token = "<|image|>"  # the placeholder's token text where the tokenizer has it

    def init_processing(self, config) -> None:
        vc = config.vision_config
        self.side = vc.image_size // vc.patch_size
        if self.side % 2:
            raise ValueError(f"Phi-3-vision's 2x2 merge needs an even patch grid, got {self.side}x{self.side}")
        self.crop = vc.image_size
        self.image_token_id = config.image_token_id

    # -- front-end hooks (multimodal/processor.py) -------------------------------------------------
    def load_image_processor(self, directory: str) -> Phi3VImageProcessor:
        return Phi3VImageProcessor.from_directory(directory, self.crop)

    @staticmethod
    def tokenize_prompt(tokenizer, text: str, marker_id: int) -> list[int]:
        return tokenize_phi3v_prompt(tokenizer, text, marker_id)

    # -- images ------------------------------------------------------------------------------------
    def _grid(self, image_size: tuple[int, int]) -> tuple[int, int]:
        return image_size[0] // self.crop, image_size[1] // self.crop

    def num_image_tokens(self, num_tiles: int, image_size: tuple[int, int]) -> int:
        hc, wc = self._grid(image_size)
        if hc * wc + 1 != num_tiles:
            raise ValueError(f"{num_tiles} tiles do not match an HD image of {image_size}")
        m = self.side // 2
        return hc * m * (wc * m + 1) + 1 + m * (m + 1)
