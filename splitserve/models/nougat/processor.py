"""Nougat's front side (the model's multimodal processor): a page image through transformers'
NougatImageProcessor (models/nougat/model.py describes the whole model)."""
from __future__ import annotations

from splitserve.models.encoder_image_prompt import EncoderImagePromptProcessor


class NougatPromptProcessor(EncoderImagePromptProcessor):
    """One page image per request through transformers' Nougat image processor; the decoder prompt
    is the start token. A token-id prompt marks its image with the pad id (the benchmarks' contract)."""
    model_name = "Nougat"

    def __init__(self, model, model_directory: str, tokenizer):
        super().__init__(model, model_directory, tokenizer)
        self.decoder_start_token_id = model.decoder_start_token_id
        pad = getattr(model.config.decoder, "pad_token_id", None)
        self.placeholder_id = pad if pad is not None else 1

    def encoder_item(self, img, img_hash: str, text: str):
        """The page's pixels [1, 3, H, W]; the text is not an input of Nougat."""
        from splitserve.protocol.mm_inputs import ImageItem
        pixels = self.image_processor(images=[img.convert("RGB")], return_tensors="pt")["pixel_values"]
        n = self.model.num_encoder_tokens(*pixels.shape[-2:])
        return ImageItem(img_hash, pixels.contiguous(), (img.size[1], img.size[0]), n, 0)
