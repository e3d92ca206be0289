"""Phi-3-vision's config.json (remote code: transformers cannot read it) as a transformers Phi3Config
carrying the vision settings; read before any model code (models/registry.config_reader)."""
from __future__ import annotations

import json
import os

# The tower the published code hard-codes: openai/clip-vit-large-patch14-336.
CLIP_VIT_L14_336 = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                        image_size=336, patch_size=14, hidden_act="quick_gelu", layer_norm_eps=1e-5,
                        num_channels=3, projection_dim=768)
# -- config ---------------------------------------------------------------------------------------
def load_phi3v_config(directory: str):
    """A transformers Phi3Config for the decoder, carrying the vision settings as attributes."""
    from transformers import CLIPVisionConfig, Phi3Config
    with open(os.path.join(directory, "config.json")) as f:
        raw = json.load(f)
    text = {k: v for k, v in raw.items()
            if k not in ("model_type", "architectures", "auto_map", "img_processor", "embd_layer", "transformers_version")}
    rope = text.get("rope_scaling")
    if isinstance(rope, dict) and rope.get("type") == "su":  # Phi-3-vision's name for longrope
        text["rope_scaling"] = {**{k: v for k, v in rope.items() if k != "type"}, "type": "longrope"}
    config = Phi3Config(**text)
    img = dict(raw.get("img_processor") or {})
    embd = dict(raw.get("embd_layer") or {})
    if img.get("name", "clip_vision_model") != "clip_vision_model":
        raise ValueError(f"Phi-3-vision img_processor {img.get('name')!r} is not supported (clip_vision_model is)")
    checks = {"embedding_cls": "image", "use_hd_transform": True, "with_learnable_separator": True,
              "hd_transform_order": "sub_glb", "projection_cls": "mlp"}
    for key, want in checks.items():
        if embd.get(key, want) != want:
            raise ValueError(f"Phi-3-vision embd_layer.{key}={embd[key]!r} is not supported ({want!r} is)")
    config.vision_config = CLIPVisionConfig(**{**CLIP_VIT_L14_336, **img.get("vision_config", {})})
    if img.get("image_dim_out", config.vision_config.hidden_size) != config.vision_config.hidden_size:
        raise ValueError("Phi-3-vision img_processor.image_dim_out differs from the CLIP tower's hidden size")
    config.img_processor, config.embd_layer = img, embd
    config.image_token_id = raw.get("image_token_id")
    config.architectures = ["Phi3VForCausalLM"]
    return config
