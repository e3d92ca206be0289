"""VILA's root config.json and part folders as one HF config (the decoder's, carrying the VILA settings
and the vision config); read before any model code (models/registry.config_reader)."""
from __future__ import annotations

import json
import os

VILA_ARCHITECTURES = ("LlavaLlamaModel", "LlavaLlamaForCausalLM")


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
