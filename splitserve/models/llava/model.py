"""LLaVA-1.5 (`LlavaForConditionalGeneration`) and LLaVA-NeXT (`LlavaNextForConditionalGeneration`),
llava-hf checkpoint layout.

Vision tower (CLIP ViT or SigLIP) + MLP projector are the batchful image stage: `encode_images` runs
all images of a step as one batch and returns each image's features, one vector per placeholder
token. The decoder is the engine's configurable decoder (models/decoder.py); image features enter as `inputs_embeds`.
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from splitserve.layers.vision import MlpProjector, VisionTower
from splitserve.models.llava.processor import LlavaNextProcessing, LlavaProcessing
from splitserve.models.vlm_base import VisionLanguageModel, build_language_model
from splitserve.models.weights import WeightRoute, load_routed_weights
from splitserve.multimodal.processor import to_device_pixels


# Checkpoint name -> module (models/weights.load_routed_weights): `model.` dropped first (the newer
# layout), the language model's tensors to it, the tower's read whole on every rank, the projector
# (and LLaVA-NeXT's image_newline) by their own names.
LLAVA_WEIGHTS = (
    WeightRoute("model.", "rename"),
    WeightRoute("lm_head.weight", "text", "lm_head.weight"),
    WeightRoute("language_model.", "text"),
    WeightRoute("vision_tower.", "tower", "vision_tower"),
    WeightRoute("", "param"),
)


class LlavaForConditionalGeneration(LlavaProcessing, VisionLanguageModel):
    def __init__(self, config, quant_config=None):
        super().__init__()
        self.config = config
        self.language_model = build_language_model(config.text_config, quant_config)
        self.vision_tower = VisionTower(config.vision_config, config.vision_feature_layer)
        layers = config.vision_feature_layer
        in_dim = config.vision_config.hidden_size * (1 if isinstance(layers, int) else len(layers))
        self.multi_modal_projector = MlpProjector(in_dim, config.text_config.hidden_size,
                                                  getattr(config, "projector_hidden_act", "gelu"),
                                                  getattr(config, "multimodal_projector_bias", True))
        self.init_processing(config)  # image token, skip_first, tokens_per_tile (processor.py)

    # -- images ----------------------------------------------------------------------------------
    def tile_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[N, 3, H, W] -> [N, tokens_per_tile, text hidden]: tower, feature selection, projector."""
        feats = self.vision_tower(pixel_values)[:, self.skip_first:]
        return self.multi_modal_projector(feats)


    # -- weights ---------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Both llava-hf layouts: `language_model.model.*` / `vision_tower.*` (original checkpoints)
        and `model.language_model.*` / `model.vision_tower.*` / `lm_head.*` (transformers >= 4.52)."""
        return load_routed_weights(self, weights, LLAVA_WEIGHTS)


class LlavaNextForConditionalGeneration(LlavaNextProcessing, LlavaForConditionalGeneration):
    """Any-resolution LLaVA: the image is tiled at the best-fitting grid resolution plus one
    downscaled base tile; grid features are stitched back into one map, the padding the processor
    added is cut off, and a learned newline vector ends every row (grid arithmetic: processor.py)."""

    def __init__(self, config, quant_config=None):
        super().__init__(config, quant_config)
        self.image_newline = nn.Parameter(torch.empty(config.text_config.hidden_size), requires_grad=False)

    def encode_images(self, items) -> list[torch.Tensor]:
        tiles = self.tile_features(to_device_pixels(items, self._param.device, self._param.dtype))
        out = []
        for item, feats in zip(items, tiles.split([it.pixel_values.shape[0] for it in items])):
            base, grid_tiles = feats[0], feats[1:]
            dim = feats.shape[-1]
            newline = self.image_newline.to(feats.dtype)
            if grid_tiles.shape[0] == 0:
                out.append(torch.cat([base, newline[None]]))
                continue
            gh, gw = self._grid(item.image_size)
            s = self.side
            # tiles row-major over the grid, patches row-major in a tile -> one [gh*s, gw*s] map
            fmap = grid_tiles.view(gh, gw, s, s, dim).permute(0, 2, 1, 3, 4).reshape(gh * s, gw * s, dim)
            top, h, left, w = self._unpadded_window(item.image_size, (gh, gw))
            fmap = fmap[top:top + h, left:left + w]
            fmap = torch.cat([fmap, newline.expand(h, 1, dim)], dim=1)
            out.append(torch.cat([base, fmap.reshape(-1, dim)]))
        return out
