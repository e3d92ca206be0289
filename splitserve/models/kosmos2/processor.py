"""Kosmos-2, the front's side: Kosmos2Processor's prompt text (BOS, image markers), an image's run of
66 tokens (`<image>`, 64 slot ids, `</image>`), and the grounding post-processing of generated text.
Built from the config alone (no model code)."""
from __future__ import annotations

from splitserve.loading.checkpoint_tokens import checkpoint_special_id, checkpoint_token_id
from splitserve.models.prompt_hooks import ImagePromptHooks

# Ids of the released kosmos-2-patch14-224 vocabulary, for a folder without a tokenizer to ask.
_BOI_ID, _EOI_ID, _UNK_ID = 64003, 64004, 3


class Kosmos2Processing(ImagePromptHooks):
    def init_processing(self, config) -> None:
        self.num_queries = config.latent_query_num
        self.image_token_id = checkpoint_token_id(config, "<image>", _BOI_ID)
        self.end_image_id = checkpoint_token_id(config, "</image>", _EOI_ID)
        self.first_slot_id = checkpoint_special_id(config, "unk_token", _UNK_ID) + 1

    # -- images ----------------------------------------------------------------------------------
    def num_image_tokens(self, num_tiles: int, image_size: tuple[int, int]) -> int:
        return self.num_queries + 2

    def image_run_ids(self, image, placeholder_id: int) -> list[int]:
        return [placeholder_id, *range(self.first_slot_id, self.first_slot_id + self.num_queries), self.end_image_id]

    def format_prompt(self, text: str, num_images: int, tokenizer) -> tuple[str, bool]:
        """Kosmos2Processor's text: BOS, then (for a prompt without `<image>` markers) one marker per
        image before the stripped text; tokenized without special tokens (so no EOS)."""
        text = text.strip()
        if num_images and "<image>" not in text:
            text = " ".join(["<image>"] * num_images) + " " + text
        return (tokenizer.bos_token or "") + text, False

    # -- grounding -------------------------------------------------------------------------------
    def postprocess_text(self, text: str) -> dict:
        """transformers' Kosmos-2 post-processing of generated text: the text without location
        tokens, and entities (phrase, (start, end) in that text, boxes as (x0, y0, x1, y1) in [0, 1])."""
        from transformers.models.kosmos2.processing_kosmos2 import clean_text_and_extract_entities_with_bboxes
        cleaned, entities = clean_text_and_extract_entities_with_bboxes(text.split("</image>")[-1])
        return {"text": cleaned, "entities": [{"phrase": phrase, "span": list(span), "boxes": [list(b) for b in boxes]}
                                              for phrase, span, boxes in entities]}
