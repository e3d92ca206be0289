"""Fuyu (`FuyuForCausalLM`): no vision encoder. The image is cut into 30x30 patches that one linear
map (`vision_embed_tokens`) puts straight into the Persimmon decoder's token stream.

Variable grids: the HF image processor scales an image down to fit its canvas (1080x1920 for
fuyu-8b; smaller images keep their size) and pads it; only the patches covering the image (its
size rounded up to whole patches) are used, so every image has its own rows x cols grid. Its run in
the prompt is row by row: cols patch tokens, then one `|NEWLINE|` token, whose input is the
`|NEWLINE|` token embedding (not a patch). `encode_images` returns that whole run: projected patches
with the newline embedding after each row, all images of a step in one matmul.

Prompt layout (transformers' FuyuProcessor): the image runs, BOS, the text, then `<0x04>`
(beginning of answer); a prompt without image markers gets that layout (`arrange_prompt`).
"""
from __future__ import annotations

from typing import Iterable

import numpy as np
import torch

from splitserve.layers.linear import Linear
from splitserve.layers.quantization.base import as_tensor
from splitserve.loading.checkpoint_tokens import checkpoint_token_id
from splitserve.models.vlm_base import VisionLanguageModel, build_language_model

# Ids of the released fuyu-8b vocabulary, for a checkpoint folder without a tokenizer to ask.
_NEWLINE_ID, _ANSWER_ID = 71019, 7


class FuyuForCausalLM(VisionLanguageModel):
    def __init__(self, config, quant_config=None):
        super().__init__()
        self.config = config
        self.language_model = build_language_model(config.text_config, quant_config, "language_model.model",
                                                   "language_model.lm_head")
        self.patch_h = self.patch_w = config.patch_size
        self.num_channels = config.num_channels
        self.vision_embed_tokens = Linear(config.patch_size * config.patch_size * config.num_channels,
                                          config.text_config.hidden_size, bias=True)
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

    def encode_images(self, items) -> list[torch.Tensor]:
        dev, dtype = self._param.device, self._param.dtype
        grids = [it.pixel_values for it in items]
        flat = torch.cat([g.reshape(-1, g.shape[-1]) for g in grids]).to(device=dev, dtype=dtype, non_blocking=True)
        feats = self.vision_embed_tokens(flat)
        newline = self.language_model.embed(torch.tensor([self.newline_id], device=dev))[0].to(feats.dtype)
        out = []
        for grid, f in zip(grids, feats.split([g.shape[0] * g.shape[1] for g in grids])):
            rows, cols = grid.shape[0], grid.shape[1]
            f = torch.cat([f.view(rows, cols, -1), newline.expand(rows, 1, -1)], dim=1)
            out.append(f.reshape(rows * (cols + 1), -1))
        return out

    # -- weights ---------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Both layouts: `language_model.model.*` / `language_model.lm_head.*` / `vision_embed_tokens.*`
        (as saved) and `model.language_model.*` / `lm_head.*` / `model.vision_embed_tokens.*`."""
        loaded: set[str] = set()

        def text_weights():
            for name, tensor in weights:
                if name.startswith("model.") and not name.startswith("model.language_model."):
                    name = name[len("model."):]
                if name.startswith("model.language_model."):
                    yield "model." + name[len("model.language_model."):], tensor
                elif name.startswith("language_model."):
                    yield name[len("language_model."):], tensor
                elif name == "lm_head.weight":
                    yield name, tensor
                elif name.startswith("vision_embed_tokens."):
                    self.vision_embed_tokens.load(name.rpartition(".")[2], as_tensor(tensor))
                    loaded.add(name)
                else:
                    raise ValueError(f"checkpoint tensor {name!r} matches no parameter of {type(self).__name__}")

        loaded |= {f"language_model.{n}" for n in self.language_model.load_weights(text_weights())}
        return loaded
