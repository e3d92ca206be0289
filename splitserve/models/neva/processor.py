"""NeVA / Video NeVA, the front's side: `<image>` / `<video>` prompts tokenized piece by piece (NeMo's
prompts carry no BOS), NeMo's expand2square padding, and the token counts of images and videos
(a video's frames are its tiles). Built from the config alone (no model code)."""
from __future__ import annotations

import re

from splitserve.loading.neva_nemo import PATCH_TOKEN, VIDEO_TOKEN_INDEX
from splitserve.models.prompt_hooks import ImagePromptHooks, tower_tokens


class NevaProcessing(ImagePromptHooks):
    image_token = PATCH_TOKEN
    image_token_id = None  # the tokenizer's id of PATCH_TOKEN (the processor looks it up)
    video_token_index = VIDEO_TOKEN_INDEX

    def init_processing(self, config) -> None:
        neva = config.neva
        self.skip_first = int(neva["class_token_length"])
        self.tokens_per_image = tower_tokens(config.vision_config, class_token=True) - self.skip_first
        self.num_frames = int(getattr(config, "num_frames", None) or neva["num_frames"])
        self.pad_to_square = neva["image_aspect_ratio"] == "pad"

    # -- prompts (hooks of multimodal/processor.py) ------------------------------------------------
    @staticmethod
    def tokenize_prompt(tokenizer, text: str, marker_id: int) -> list[int]:
        """`<image>` -> the placeholder id, `<video>` -> VIDEO_TOKEN_INDEX; pieces tokenized apart
        without special tokens (NeMo's prompts carry no BOS)."""
        ids: list[int] = []
        for piece in re.split(r"(<image>|<video>)", text):
            if piece == "<image>":
                ids.append(marker_id)
            elif piece == "<video>":
                ids.append(VIDEO_TOKEN_INDEX)
            elif piece:
                ids.extend(tokenizer.encode(piece, add_special_tokens=False))
        return ids

    def preprocess_image(self, image_processor, img):
        if self.pad_to_square and img.size[0] != img.size[1]:  # NeMo's expand2square, mean-colour fill
            from PIL import Image
            side = max(img.size)
            fill = tuple(int(round(m * 255)) for m in image_processor.image_mean)
            square = Image.new(img.mode, (side, side), fill)
            square.paste(img, ((side - img.size[0]) // 2, (side - img.size[1]) // 2))
            img = square
        pixels = image_processor(images=[img], return_tensors="pt")["pixel_values"]
        return pixels, (img.size[1], img.size[0]), self.tokens_per_image

    def num_image_tokens(self, num_tiles: int, image_size: tuple[int, int]) -> int:
        return self.tokens_per_image * num_tiles  # a video's frames are its tiles

    def num_video_tokens(self, num_frames: int) -> int:
        return self.tokens_per_image * num_frames
