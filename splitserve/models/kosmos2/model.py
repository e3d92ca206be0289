"""Kosmos-2 (`Kosmos2ForConditionalGeneration`): a CLIP-style ViT, a latent-query resampler of 64
tokens, and its own text decoder, which is the configurable decoder's `kosmos_2_text_model` family
(sinusoidal positions, LayerNorm, GELU, a LayerNorm inside attention and inside the MLP, inputs
scaled by sqrt(hidden)).

Image stage (batchful, all images of a step at once): ViT (no class-token pooling: every token goes
through `post_layernorm`, then is L2-normalised) -> `image_to_text_projection`: a linear map into the
text width, then one cross-attention whose queries are 64 learned latents and whose keys/values are
the projected image tokens followed by the latents themselves.

Prompt layout (transformers' Kosmos2Processor, `format_prompt`): BOS, `<image>`, 64 image slots (token ids
unk + 1 ... unk + 64, whose embeddings the features replace), `</image>`, the text. One image's run
here is those 66 tokens; the features at `<image>` / `</image>` are those tokens' embeddings, so the
run is one unit for the encoder cache. `<image>` marks an image in text and in token-id prompts.

Grounding: generated `<phrase>` / `<object>` / `<patch_index_NNNN>` tokens become transformers'
post-processed text and entities with bounding boxes (`postprocess_text`, the front's hook).
"""
from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from splitserve.layers.linear import Linear
from splitserve.layers.vision import VisionTower
from splitserve.models.kosmos2.processor import Kosmos2Processing
from splitserve.models.vlm_base import VisionLanguageModel, build_language_model
from splitserve.models.weights import WeightRoute, load_routed_weights
from splitserve.multimodal.processor import to_device_pixels


class LatentQueryResampler(nn.Module):
    """`image_to_text_projection`: [N, tokens, vision hidden] -> [N, latent_query_num, text hidden]."""

    def __init__(self, vision_dim: int, dim: int, num_heads: int, num_queries: int):
        super().__init__()
        self.num_heads = num_heads
        self.dense = Linear(vision_dim, dim, bias=True)
        self.latent_query = nn.Parameter(torch.empty(num_queries, dim), requires_grad=False)
        self.x_attn = nn.Module()
        for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
            setattr(self.x_attn, name, Linear(dim, dim, bias=True))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        x = self.dense(features)
        queries = self.latent_query.expand(x.shape[0], -1, -1)
        context = torch.cat([x, queries], dim=1)
        a = self.x_attn
        q, k, v = (t.unflatten(-1, (self.num_heads, -1)).transpose(1, 2)
                   for t in (a.q_proj(queries), a.k_proj(context), a.v_proj(context)))
        return a.out_proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2))


# Checkpoint name -> module: the text model's tensors to the language model; the ViT's post-norm is
# the model's own (every token goes through it), the rest of the ViT goes to the tower (read whole).
KOSMOS2_WEIGHTS = (
    WeightRoute("text_model.", "text"),
    WeightRoute("vision_model.model.post_layernorm.", "param", "post_layernorm."),
    WeightRoute("vision_model.model.", "tower", "vision_tower"),
    WeightRoute("post_layernorm.", "param", "post_layernorm."),
    WeightRoute("image_to_text_projection.", "param", "image_to_text_projection."),
)


class Kosmos2ForConditionalGeneration(Kosmos2Processing, VisionLanguageModel):
    def __init__(self, config, quant_config=None):
        super().__init__()
        self.config = config
        text = config.text_config
        self.language_model = build_language_model(text, quant_config, "text_model.model", "text_model.lm_head")
        vcfg = config.vision_config
        self.vision_tower = VisionTower(vcfg, vcfg.num_hidden_layers, class_token=True)
        self.post_layernorm = nn.LayerNorm(vcfg.hidden_size, eps=vcfg.layer_norm_eps)
        self.post_layernorm.requires_grad_(False)
        self.image_to_text_projection = LatentQueryResampler(vcfg.hidden_size, text.hidden_size,
                                                             text.num_attention_heads, config.latent_query_num)
        self.init_processing(config)  # queries, token ids (processor.py)

    # -- images ----------------------------------------------------------------------------------
    def encode_images(self, items) -> list[torch.Tensor]:
        pixels = to_device_pixels(items, self._param.device, self._param.dtype)
        feats = F.normalize(self.post_layernorm(self.vision_tower(pixels)), dim=-1)
        latents = self.image_to_text_projection(feats)
        ends = self.language_model.embed(torch.tensor([self.image_token_id, self.end_image_id],
                                                      device=latents.device)).to(latents.dtype)
        return [torch.cat([ends[:1], f, ends[1:]]) for f in latents]

    # -- weights ---------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_routed_weights(self, weights, KOSMOS2_WEIGHTS)
