"""Nougat (`VisionEncoderDecoderModel` with a Swin encoder and an mBART decoder; page image ->
markdown) on the engine's encoder-decoder path.

- **Front** (`NougatPromptProcessor`, the model's multimodal processor): transformers'
  `NougatImageProcessor` from the checkpoint's preprocessor_config.json (crop the margins, resize,
  thumbnail, pad to the configured page size, normalise); the page is the request's one `ImageItem`
  whose `num_tokens` is the encoder's output length (rows x columns of the last Swin stage). The
  decoder starts from the decoder start token, as transformers' generate does for Nougat (its
  processor's text is for training labels, not a prompt): text a request carries is ignored.
- **Encoder** (batchful, once per request): the Swin encoder (models/nougat/swin.py) over a step's pages in
  one batch, then `enc_to_dec_proj` where the widths differ (VisionEncoderDecoderModel's rule).
- **Decoder**: the engine's decoder (models/decoder.py) of the `mbart` family with a cross-attention
  block per layer (`DecoderCrossAttention`: the cross-attention op over the K/V stored once per
  request), its LM head untied.
- **Markdown**: transformers' Nougat post-processing (`post_process_generation`: repetition cut,
  hallucinated references, tables, markdown fixes) of a finished text is `CompletionOutput.markdown`
  and the API choices' `markdown` field; the returned text stays the model's own (what streaming
  sends). It needs the optional packages `levenshtein` and `nltk` (`pip install splitserve[nougat]`);
  without them the field is absent and a warning says why.

The registry picks this class for `VisionEncoderDecoderModel` by its encoder/decoder model types
(`supported_pair`); other pairs are refused by name.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from torch import nn

from splitserve.layers.linear import Linear
from splitserve.layers.quantization.base import as_tensor
from splitserve.models.decoder import DecoderForCausalLM
from splitserve.models.nougat.processor import NougatPromptProcessor
from splitserve.models.nougat.swin import SwinEncoder, swin_output_grid

logger = logging.getLogger(__name__)

ENCODERS = ("donut-swin", "swin")
DECODERS = ("mbart",)


def supported_pair(config) -> None:
    enc = getattr(getattr(config, "encoder", None), "model_type", None)
    dec = getattr(getattr(config, "decoder", None), "model_type", None)
    if enc not in ENCODERS or dec not in DECODERS:
        raise ValueError(f"VisionEncoderDecoderModel with encoder {enc!r} and decoder {dec!r} is not supported; "
                         f"supported: encoders {', '.join(ENCODERS)} with decoders {', '.join(DECODERS)} (Nougat)")


def decoder_start_token_id(config) -> int:
    """What transformers' generate starts the decoder from: the config's decoder_start_token_id,
    else the decoder's, else BOS."""
    dec = config.decoder
    for value in (getattr(config, "decoder_start_token_id", None), getattr(dec, "decoder_start_token_id", None),
                  getattr(config, "bos_token_id", None), getattr(dec, "bos_token_id", None)):
        if value is not None:
            return int(value)
    return 0


def load_vision_encoder_decoder_config(directory: str):
    """The checkpoint's config with the decoder's sizes copied to the top level, where the engine
    sizes the KV cache, the vocabulary and the context (mBART's own num_hidden_layers and
    num_attention_heads name its encoder's: the decoder's fields are read here)."""
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(directory)
    supported_pair(config)
    dec = config.decoder
    heads = dec.decoder_attention_heads
    top = dict(hidden_size=dec.d_model, num_hidden_layers=dec.decoder_layers, num_attention_heads=heads,
               num_key_value_heads=heads, head_dim=dec.d_model // heads, vocab_size=dec.vocab_size,
               max_position_embeddings=dec.max_position_embeddings, decoder_start_token_id=decoder_start_token_id(config))
    for key in ("eos_token_id", "bos_token_id", "pad_token_id"):
        if getattr(config, key, None) is None:
            top[key] = getattr(dec, key, None)
    for key, value in top.items():
        setattr(config, key, value)
    config.is_encoder_decoder = True
    return config


def load_mbart_config(directory: str):
    """An mBART config (`MBartForCausalLM` served alone: the `mbart` decoder family) with the
    decoder's head layout at the top level, where the engine sizes the KV cache: mBART's own
    num_attention_heads is its encoder's."""
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(directory)
    config.head_dim = config.d_model // config.decoder_attention_heads
    config.num_key_value_heads = config.decoder_attention_heads
    return config


class NougatForConditionalGeneration(nn.Module):
    is_encoder_decoder = True
    is_multimodal = True  # the front builds its processor (mm_processor_class); the encoder takes images

    def __init__(self, config, quant_config=None):
        super().__init__()
        supported_pair(config)
        self.config = config
        enc, dec = config.encoder, config.decoder
        self.encoder = SwinEncoder(enc)
        if self.encoder.hidden_size != dec.d_model and getattr(dec, "cross_attention_hidden_size", None) is None:
            # float and whole on every rank, as the Swin encoder before it (models/nougat/swin.py)
            self.enc_to_dec_proj = Linear(self.encoder.hidden_size, dec.d_model, bias=True)
        else:
            self.enc_to_dec_proj = None
        self.decoder = DecoderForCausalLM(dec, quant_config, prefix="decoder.model", head_name="decoder.lm_head",
                                          cross_attention=True)
        self.decoder_start_token_id = decoder_start_token_id(config)
        self._markdown = None

    # the front's processor (multimodal/processor.build_mm_processor)
    @staticmethod
    def mm_processor_class():
        return NougatPromptProcessor

    def num_encoder_tokens(self, height: int, width: int) -> int:
        rows, cols = swin_output_grid(self.config.encoder, height, width)
        return rows * cols

    # -- encoder ---------------------------------------------------------------------------------------
    def encode(self, inputs: list[tuple[list[int], int, tuple]]) -> torch.Tensor:
        """Encoder outputs of a step's requests, flat in order: each input's one image is its page
        pixels [1, 3, H, W]. Pages of one size (the processor pads to the configured size) run as
        one batch."""
        w = self.encoder.embeddings.patch_embeddings.projection.weight
        pixels = [items[0].pixel_values.to(w.device, w.dtype) for _, _, items in inputs]
        by_shape: dict[tuple, list[int]] = {}
        for i, p in enumerate(pixels):
            by_shape.setdefault(tuple(p.shape[1:]), []).append(i)
        outs: list[torch.Tensor | None] = [None] * len(pixels)
        for idx in by_shape.values():
            hidden = self.encoder(torch.cat([pixels[i] for i in idx]))
            for i, h in zip(idx, hidden.unbind(0)):
                outs[i] = h
        for (_, n, _), h in zip(inputs, outs):
            if h.shape[0] != n:
                raise ValueError(f"Nougat encoder gave {h.shape[0]} positions for an input of {n}")
        hidden = torch.cat(outs)
        return hidden if self.enc_to_dec_proj is None else self.enc_to_dec_proj(hidden)

    def store_cross_kv(self, hidden: torch.Tensor, slots: torch.Tensor, backend) -> None:
        for layer in self.decoder.layers:
            layer.cross_attn.store(hidden, slots, backend)

    # -- decoder ---------------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        return self.decoder(input_ids, positions, inputs_embeds)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.decoder.compute_logits(hidden, out)

    # -- the front's markdown (engine/output_processor.py) -----------------------------------------
    def postprocess_markdown(self, text: str) -> str | None:
        """transformers' Nougat post-processing of a finished text; None without its optional
        dependencies (levenshtein, nltk)."""
        if self._markdown is None:
            from transformers.utils import is_levenshtein_available, is_nltk_available
            if not (is_levenshtein_available() and is_nltk_available()):
                logger.warning("Nougat markdown post-processing needs the packages levenshtein and nltk "
                               "(pip install 'splitserve[nougat]'); responses carry no markdown field")
                self._markdown = False
            else:
                from transformers import NougatTokenizer
                self._markdown = NougatTokenizer()  # the post-processing reads no vocabulary
        return None if self._markdown is False else self._markdown.post_process_generation(text)

    # -- weights -----------------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        own = {} if self.enc_to_dec_proj is None else dict(self.enc_to_dec_proj.named_parameters())
        loaded: set[str] = set()

        def decoder_weights():
            for name, tensor in weights:
                if name.startswith("decoder."):
                    yield name[len("decoder."):], tensor
                elif name.startswith("encoder."):
                    filled = self.encoder.load_weight(name[len("encoder."):], as_tensor(tensor))
                    if filled is not None:
                        loaded.add(f"encoder.{filled}")
                elif name.startswith("enc_to_dec_proj.") and name[len("enc_to_dec_proj."):] in own:
                    self.enc_to_dec_proj.load(name[len("enc_to_dec_proj."):], as_tensor(tensor))
                    loaded.add(name)
                else:
                    raise ValueError(f"unexpected Nougat checkpoint tensor {name!r}")
        loaded |= {f"decoder.{n}" for n in self.decoder.load_weights(decoder_weights())}
        return loaded
