"""BLIP-2, the front's side (OPT and Flan-T5 language models alike): an image is num_query_tokens
placeholders, and a prompt without image markers gets its images first, before BOS, as
Blip2Processor lays it out. Built from the config alone (no model code)."""
from __future__ import annotations

from splitserve.models.prompt_hooks import ImagePromptHooks


class Blip2Processing(ImagePromptHooks):
    num_query_tokens: int

    def init_processing(self, config) -> None:
        self.image_token_id = getattr(config, "image_token_index", None)
        self.num_query_tokens = config.num_query_tokens

    def num_image_tokens(self, num_tiles: int, image_size: tuple[int, int]) -> int:
        return self.num_query_tokens

    def arrange_prompt(self, ids: list[int], num_images: int, marker_id: int) -> list[int]:
        return [marker_id] * num_images + ids
