"""Pix2Struct's front side (the model's multimodal processor, found through the model's
`mm_processor_class`): the prompt rendered as a header above the image, the result cut into
patches by transformers' image processor (models/pix2struct/model.py describes the whole model)."""
from __future__ import annotations

import glob
import os

import numpy as np
import torch

from splitserve.models.encoder_image_prompt import EncoderImagePromptProcessor

DEPLOT_PROMPT = "Generate underlying data table of the figure below:"


def default_font_path() -> str | None:
    """A TrueType font on this machine for header rendering ($SPLITSERVE_PIX2STRUCT_FONT first):
    transformers would download Arial from the Hub, which a server may not reach."""
    env = os.environ.get("SPLITSERVE_PIX2STRUCT_FONT")
    if env:
        return env
    for pattern in ("/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf", "/usr/share/fonts/**/*.ttf",
                    "/usr/share/fonts/**/*.TTF"):
        found = sorted(glob.glob(pattern, recursive=True))
        if found:
            return found[0]
    return None


def render_header(image_processor, img, header: str, font_path: str | None):
    """The image with `header` rendered above it, by transformers' own `render_header` (what its
    processor does for VQA models) with a local font: its processor's call takes no font."""
    if font_path is None:
        raise ValueError("Pix2Struct header rendering needs a TrueType font: set SPLITSERVE_PIX2STRUCT_FONT")
    chw = np.asarray(img.convert("RGB")).transpose(2, 0, 1)
    return image_processor.render_header(chw, header, font_path=font_path).transpose(1, 2, 0)


class Pix2StructPromptProcessor(EncoderImagePromptProcessor):
    """The front's processor for Pix2Struct: one image per request, the text rendered as its header
    (VQA-style models such as Deplot; the default header is Deplot's prompt)."""
    model_name = "Pix2Struct"

    def __init__(self, model, model_directory: str, tokenizer):
        super().__init__(model, model_directory, tokenizer)
        self.is_vqa = bool(getattr(self.image_processor, "is_vqa", False))
        self.font_path = default_font_path()
        t = model.config.text_config
        self.decoder_start_token_id = t.decoder_start_token_id
        # A token-id prompt marks its image with this id; the other ids are decoded as the header.
        self.placeholder_id = t.pad_token_id if t.pad_token_id is not None else 0

    def flattened_patches(self, img, header: str | None) -> torch.Tensor:
        """The image's real patches [n, 2 + patch pixels] (the processor pads to max_patches)."""
        flattened = getattr(self.image_processor, "flattened", None)
        if flattened is not None:  # the tensor path (set_preprocess_device): header and patches on its device
            return flattened(img, (header or DEPLOT_PROMPT) if self.is_vqa else None, self.font_path).cpu()
        if self.is_vqa:
            img = render_header(self.image_processor, img, header or DEPLOT_PROMPT, self.font_path)
        out = self.image_processor(images=[img], return_tensors="pt", is_vqa=False)
        mask = out["attention_mask"][0]
        n = int(mask.sum())
        if not bool(mask[:n].all()):
            raise ValueError("Pix2Struct patches are not a prefix of the processor's output")
        return out["flattened_patches"][0, :n].contiguous()

    def encoder_item(self, img, img_hash: str, text: str):
        from splitserve.protocol.mm_inputs import ImageItem
        header = text or None
        patches = self.flattened_patches(img, header)
        key = f"{img_hash}:{header if self.is_vqa else ''}"  # the header is part of the encoder's input
        return ImageItem(key, patches, (img.size[1], img.size[0]), patches.shape[0], 0)
