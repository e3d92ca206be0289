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

from splitserve.layers.quantization.base import as_tensor, copy_checkpoint_tensor
from splitserve.layers.vision import MlpProjector, VisionTower
from splitserve.models.vlm_base import VisionLanguageModel, build_language_model
from splitserve.multimodal.processor import to_device_pixels


class LlavaForConditionalGeneration(VisionLanguageModel):
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
        if config.vision_feature_select_strategy not in ("default", "full"):
            raise ValueError(f"unsupported vision_feature_select_strategy {config.vision_feature_select_strategy!r}")
        # "default" drops the first token of the tower's output (CLIP's class token).
        self.skip_first = int(config.vision_feature_select_strategy == "default")
        image_token = getattr(config, "image_token_id", None)
        self.image_token_id = image_token if image_token is not None else config.image_token_index
        tower_tokens = self.vision_tower.num_patches + int(self.vision_tower.is_clip)
        self.tokens_per_tile = tower_tokens - self.skip_first

    # -- images ----------------------------------------------------------------------------------
    def num_image_tokens(self, num_tiles: int, image_size: tuple[int, int]) -> int:
        return self.tokens_per_tile

    def tile_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[N, 3, H, W] -> [N, tokens_per_tile, text hidden]: tower, feature selection, projector."""
        feats = self.vision_tower(pixel_values)[:, self.skip_first:]
        return self.multi_modal_projector(feats)


    # -- weights ---------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Both llava-hf layouts: `language_model.model.*` / `vision_tower.*` (original checkpoints)
        and `model.language_model.*` / `model.vision_tower.*` / `lm_head.*` (transformers >= 4.52)."""
        loaded: set[str] = set()
        params = dict(self.named_parameters())

        def text_weights():
            for name, tensor in weights:
                if name.startswith("model."):
                    name = name[len("model."):]
                if name == "lm_head.weight":
                    yield name, tensor
                elif name.startswith("language_model."):
                    yield name[len("language_model."):], tensor
                elif name.startswith("vision_tower."):  # replicated on every rank: read whole
                    filled = self.vision_tower.load_weight(name[len("vision_tower."):], as_tensor(tensor))
                    if filled:
                        loaded.add(f"vision_tower.{filled}")
                elif name in params:
                    copy_checkpoint_tensor(params[name], tensor, name)
                    loaded.add(name)
                else:
                    raise ValueError(f"checkpoint tensor {name!r} matches no parameter of {type(self).__name__}")

        loaded |= {f"language_model.{n}" for n in self.language_model.load_weights(text_weights())}
        return loaded


class LlavaNextForConditionalGeneration(LlavaForConditionalGeneration):
    """Any-resolution LLaVA: the image is tiled at the best-fitting grid resolution plus one
    downscaled base tile; grid features are stitched back into one map, the padding the processor
    added is cut off, and a learned newline vector ends every row."""

    def __init__(self, config, quant_config=None):
        super().__init__(config, quant_config)
        self.image_newline = nn.Parameter(torch.empty(config.text_config.hidden_size), requires_grad=False)
        self.tile_size = config.vision_config.image_size
        self.side = config.vision_config.image_size // config.vision_config.patch_size
        self.pinpoints = [tuple(p) for p in config.image_grid_pinpoints]
        if self.tokens_per_tile != self.side * self.side:
            raise ValueError("LLaVA-NeXT needs one feature per patch (CLS dropped, or a tower without CLS "
                             "and vision_feature_select_strategy 'full')")

    def _grid(self, image_size: tuple[int, int]) -> tuple[int, int]:
        from transformers.image_processing_utils import select_best_resolution
        h, w = select_best_resolution(tuple(image_size), self.pinpoints)
        return h // self.tile_size, w // self.tile_size

    def _unpadded_window(self, image_size: tuple[int, int], grid: tuple[int, int]) -> tuple[int, int, int, int]:
        """(top, height, left, width) of the real image inside the stitched feature map: the
        processor resized it to fit the grid and padded the rest symmetrically. Rounding follows the
        reference implementation exactly, as it decides the token count."""
        orig_h, orig_w = image_size
        cur_h, cur_w = grid[0] * self.side, grid[1] * self.side
        if orig_w / orig_h > cur_w / cur_h:
            new_h = int(round(orig_h * (cur_w / orig_w), 7))
            pad = (cur_h - new_h) // 2
            return pad, cur_h - 2 * pad, 0, cur_w
        new_w = int(round(orig_w * (cur_h / orig_h), 7))
        pad = (cur_w - new_w) // 2
        return 0, cur_h, pad, cur_w - 2 * pad

    def num_image_tokens(self, num_tiles: int, image_size: tuple[int, int]) -> int:
        if num_tiles == 1:
            return self.tokens_per_tile + 1
        _, h, _, w = self._unpadded_window(image_size, self._grid(image_size))
        return self.tokens_per_tile + h * (w + 1)

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
