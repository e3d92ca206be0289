"""VILA, the front's side: the image processor's part folder, the image token (None: the processor
picks one) and the token count of the mlp_downsample projector (2x2 patches merged). Built from the
config alone (no model code)."""
from __future__ import annotations

from splitserve.models.prompt_hooks import ImagePromptHooks, tower_tokens


class VilaProcessing(ImagePromptHooks):
    image_processor_subfolder = "vision_tower"

    def init_processing(self, config) -> None:
        if config.mm_vision_select_feature not in ("cls_patch", "patch"):
            raise ValueError(f"unsupported mm_vision_select_feature {config.mm_vision_select_feature!r}")
        self.skip_first = int(config.mm_vision_select_feature == "patch")
        side = int(round((tower_tokens(config.vision_config) - self.skip_first) ** 0.5))
        self.tokens_per_image = ((side + 1) // 2) ** 2
        # None: the processor takes the tokenizer's <image> token if it has one, else token 0.
        self.image_token_id = config.image_token_id

    def num_image_tokens(self, num_tiles: int, image_size: tuple[int, int]) -> int:
        return self.tokens_per_image
