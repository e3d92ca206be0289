"""VILA1.5 (`LlavaLlamaModel`), in VILA's own checkpoint layout:

    config.json          architectures ["LlavaLlamaModel"], mm_* settings
    llm/                 a Llama checkpoint (config, safetensors, tokenizer)
    vision_tower/        a SigLIP vision model (config, safetensors, preprocessor_config.json)
    mm_projector/        config.json (mm_projector_type) + safetensors (`layers.<i>.*`)

VILA1.5-3B: SigLIP-so400m at 384 px (27x27 patches), hidden state of the second-to-last layer
with every token kept ("cls_patch"; SigLIP has no class token), the `mlp_downsample` projector
(2x2 neighbouring patches concatenated -> 14x14 = 196 tokens per image), and a Llama decoder.
Config reader: config.py; the front's hooks: processor.py.
"""
from __future__ import annotations

import os
from typing import Iterable, Iterator

import torch

from splitserve.layers.vision import DownsampleMlpProjector, VisionTower
from splitserve.models.vila.processor import VilaProcessing
from splitserve.models.vlm_base import VisionLanguageModel, build_language_model
from splitserve.models.weights import WeightRoute, load_routed_weights
from splitserve.loading.safetensors_io import iter_safetensors

_PARTS = ("llm", "vision_tower", "mm_projector")
# Checkpoint name (part folder first, iter_vila_weights) -> module.
VILA_WEIGHTS = (
    WeightRoute("llm.", "text"),
    WeightRoute("vision_tower.", "tower", "vision_tower"),  # replicated on every rank: read whole
    WeightRoute("mm_projector.", "param", "mm_projector."),
)


def iter_vila_weights(directory: str, lazy: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Every part's safetensors, names prefixed with the part's folder."""
    for part in _PARTS:
        for name, tensor in iter_safetensors(os.path.join(directory, part), lazy=lazy):
            yield f"{part}.{name}", tensor


class VilaForConditionalGeneration(VilaProcessing, VisionLanguageModel):
    iter_weights = staticmethod(iter_vila_weights)

    def __init__(self, config, quant_config=None):
        super().__init__()
        self.config = config
        self.language_model = build_language_model(config, quant_config, "llm.model", "llm.lm_head")
        self.vision_tower = VisionTower(config.vision_config, config.mm_vision_select_layer)
        if config.mm_projector_type != "mlp_downsample":
            raise ValueError(f"VILA projector {config.mm_projector_type!r} is not supported (mlp_downsample is)")
        self.mm_projector = DownsampleMlpProjector(config.vision_config.hidden_size, config.hidden_size)
        self.init_processing(config)  # skip_first, tokens_per_image, image token (processor.py)

    def tile_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[N, 3, H, W] -> [N, tokens, text hidden]."""
        return self.mm_projector(self.vision_tower(pixel_values)[:, self.skip_first:])

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_routed_weights(self, weights, VILA_WEIGHTS)
