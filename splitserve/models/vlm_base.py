"""The base class of the decoder-only vision-language models (LLaVA, VILA, Phi-3-vision, CogVLM,
BLIP-2 OPT, Fuyu, Kosmos-2, NeVA): the decoder-facing half they share. Their front-side half (prompt
expansion, image processing: models/<name>/processor.py) derives from models/prompt_hooks.py's
ImagePromptHooks, which VisionLanguageModel carries too, so every hook has its "not used" default.
"""
from __future__ import annotations

import torch
from torch import nn

from splitserve.models.decoder import DecoderForCausalLM
from splitserve.models.prompt_hooks import ImagePromptHooks
from splitserve.multimodal.processor import to_device_pixels


def build_language_model(text_config, quant_config=None, prefix: str = "model.language_model",
                         head_name: str = "lm_head") -> DecoderForCausalLM:
    """The decoder, of whichever family text_config's model_type names; a quantization config
    applies to it alone (the vision tower and projector stay in the model's dtype)."""
    return DecoderForCausalLM(text_config, quant_config, prefix, head_name)


class VisionLanguageModel(ImagePromptHooks, nn.Module):
    """The decoder-facing half shared by every VLM: the engine sees a causal LM with `layers`,
    `embed`, `forward(input_ids, positions, inputs_embeds)` and `compute_logits`."""

    language_model: DecoderForCausalLM

    @property
    def layers(self) -> nn.ModuleList:  # the runner compiles / graphs the decoder layers
        return self.language_model.layers

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.language_model.embed(input_ids)

    # The piecewise CUDA graphs (worker/cuda_graphs.py) run the decoder in segments: they need its
    # start (embeddings -> layer 0's stream), its final norm and its width.
    def start(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.language_model.start(x, positions)

    @property
    def norm(self) -> nn.Module:
        return self.language_model.norm

    @property
    def hidden_size(self) -> int:
        return self.language_model.spec.hidden_size

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, inputs_embeds: torch.Tensor | None = None,
                intermediate=None):
        return self.language_model(input_ids, positions, inputs_embeds, intermediate)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.language_model.compute_logits(hidden, out)

    @property
    def _param(self) -> torch.Tensor:
        return self.language_model.embed_tokens.weight

    def encode_images(self, items) -> list[torch.Tensor]:
        """Every tile of the step's images in one batch through the model's `tile_features` ([N, 3, H, W]
        -> [N, tokens, text hidden]); each item's tiles' features, flat. Models that arrange tiles
        (LLaVA-NeXT's grid) override this."""
        feats = self.tile_features(to_device_pixels(items, self._param.device, self._param.dtype))
        return [f.reshape(-1, f.shape[-1]) for f in feats.split([it.pixel_values.shape[0] for it in items])]
