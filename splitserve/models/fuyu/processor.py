"""Fuyu, the front's side: an image becomes its grid of 30x30 patches (the HF image processor's canvas
cut to the image), its run in the prompt is row by row (cols placeholders, then |NEWLINE|), and a
prompt without image markers gets FuyuProcessor's layout. Built from the config alone (no model code)."""
from __future__ import annotations

import numpy as np
import torch

from splitserve.loading.checkpoint_tokens import checkpoint_token_id
from splitserve.models.prompt_hooks import ImagePromptHooks

# Ids of the released fuyu-8b vocabulary, for a checkpoint folder without a tokenizer to ask.
_NEWLINE_ID, _ANSWER_ID = 71019, 7


class FuyuProcessing(ImagePromptHooks):
    def init_processing(self, config) -> None:
        self.patch_h = self.patch_w = config.patch_size
        self.num_channels = config.num_channels
        self.image_token_id = config.image_token_id  # |SPEAKER|
        self.newline_id = getattr(config, "image_newline_id", None) or checkpoint_token_id(config, "|NEWLINE|", _NEWLINE_ID)
        self.answer_id = checkpoint_token_id(config, "<0x04>", _ANSWER_ID)
        self.bos_id = config.text_config.bos_token_id

    # -- images ----------------------------------------------------------------------------------
    def preprocess_image(self, image_processor, img) -> tuple[torch.Tensor, tuple[int, int], int]:
        """One image -> its patches as a [rows, cols, patch_h * patch_w * channels] grid (the shape
        carries the grid), its original (height, width) and its token count rows * (cols + 1)."""
        out = image_processor(images=[img])
        canvas = torch.as_tensor(np.asarray(out["images"][0][0]))
        h, w = int(out["image_unpadded_heights"][0][0]), int(out["image_unpadded_widths"][0][0])
        ph, pw = self.patch_h, self.patch_w
        rows, cols = min(canvas.shape[-2] // ph, -(-h // ph)), min(canvas.shape[-1] // pw, -(-w // pw))
        image = canvas[:, :rows * ph, :cols * pw]
        # [C, rows, ph, cols, pw] -> [rows, cols, ph, pw, C]: a patch's features run over its pixels
        # row by row with the channels innermost, as the checkpoint's projection was trained on.
        patches = image.reshape(self.num_channels, rows, ph, cols, pw).permute(1, 3, 2, 4, 0)
        return patches.reshape(rows, cols, -1), (img.size[1], img.size[0]), rows * (cols + 1)

    def num_image_tokens(self, num_tiles: int, image_size: tuple[int, int]) -> int:
        raise NotImplementedError("Fuyu counts an image's tokens in preprocess_image")

    def arrange_prompt(self, ids: list[int], num_images: int, marker_id: int) -> list[int]:
        """A prompt without image markers: images, BOS, the text, <0x04> (FuyuProcessor's layout)."""
        if ids[:1] == [self.bos_id]:
            ids = ids[1:]
        return [marker_id] * num_images + [self.bos_id] + ids + [self.answer_id]

    def image_run_ids(self, image, placeholder_id: int) -> list[int]:
        """The prompt ids of an image's run: per row, cols placeholders and one |NEWLINE|."""
        rows, cols = image.pixel_values.shape[:2]
        return ([placeholder_id] * cols + [self.newline_id]) * rows
