"""CogVLM, the front's side: the published image transform, the prompt layout (the one image right
after BOS) and its check, and the image's token count. Built from the config alone (no model code)."""
from __future__ import annotations

import numpy as np
import torch

from splitserve.models.prompt_hooks import ImagePromptHooks
from splitserve.multimodal.media import MediaError
from splitserve.multimodal.processor import IMAGE_MARKER

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


class CogVLMImageProcessor:
    """The published transform: bicubic resize to S x S (no crop), CLIP normalization."""

    def __init__(self, side: int):
        self.side = side
        self.mean = torch.tensor(CLIP_MEAN).view(3, 1, 1)
        self.std = torch.tensor(CLIP_STD).view(3, 1, 1)

    def __call__(self, images, return_tensors: str = "pt") -> dict:
        from PIL import Image
        out = []
        for img in images:
            x = np.asarray(img.convert("RGB").resize((self.side, self.side), Image.BICUBIC), dtype=np.float32)
            out.append((torch.from_numpy(x / 255.0).permute(2, 0, 1) - self.mean) / self.std)
        return {"pixel_values": torch.stack(out)}


def tokenize_cogvlm_prompt(tokenizer, text: str, marker_id: int) -> list[int]:
    """[BOS, image marker] + the text without its marker, as build_conversation_input_ids lays a
    prompt out (the image always follows BOS, wherever the marker stood)."""
    if text.count(IMAGE_MARKER) > 1:
        raise MediaError("CogVLM takes one image per prompt (the published model supports no more)")
    ids = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    if IMAGE_MARKER in text:
        ids.append(marker_id)
        text = text.replace(IMAGE_MARKER, "", 1)
    return ids + list(tokenizer.encode(text, add_special_tokens=False))


class CogVLMProcessing(ImagePromptHooks):
    def init_processing(self, config) -> None:
        vc = config.vision_config
        self.side = vc["image_size"]
        self.tokens_per_image = (vc["image_size"] // vc["patch_size"]) ** 2 + 2
        self.image_token_id = getattr(config, "image_token_id", None)

    # -- front-end hooks (multimodal/processor.py) -------------------------------------------------
    def load_image_processor(self, directory: str) -> CogVLMImageProcessor:
        return CogVLMImageProcessor(self.side)

    @staticmethod
    def tokenize_prompt(tokenizer, text: str, marker_id: int) -> list[int]:
        return tokenize_cogvlm_prompt(tokenizer, text, marker_id)

    def check_mm_prompt(self, prompt) -> None:
        """The RoPE shift is one per image layout: one image, right after BOS (or first)."""
        if len(prompt.mm_items) > 1:
            raise MediaError("CogVLM takes one image per prompt (the published model supports no more)")
        if prompt.mm_items and prompt.mm_items[0].offset > 1:
            raise MediaError("CogVLM's image must come first in the prompt (after BOS), as the published "
                             "prompt layout has it")

    # -- images ------------------------------------------------------------------------------------
    def num_image_tokens(self, num_tiles: int, image_size: tuple[int, int]) -> int:
        return self.tokens_per_image
