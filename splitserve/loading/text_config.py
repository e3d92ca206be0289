"""Llama-family configs read straight from config.json, without transformers' config classes.

Why: importing `transformers.LlamaConfig` imports much of transformers with it (on the GPU image:
torchvision, torch._dynamo through it, scikit-learn; ~10 s of a 60 s cold start), and the engine
reads only a dozen plain fields. A config is read natively only when every field whose default
differs between the Llama, Mistral and Qwen2 config classes is written out in the file; any other
config goes through `AutoConfig` as before. `tests/models/test_text_config.py` checks the fields the
engine reads against transformers on the same files.
"""
from __future__ import annotations

import json
import os
from types import SimpleNamespace

# model_type -> architecture, also for configs derived from GGUF metadata (they name no architecture).
ARCH_BY_MODEL_TYPE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}

# Fields whose class defaults differ between the three (or that a checkpoint always states).
_REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
             "max_position_embeddings", "rms_norm_eps", "eos_token_id")


class TextConfig(SimpleNamespace):
    """Attribute access to a decoder config, like a transformers config; unknown fields read as
    missing (`getattr(config, name, default)`), as the engine's readers expect."""


def text_config_from_dict(cfg: dict) -> TextConfig | None:
    """A TextConfig for a Llama-family config dict, or None where transformers should read it."""
    model_type = cfg.get("model_type")
    if model_type not in ARCH_BY_MODEL_TYPE or any(key not in cfg for key in _REQUIRED):
        return None
    if "rope_theta" not in cfg and "rope_parameters" not in cfg:
        return None
    if "text_config" in cfg:
        return None
    # A `quantization_config` stays the plain dict it is in the file (transformers keeps it so
    # too); layers/quantization/config.py reads it.
    c = dict(cfg)
    c.setdefault("architectures", [ARCH_BY_MODEL_TYPE[model_type]])
    if c.get("num_key_value_heads") is None:
        c["num_key_value_heads"] = c["num_attention_heads"]
    if c.get("head_dim") is None:
        c["head_dim"] = c["hidden_size"] // c["num_attention_heads"]
    for key in ("tie_word_embeddings", "attention_bias", "mlp_bias"):
        c.setdefault(key, False)
    if model_type == "mistral":
        c.setdefault("sliding_window", 4096)  # MistralConfig's default (v0.1 checkpoints rely on it)
    c.setdefault("bos_token_id", None)
    return TextConfig(**c)


def read_text_config(directory: str) -> TextConfig | None:
    path = os.path.join(directory, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return None  # transformers reports a missing or broken file in its own words
    return text_config_from_dict(cfg) if isinstance(cfg, dict) else None


def layer_sliding_windows(config) -> list[int | None]:
    """Each decoder layer's sliding window (None: full causal attention), decided as transformers
    does: by `layer_types` where the config has them ("sliding_attention" layers get
    `sliding_window`), else by Qwen2's rule (only with use_sliding_window, from layer
    max_window_layers on), else `sliding_window` on every layer (Mistral; Llama configs have none)."""
    n = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types is not None:
        return [window if t == "sliding_attention" else None for t in types]
    if getattr(config, "model_type", None) == "qwen2":
        first = getattr(config, "max_window_layers", 28)
        return [window if getattr(config, "use_sliding_window", False) and i >= first else None for i in range(n)]
    return [window] * n
