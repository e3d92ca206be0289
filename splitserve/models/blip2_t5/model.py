"""BLIP-2 with a Flan-T5 language model (`Blip2ForConditionalGeneration` whose text_config is T5):
the BLIP-2 vision side in front of T5 on the engine's encoder-decoder path.

- **Prompt** (the generic multimodal processor, as for BLIP-2 OPT): the image's query-token
  placeholders first, then the tokenized text (Blip2Processor's layout; `<image>` markers place
  images elsewhere). That whole prompt is the *encoder's* input (`encoder_prompt_has_images`: the
  front sends its ids as `encoder_prompt_ids`, its images as the request's `mm_items`); the decoder
  starts from the T5 decoder start token.
- **Encoder** (once per request, worker/encoder_decoder.py): all images of a step through
  `Blip2VisionSide` in one batch ([N, num_query_tokens, d_model]), written over the token
  embeddings of their placeholder runs, then T5's encoder on those embeddings (`encode_embeds`):
  what transformers' generate does (masked_scatter of the projected queries into
  embed(input_ids), then the T5 encoder on inputs_embeds).
- **Decoder**: T5's, unchanged (models/t5/model.py), with its quantization and tensor parallelism.
"""
from __future__ import annotations


import torch
from torch import nn

from splitserve.models.blip2.model import Blip2Common, Blip2VisionSide
from splitserve.models.t5.model import T5ForConditionalGeneration
from splitserve.multimodal.processor import to_device_pixels


class Blip2T5ForConditionalGeneration(Blip2Common, nn.Module):
    is_encoder_decoder = True
    is_multimodal = True
    # The front's prompt (placeholder runs + text ids) is the encoder's input, not the decoder's.
    encoder_prompt_has_images = True

    def __init__(self, config, quant_config=None):
        super().__init__()
        self.config = config
        # The language model takes the quantization and its tensor-parallel part (models/t5/model.py); the
        # vision side stays float and whole on every rank, as BLIP-2 OPT's does.
        self.language_model = T5ForConditionalGeneration(config.text_config, quant_config, prefix="language_model.")
        self.vision_side = Blip2VisionSide(config, config.text_config.d_model)
        self.image_token_id = getattr(config, "image_token_index", None)
        self.num_query_tokens = config.num_query_tokens

    # -- encoder ---------------------------------------------------------------------------------------
    def encode(self, inputs: list[tuple[list[int], int, tuple]]) -> torch.Tensor:
        """Encoder outputs of a step's requests, flat: each input is (encoder ids with placeholder
        runs, their count, the images whose runs they hold)."""
        lm = self.language_model
        dev, dtype = lm.shared.weight.device, lm.shared.weight.dtype
        items = [it for _, _, its in inputs for it in its]
        feats = iter(self.vision_side(to_device_pixels(items, dev, dtype)).unbind(0)) if items else iter(())
        embeds = []
        for ids, n, its in inputs:
            if len(ids) != n:
                raise ValueError(f"BLIP-2 T5 encoder input has {len(ids)} ids for {n} positions")
            x = lm.shared(torch.tensor(ids, dtype=torch.long, device=dev))
            for it in its:
                f = next(feats)
                if it.num_tokens != f.shape[0]:
                    raise ValueError(f"image run of {it.num_tokens} positions for {f.shape[0]} query tokens")
                x = torch.cat([x[:it.offset], f.to(x.dtype), x[it.offset + it.num_tokens:]])
            embeds.append(x)
        return lm.encode_embeds(embeds)

    def store_cross_kv(self, hidden: torch.Tensor, slots: torch.Tensor, backend) -> None:
        self.language_model.store_cross_kv(hidden, slots, backend)

    # -- decoder ---------------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        return self.language_model(input_ids, positions, inputs_embeds)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.language_model.compute_logits(hidden, out)

