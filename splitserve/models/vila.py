"""VILA1.5 (`LlavaLlamaModel`), in VILA's own checkpoint layout:

    config.json          architectures ["LlavaLlamaModel"], mm_* settings
    llm/                 a Llama checkpoint (config, safetensors, tokenizer)
    vision_tower/        a SigLIP vision model (config, safetensors, preprocessor_config.json)
    mm_projector/        config.json (mm_projector_type) + safetensors (`layers.<i>.*`)

VILA1.5-3B: SigLIP-so400m at 384 px (27x27 patches), hidden state of the second-to-last layer
with every token kept ("cls_patch"; SigLIP has no class token), the `mlp_downsample` projector
(2x2 neighbouring patches concatenated -> 14x14 = 196 tokens per image), and a Llama decoder.
"""
from __future__ import annotations

import json
import os
from typing import Iterable, Iterator

import torch

from splitserve.layers.quantization.base import as_tensor
from splitserve.layers.vision import DownsampleMlpProjector, VisionTower
from splitserve.models.vlm_base import VisionLanguageModel, build_language_model
from splitserve.loading.safetensors_io import iter_safetensors

VILA_ARCHITECTURES = ("LlavaLlamaModel", "LlavaLlamaForCausalLM")
_PARTS = ("llm", "vision_tower", "mm_projector")


def is_vila_dir(directory: str) -> bool:
    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path) or not os.path.isdir(os.path.join(directory, "llm")):
        return False
    with open(path) as f:
        cfg = json.load(f)
    return cfg.get("model_type") == "llava_llama" or any(a in VILA_ARCHITECTURES for a in cfg.get("architectures") or [])


def load_vila_config(directory: str):
    """The decoder's HF config, carrying the VILA settings and the vision config as attributes, so
    the engine reads layer counts, heads and vocabulary from it as for a text model."""
    from transformers import AutoConfig
    with open(os.path.join(directory, "config.json")) as f:
        root = json.load(f)
    config = AutoConfig.from_pretrained(os.path.join(directory, "llm"))
    config.vision_config = AutoConfig.from_pretrained(os.path.join(directory, "vision_tower"))
    if getattr(config.vision_config, "vision_config", None) is not None:  # a full SigLIP config
        config.vision_config = config.vision_config.vision_config
    projector_cfg = os.path.join(directory, "mm_projector", "config.json")
    projector_type = root.get("mm_projector_type")
    if os.path.isfile(projector_cfg):
        with open(projector_cfg) as f:
            projector_type = json.load(f).get("mm_projector_type", projector_type)
    config.mm_projector_type = projector_type or "mlp_downsample"
    config.mm_vision_select_layer = root.get("mm_vision_select_layer", -2)
    config.mm_vision_select_feature = root.get("mm_vision_select_feature", "cls_patch")
    config.image_token_id = root.get("image_token_id")
    config.architectures = ["LlavaLlamaModel"]
    return config


def iter_vila_weights(directory: str, lazy: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Every part's safetensors, names prefixed with the part's folder."""
    for part in _PARTS:
        for name, tensor in iter_safetensors(os.path.join(directory, part), lazy=lazy):
            yield f"{part}.{name}", tensor


class VilaForConditionalGeneration(VisionLanguageModel):
    image_processor_subfolder = "vision_tower"
    iter_weights = staticmethod(iter_vila_weights)

    def __init__(self, config, quant_config=None):
        super().__init__()
        self.config = config
        self.language_model = build_language_model(config, quant_config, "llm.model", "llm.lm_head")
        self.vision_tower = VisionTower(config.vision_config, config.mm_vision_select_layer)
        if config.mm_projector_type != "mlp_downsample":
            raise ValueError(f"VILA projector {config.mm_projector_type!r} is not supported (mlp_downsample is)")
        self.mm_projector = DownsampleMlpProjector(config.vision_config.hidden_size, config.hidden_size)
        if config.mm_vision_select_feature not in ("cls_patch", "patch"):
            raise ValueError(f"unsupported mm_vision_select_feature {config.mm_vision_select_feature!r}")
        self.skip_first = int(config.mm_vision_select_feature == "patch")
        side = int(round((self.vision_tower.num_patches + int(self.vision_tower.is_clip) - self.skip_first) ** 0.5))
        self.tokens_per_image = ((side + 1) // 2) ** 2
        # None: the processor takes the tokenizer's <image> token if it has one, else token 0.
        self.image_token_id = config.image_token_id

    def num_image_tokens(self, num_tiles: int, image_size: tuple[int, int]) -> int:
        return self.tokens_per_image

    def tile_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[N, 3, H, W] -> [N, tokens, text hidden]."""
        return self.mm_projector(self.vision_tower(pixel_values)[:, self.skip_first:])

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded: set[str] = set()
        projector = dict(self.mm_projector.named_parameters())

        def text_weights():
            for name, tensor in weights:
                part, _, rest = name.partition(".")
                if part == "llm":
                    yield rest, tensor
                elif part == "vision_tower":  # replicated on every rank: read whole
                    filled = self.vision_tower.load_weight(rest, as_tensor(tensor))
                    if filled:
                        loaded.add(f"vision_tower.{filled}")
                elif part == "mm_projector" and rest in projector:
                    if projector[rest].shape != tensor.shape:
                        raise ValueError(f"mm_projector {rest}: checkpoint shape {tuple(tensor.shape)} != "
                                         f"{tuple(projector[rest].shape)}")
                    projector[rest].data.copy_(as_tensor(tensor))
                    loaded.add(f"mm_projector.{rest}")
                else:
                    raise ValueError(f"checkpoint tensor {name!r} matches no parameter of {type(self).__name__}")

        loaded |= {f"language_model.{n}" for n in self.language_model.load_weights(text_weights())}
        return loaded

