"""CogVLM's config.json (remote code: transformers cannot read it) as a LlamaConfig carrying the
vision settings; read before any model code (models/registry.config_reader)."""
from __future__ import annotations

import json
import os


def load_cogvlm_config(directory: str):
    """A LlamaConfig for the decoder, carrying the vision settings as `vision_config` (a dict)."""
    from transformers import LlamaConfig
    with open(os.path.join(directory, "config.json")) as f:
        raw = json.load(f)
    keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "rms_norm_eps",
            "vocab_size", "max_position_embeddings", "bos_token_id", "eos_token_id", "pad_token_id",
            "tie_word_embeddings", "hidden_act", "torch_dtype")
    config = LlamaConfig(**{k: raw[k] for k in keys if k in raw}, rope_theta=raw.get("rope_theta", 10000.0),
                         num_key_value_heads=raw["num_attention_heads"], attention_bias=False, mlp_bias=False)
    config.vision_config = dict(raw["vision_config"])
    config.template_version = raw.get("template_version", "chat")
    config.architectures = ["CogVLMForCausalLM"]
    return config
