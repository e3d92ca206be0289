"""Pix2Struct (`Pix2StructForConditionalGeneration`; Deplot, chart -> data table): a ViT over
variable-resolution patches in front of a T5-style text decoder, on the engine's encoder-decoder path.

- **Front**: `Pix2StructPromptProcessor` (the model's multimodal processor, found through
  `mm_processor_class`) renders the text prompt as a header above the image (Deplot's "Generate
  underlying data table of the figure below:"; `is_vqa` models), cuts the result into at most
  `max_patches` patches with transformers' Pix2Struct image processor (the aspect ratio kept, so the
  patch grid varies per image), and sends the real patches (row and column ids in their first two
  columns) as the request's one `ImageItem`; the decoder's prompt is its start token. The encoder
  input's identity (image and header) keys the decoder's prefix-cache hashes.
- **Encoder** (batchful, once per request): patch projection + row and column embeddings, pre-norm
  layers (T5LayerNorm, unscaled attention without position bias, gated-GELU MLP), a final norm; all
  of a step's images in one padded batch, each masked to its own patch count.
- **Decoder**: T5's (relative position bias in layer 0, shared; self-attention, cross-attention,
  gated MLP), through the engine's attention and cross-attention ops; an untied LM head, no output
  scaling.

Both sides are built from T5's layers (models/t5/model.py) on splitserve/layers' parallel linear layers:
with tensor parallelism every rank holds its heads of the vision encoder and of the decoder (and its
columns of the relative bias), the embedding and head split by vocabulary rows; a quantization
method applies to the text decoder's layers (the vision encoder stays float, see below).
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from splitserve.attention.cross import CrossAttention
from splitserve.attention.layer import Attention
from splitserve.layers.linear import Linear
from splitserve.layers.parallel_linear import ParallelLMHead, VocabParallelEmbedding
from splitserve.layers.quantization.base import QuantConfig, method_for
from splitserve.models.pix2struct.processor import DEPLOT_PROMPT, Pix2StructPromptProcessor  # noqa: F401 (re-exported)
from splitserve.models.t5.model import (T5Attention, T5LayerNorm, T5MLP, load_named, methods,
                                        relative_position_bucket, tp_logits)

# Pix2Struct's checkpoint names of an attention's q, k, v, o
_NAMES = ("query", "key", "value", "output")


class _Named(nn.Module):
    """A container whose children carry the checkpoint's names."""

    def __init__(self, **children: nn.Module):
        super().__init__()
        for name, child in children.items():
            setattr(self, name, child)


class Pix2StructForConditionalGeneration(nn.Module):
    is_encoder_decoder = True
    is_multimodal = True  # the front builds its processor (mm_processor_class); the encoder takes images

    def __init__(self, config, quant_config: QuantConfig | None = None):
        super().__init__()
        self.config, self.quant_config = config, quant_config
        v, t = config.vision_config, config.text_config
        # The vision encoder is split over the tensor-parallel ranks by heads like the text model
        # (the same T5-style layers), but stays float under quantization, as the engine's other
        # vision towers do (quantization recipes leave vision encoders out): its layers get no method.
        float_layers = methods(None, "")
        layers = [_Named(attention=T5Attention(v.hidden_size, v.num_attention_heads, v.d_kv, float_layers, _NAMES),
                         mlp=T5MLP(v.hidden_size, v.d_ff, v.dense_act_fn, True, float_layers),
                         pre_mlp_layer_norm=T5LayerNorm(v.hidden_size, v.layer_norm_eps),
                         pre_attention_layer_norm=T5LayerNorm(v.hidden_size, v.layer_norm_eps))
                  for _ in range(v.num_hidden_layers)]
        # The patch projection's input is the patch pixels: every rank projects them whole.
        self.encoder = _Named(
            embeddings=_Named(patch_projection=Linear(v.patch_embed_hidden_size, v.hidden_size, bias=True),
                              row_embedder=nn.Embedding(v.seq_len, v.hidden_size),
                              column_embedder=nn.Embedding(v.seq_len, v.hidden_size)),
            encoder=_Named(layer=nn.ModuleList(layers)),
            layernorm=T5LayerNorm(v.hidden_size, v.layer_norm_eps))
        if t.hidden_size % t.num_heads:
            raise ValueError(f"Pix2Struct text hidden_size {t.hidden_size} is not a multiple of num_heads {t.num_heads}")
        self.num_heads, self.head_dim = t.num_heads, t.hidden_size // t.num_heads
        eps = t.layer_norm_epsilon
        blocks = []
        for i in range(t.num_layers):
            at = f"decoder.layer.{i}."
            buckets = t.relative_attention_num_buckets if i == 0 else None
            blocks.append(_Named(
                self_attention=_Named(attention=T5Attention(
                    t.hidden_size, t.num_heads, self.head_dim, methods(quant_config, f"{at}self_attention.attention."),
                    _NAMES, num_buckets=buckets), layer_norm=T5LayerNorm(t.hidden_size, eps)),
                encoder_decoder_attention=_Named(attention=T5Attention(
                    t.hidden_size, t.num_heads, self.head_dim,
                    methods(quant_config, f"{at}encoder_decoder_attention.attention."), _NAMES, cross=True),
                    layer_norm=T5LayerNorm(t.hidden_size, eps)),
                mlp=_Named(DenseReluDense=T5MLP(t.hidden_size, t.d_ff, t.dense_act_fn, True,
                                                methods(quant_config, f"{at}mlp.DenseReluDense.")),
                           layer_norm=T5LayerNorm(t.hidden_size, eps))))
        # As for the decoder-only models, online FP8 leaves the LM head in float (its ignore list).
        self.decoder = _Named(embed_tokens=VocabParallelEmbedding(t.vocab_size, t.hidden_size),
                              layer=nn.ModuleList(blocks), final_layer_norm=T5LayerNorm(t.hidden_size, eps),
                              lm_head=ParallelLMHead(t.hidden_size, t.vocab_size,
                                                     method=method_for(quant_config, "decoder.lm_head")))
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        heads = blocks[0].self_attention.attention.num_heads  # this rank's
        self.self_attn = nn.ModuleList(Attention(i, heads, heads, self.head_dim, 1.0) for i in range(t.num_layers))
        self.cross_attn = nn.ModuleList(CrossAttention(i, heads, heads, self.head_dim, 1.0)
                                        for i in range(t.num_layers))
        self._bias_ready = False

    # the front's processor (multimodal/processor.build_mm_processor)
    @staticmethod
    def mm_processor_class():
        return Pix2StructPromptProcessor

    # -- encoder ---------------------------------------------------------------------------------------
    def encode(self, inputs: list[tuple[list[int], int, tuple]]) -> torch.Tensor:
        """Encoder outputs of a step's requests, flat: each input's image is its real patches
        ([n, 2 + patch pixels]: row id, column id, pixels)."""
        dev, dtype = self.decoder.embed_tokens.weight.device, self.decoder.embed_tokens.weight.dtype
        patches = [items[0].pixel_values[:n].to(dev, dtype) for _, n, items in inputs]
        lens = [p.shape[0] for p in patches]
        x = torch.nn.utils.rnn.pad_sequence(patches, batch_first=True)  # [N, L, 2 + P]
        N, L = x.shape[:2]
        emb = self.encoder.embeddings
        h = (emb.patch_projection(x[..., 2:]) + emb.row_embedder(x[..., 0].long())
             + emb.column_embedder(x[..., 1].long()))
        valid = torch.arange(L, device=dev)[None, :] < torch.tensor(lens, device=dev)[:, None]
        mask = torch.zeros(N, 1, 1, L, device=dev).masked_fill(~valid[:, None, None, :], torch.finfo(torch.float32).min)
        for layer in self.encoder.encoder.layer:
            h = h + layer.attention.bidirectional(layer.pre_attention_layer_norm(h), mask)
            h = h + layer.mlp(layer.pre_mlp_layer_norm(h))
        return self.encoder.layernorm(h)[valid]

    def store_cross_kv(self, hidden: torch.Tensor, slots: torch.Tensor, backend) -> None:
        for block, cross in zip(self.decoder.layer, self.cross_attn):
            k, v = block.encoder_decoder_attention.attention.kv(hidden)
            cross.store(k, v, slots, backend)

    # -- decoder ---------------------------------------------------------------------------------------
    def _ensure_bias_table(self) -> None:
        if self._bias_ready:
            return
        t = self.config.text_config
        max_len = int(getattr(self.config, "max_position_embeddings", None) or 2048) + 1
        d = torch.arange(max_len, device=self.decoder.embed_tokens.weight.device)
        buckets = relative_position_bucket(-d, False, t.relative_attention_num_buckets,
                                           t.relative_attention_max_distance)
        bias = self.decoder.layer[0].self_attention.attention.relative_attention_bias
        table = bias(buckets).t().float().contiguous()  # [this rank's heads, max_len], rows contiguous for the kernels
        for attn in self.self_attn:
            attn.pos_bias = table
        self._bias_ready = True

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        self._ensure_bias_table()
        x = self.decoder.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        for block, attn, cross in zip(self.decoder.layer, self.self_attn, self.cross_attn):
            sub = block.self_attention
            p = sub.attention
            x = x + p.o_proj(attn(*p.qkv(sub.layer_norm(x)), positions))
            sub = block.encoder_decoder_attention
            x = x + sub.attention.o_proj(cross(sub.attention.q_proj(sub.layer_norm(x))))
            x = x + block.mlp.DenseReluDense(block.mlp.layer_norm(x))
        return self.decoder.final_layer_norm(x)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return tp_logits(hidden, self.decoder.embed_tokens, self.decoder.lm_head, self.config.text_config.vocab_size,
                         out)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def wanted():
            for name, tensor in weights:
                if self.quant_config is not None and self.quant_config.skip_tensor(name):
                    continue
                if name == "decoder.lm_head.weight" and self.tied:
                    continue  # a tied head is the embedding (loaded from it below), as in transformers
                yield name, tensor
                if name == "decoder.embed_tokens.weight" and self.tied:
                    yield "decoder.lm_head.weight", tensor
        loaded = load_named(self, wanted(), "Pix2Struct")
        self._bias_ready = False
        return loaded
