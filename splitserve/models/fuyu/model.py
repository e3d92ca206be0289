"""Fuyu (`FuyuForCausalLM`): no vision encoder. The image is cut into 30x30 patches that one linear
map (`vision_embed_tokens`) puts straight into the Persimmon decoder's token stream.

Variable grids: the HF image processor scales an image down to fit its canvas (1080x1920 for
fuyu-8b; smaller images keep their size) and pads it; only the patches covering the image (its
size rounded up to whole patches) are used, so every image has its own rows x cols grid. Its run in
the prompt is row by row: cols patch tokens, then one `|NEWLINE|` token, whose input is the
`|NEWLINE|` token embedding (not a patch). `encode_images` returns that whole run: projected patches
with the newline embedding after each row, all images of a step in one matmul.

Prompt layout (transformers' FuyuProcessor): the image runs, BOS, the text, then `<0x04>`
(beginning of answer); a prompt without image markers gets that layout (`arrange_prompt`). The
patch grids, prompt layout and token counts are the front's: processor.py.
"""
from __future__ import annotations

from typing import Iterable

import torch

from splitserve.layers.linear import Linear
from splitserve.models.fuyu.processor import FuyuProcessing
from splitserve.models.vlm_base import VisionLanguageModel, build_language_model
from splitserve.models.weights import WeightRoute, load_routed_weights

# Checkpoint name -> module, for both layouts (see load_weights): `model.` dropped except before
# `language_model.`, whose tensors keep it (the decoder's own names start with it).
FUYU_WEIGHTS = (
    WeightRoute("model.language_model.", "text", "model."),
    WeightRoute("model.", "rename"),
    WeightRoute("language_model.", "text"),
    WeightRoute("lm_head.weight", "text", "lm_head.weight"),
    WeightRoute("vision_embed_tokens.", "linear", "vision_embed_tokens"),
)


class FuyuForCausalLM(FuyuProcessing, VisionLanguageModel):
    def __init__(self, config, quant_config=None):
        super().__init__()
        self.config = config
        self.language_model = build_language_model(config.text_config, quant_config, "language_model.model",
                                                   "language_model.lm_head")
        self.vision_embed_tokens = Linear(config.patch_size * config.patch_size * config.num_channels,
                                          config.text_config.hidden_size, bias=True)
        self.init_processing(config)  # patch size, token ids (processor.py)

    # -- images ----------------------------------------------------------------------------------
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
        return load_routed_weights(self, weights, FUYU_WEIGHTS)
