"""LLaVA-1.5 / LLaVA-NeXT, the front's side: the image token and how many placeholder tokens an
image takes (the HF image processor does the pixels). Built from the config alone (no model code):
LLaVA-NeXT's count depends on the any-resolution grid the image is tiled at."""
from __future__ import annotations

from splitserve.models.prompt_hooks import ImagePromptHooks, tower_tokens


class LlavaProcessing(ImagePromptHooks):
    def init_processing(self, config) -> None:
        if config.vision_feature_select_strategy not in ("default", "full"):
            raise ValueError(f"unsupported vision_feature_select_strategy {config.vision_feature_select_strategy!r}")
        # "default" drops the first token of the tower's output (CLIP's class token).
        self.skip_first = int(config.vision_feature_select_strategy == "default")
        image_token = getattr(config, "image_token_id", None)
        self.image_token_id = image_token if image_token is not None else config.image_token_index
        self.tokens_per_tile = tower_tokens(config.vision_config) - self.skip_first

    def num_image_tokens(self, num_tiles: int, image_size: tuple[int, int]) -> int:
        return self.tokens_per_tile


class LlavaNextProcessing(LlavaProcessing):
    """Any-resolution LLaVA: the image is tiled at the best-fitting grid resolution plus one
    downscaled base tile; its grid's features lose the padding the processor added, and every row
    ends in a newline vector."""

    def init_processing(self, config) -> None:
        super().init_processing(config)
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
