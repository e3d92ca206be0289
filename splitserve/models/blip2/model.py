"""BLIP-2 (`Blip2ForConditionalGeneration`) with a decoder-only language model (OPT).

The image stage is `Blip2VisionSide`, batchful like every vision tower here: all images of a step go
through it as one batch [N, 3, H, W] -> [N, num_query_tokens, text hidden]:

  EVA ViT (class token, learned positions, pre-norm layers with one merged qkv projection, a
  post-norm on every token)  ->  Q-Former (BERT-style post-norm layers over the learned query
  tokens; cross-attention to the ViT's tokens every `cross_attention_frequency` layers)  ->
  `language_projection` (one linear map into the decoder's width).

It knows nothing of the language model, so an encoder-decoder BLIP-2 (T5) reuses it as is.
Parameter names are the checkpoint's (`vision_model.*`, `query_tokens`, `qformer.*`,
`language_projection.*`), so weights load by name.

Prompt layout (transformers' Blip2Processor): the image's query tokens come first, before BOS. A
prompt without image markers gets its image runs put there (`arrange_prompt`, the processor's hook);
`<image>` markers elsewhere in a prompt place images where they stand (several images per prompt).
"""
from __future__ import annotations

import re
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from splitserve.layers.linear import Linear
from splitserve.layers.quantization.base import copy_checkpoint_tensor
from splitserve.layers.vision import VisionEncoderLayer, activation, layer_norm
from splitserve.models.blip2.processor import Blip2Processing
from splitserve.models.vlm_base import VisionLanguageModel, build_language_model
from splitserve.models.weights import WeightRoute, load_routed_weights
from splitserve.multimodal.processor import to_device_pixels


def _heads(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[B, L, H*D] -> [B, H, L, D]"""
    return x.unflatten(-1, (num_heads, -1)).transpose(1, 2)


# -- EVA ViT -----------------------------------------------------------------------------------------
class Blip2VisionAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int, qkv_bias: bool):
        super().__init__()
        self.num_heads = num_heads
        # The checkpoint's qkv bias is [q_bias; 0; v_bias] (no key bias): one bias vector works.
        self.qkv = Linear(dim, 3 * dim, bias=qkv_bias)
        self.projection = Linear(dim, dim, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (_heads(t, self.num_heads) for t in self.qkv(x).chunk(3, dim=-1))
        out = F.scaled_dot_product_attention(q, k, v)
        return self.projection(out.transpose(1, 2).flatten(2))


class Blip2VisionModel(nn.Module):
    """[N, 3, S, S] -> [N, 1 + patches, hidden]: every token after the post-norm (the Q-Former reads all)."""

    def __init__(self, config):
        super().__init__()
        dim = config.hidden_size
        self.image_size = config.image_size
        self.embeddings = nn.Module()
        self.embeddings.class_embedding = nn.Parameter(torch.empty(1, 1, dim), requires_grad=False)
        self.embeddings.patch_embedding = nn.Conv2d(3, dim, config.patch_size, config.patch_size)
        self.embeddings.patch_embedding.requires_grad_(False)
        num_positions = (config.image_size // config.patch_size) ** 2 + 1
        self.embeddings.position_embedding = nn.Parameter(torch.empty(1, num_positions, dim), requires_grad=False)
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(
            VisionEncoderLayer(config, Blip2VisionAttention(config.hidden_size, config.num_attention_heads,
                                                            getattr(config, "qkv_bias", True)))
            for _ in range(config.num_hidden_layers))
        self.post_layernorm = layer_norm(dim, config.layer_norm_eps)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        emb = self.embeddings
        if pixel_values.shape[-2:] != (self.image_size, self.image_size):
            raise ValueError(f"BLIP-2 vision tower takes {self.image_size}x{self.image_size} images, got "
                             f"{tuple(pixel_values.shape[-2:])}")
        x = emb.patch_embedding(pixel_values.to(emb.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        x = torch.cat([emb.class_embedding.expand(x.shape[0], 1, -1), x], dim=1) + emb.position_embedding
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)


# -- Q-Former ----------------------------------------------------------------------------------------
class QFormerAttention(nn.Module):
    """Multi-head attention + BERT's output block (dense, residual, LayerNorm): `attention.{query,key,
    value}` and `output.{dense,LayerNorm}` as in the checkpoint. Keys and values come from `context`
    (the ViT's tokens, of width kv_dim) for cross-attention, else from x."""

    def __init__(self, dim: int, kv_dim: int, num_heads: int, eps: float):
        super().__init__()
        self.num_heads = num_heads
        self.attention = nn.Module()
        self.attention.query = Linear(dim, dim, bias=True)
        self.attention.key = Linear(kv_dim, dim, bias=True)
        self.attention.value = Linear(kv_dim, dim, bias=True)
        self.output = nn.Module()
        self.output.dense = Linear(dim, dim, bias=True)
        self.output.LayerNorm = layer_norm(dim, eps)

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
        a = self.attention
        src = x if context is None else context
        q, k, v = _heads(a.query(x), self.num_heads), _heads(a.key(src), self.num_heads), _heads(a.value(src), self.num_heads)
        out = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)
        return self.output.LayerNorm(self.output.dense(out) + x)


class QFormerLayer(nn.Module):
    def __init__(self, config, has_cross_attention: bool):
        super().__init__()
        dim, heads, eps = config.hidden_size, config.num_attention_heads, config.layer_norm_eps
        self.attention = QFormerAttention(dim, dim, heads, eps)
        self.crossattention = (QFormerAttention(dim, config.encoder_hidden_size, heads, eps)
                               if has_cross_attention else None)
        # The query tokens' feed-forward (the text branch's `intermediate`/`output` never runs here).
        self.intermediate_query = nn.Module()
        self.intermediate_query.dense = Linear(dim, config.intermediate_size, bias=True)
        self.output_query = nn.Module()
        self.output_query.dense = Linear(config.intermediate_size, dim, bias=True)
        self.output_query.LayerNorm = layer_norm(dim, eps)
        self.act = activation(config.hidden_act)

    def forward(self, x: torch.Tensor, image: torch.Tensor) -> torch.Tensor:
        x = self.attention(x)
        if self.crossattention is not None:
            x = self.crossattention(x, image)
        h = self.output_query.dense(self.act(self.intermediate_query.dense(x)))
        return self.output_query.LayerNorm(h + x)


class QFormer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layernorm = layer_norm(config.hidden_size, config.layer_norm_eps)
        freq = config.cross_attention_frequency
        self.encoder = nn.Module()
        self.encoder.layer = nn.ModuleList(QFormerLayer(config, i % freq == 0) for i in range(config.num_hidden_layers))

    def forward(self, queries: torch.Tensor, image: torch.Tensor) -> torch.Tensor:
        x = self.layernorm(queries)
        for layer in self.encoder.layer:
            x = layer(x, image)
        return x


class Blip2VisionSide(nn.Module):
    """ViT + Q-Former + projection: [N, 3, S, S] -> [N, num_query_tokens, out_dim]."""

    # Checkpoint tensors this side never uses: the Q-Former's text branch (`intermediate`/`output`
    # of its layers, its word/position embeddings), which only text inputs to the Q-Former run.
    _UNUSED = re.compile(r"^qformer\.(encoder\.layer\.\d+\.(intermediate|output)\.|embeddings\.)")

    def __init__(self, config, out_dim: int):
        super().__init__()
        qcfg = config.qformer_config
        if getattr(qcfg, "use_qformer_text_input", False):
            raise ValueError("BLIP-2 with Q-Former text input (InstructBLIP-style) is not supported")
        qcfg.encoder_hidden_size = config.vision_config.hidden_size
        self.num_query_tokens = config.num_query_tokens
        self.vision_model = Blip2VisionModel(config.vision_config)
        self.query_tokens = nn.Parameter(torch.empty(1, config.num_query_tokens, qcfg.hidden_size), requires_grad=False)
        self.qformer = QFormer(qcfg)
        self.language_projection = Linear(qcfg.hidden_size, out_dim, bias=True)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        image = self.vision_model(pixel_values)
        queries = self.qformer(self.query_tokens.expand(image.shape[0], -1, -1), image)
        return self.language_projection(queries)

    def load_weight(self, name: str, tensor: torch.Tensor) -> str | None:
        """One checkpoint tensor by its name under the model (`vision_model.…`, `qformer.…`, ...);
        the parameter filled, or None for a deliberately unused one; anything else is an error."""
        if self._UNUSED.search(name):
            return None
        layer_bias = re.match(r"(vision_model\.encoder\.layers\.\d+\.self_attn)\.(q|v)_bias$", name)
        params = dict(self.named_parameters())
        if layer_bias:  # older checkpoints keep the qkv bias as q_bias / v_bias (the key has none)
            bias = params[f"{layer_bias.group(1)}.qkv.bias"]
            dim = bias.shape[0] // 3
            part = bias.data[:dim] if layer_bias.group(2) == "q" else bias.data[2 * dim:]
            part.copy_(tensor)
            bias.data[dim:2 * dim].zero_()
            return f"{layer_bias.group(1)}.qkv.bias"
        if name not in params:
            raise ValueError(f"checkpoint tensor {name!r} matches no parameter of the BLIP-2 vision side")
        copy_checkpoint_tensor(params[name], tensor, name)
        return name


VISION_SIDE_PREFIXES = ("vision_model.", "query_tokens", "qformer.", "language_projection.")
# Checkpoint name -> module: the language model's tensors to it, the vision side's (replicated on
# every rank: read whole) to Blip2VisionSide.load_weight under their full names.
BLIP2_WEIGHTS = (WeightRoute("language_model.", "text"),
                 *(WeightRoute(p, "tower", "vision_side", whole_name=True) for p in VISION_SIDE_PREFIXES))


class Blip2Common(Blip2Processing):
    """What both BLIP-2 language models share: the front's hooks (processor.py; the T5 variant gets
    them here too) and the weight routing (vision side here, the rest to the language model)."""

    vision_side: Blip2VisionSide

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_routed_weights(self, weights, BLIP2_WEIGHTS)


class Blip2ForConditionalGeneration(Blip2Common, VisionLanguageModel):
    def __init__(self, config, quant_config=None):
        super().__init__()
        self.config = config
        if not getattr(config, "use_decoder_only_language_model", True) or \
                getattr(config.text_config, "is_encoder_decoder", False):
            raise ValueError("BLIP-2 with an encoder-decoder language model (T5) is built by "
                             "models/blip2_t5.py (the registry picks it by text_config.model_type)")
        self.language_model = build_language_model(config.text_config, quant_config, "language_model.model",
                                                   "language_model.lm_head")
        self.vision_side = Blip2VisionSide(config, config.text_config.hidden_size)
        self.init_processing(config)  # image token, num_query_tokens (processor.py)

    # -- images ----------------------------------------------------------------------------------
    def encode_images(self, items) -> list[torch.Tensor]:
        feats = self.vision_side(to_device_pixels(items, self._param.device, self._param.dtype))
        return list(feats.unbind(0))
