"""A checkpoint's config, dtype and generation EOS ids, read before any model code is imported.

Model families whose config transformers cannot read (remote code: Phi-3-vision, CogVLM, VILA, NeVA,
Nougat) have readers that live with their models; the caller passes the lookup (`own_reader`;
models/loader.load_hf_config passes models/registry.config_reader) so that this room imports nothing
above it."""
from __future__ import annotations

import json
import os
from typing import Callable

import torch

from splitserve.loading.architectures import ARCHITECTURES
from splitserve.loading.gguf_io import gguf_hf_config
from splitserve.loading.resolve import ModelSource
from splitserve.loading.text_config import read_text_config

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16,
           "half": torch.float16, "float": torch.float32}  # vLLM's (and torch's) spellings

# directory -> the family's own config reader (directory -> config), or None for the generic path
OwnReader = Callable[[str], "Callable[[str], object] | None"]


def read_hf_config(source: ModelSource, own_reader: OwnReader | None = None):
    """The model's config. `own_reader(directory)`: the reader of a family that has its own
    (models/registry.config_reader); None reads HF and GGUF configs only."""
    if source.gguf_file:
        return gguf_hf_config(source.path)
    reader = own_reader(source.directory) if own_reader is not None else None
    if reader is not None:
        config = reader(source.directory)
    else:
        config = read_text_config(source.directory)
        if config is not None:
            return config
        from transformers import AutoConfig
        config = AutoConfig.from_pretrained(source.directory)
    expose_text_config(config)
    if getattr(config, "d_kv", None) and not getattr(config, "head_dim", None):
        config.head_dim = config.d_kv  # T5: heads * d_kv need not be d_model; the KV cache is sized by it
    if not getattr(config, "architectures", None):
        arch = ARCHITECTURES.get(config.model_type)
        config.architectures = [arch] if arch else [f"<model_type {config.model_type}>"]
    return config


def config_model_type(directory: str) -> tuple[str | None, list[str] | None]:
    """config.json's model_type and architectures (None, None without one)."""
    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):
        return None, None
    with open(path) as f:
        cfg = json.load(f)
    return cfg.get("model_type"), cfg.get("architectures")


_TEXT_KEYS = ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_size",
              "vocab_size", "max_position_embeddings", "eos_token_id", "bos_token_id", "decoder_start_token_id")


def expose_text_config(config) -> None:
    """Vision-language configs keep the decoder's settings in `text_config`; the engine sizes the KV
    cache and vocabulary from the top level, so copy the decoder's values up where missing."""
    text = getattr(config, "text_config", None)
    if text is None:
        return
    for key in _TEXT_KEYS:
        if getattr(config, key, None) is None and getattr(text, key, None) is not None:
            setattr(config, key, getattr(text, key))


def resolve_dtype(dtype: str | torch.dtype, hf_config, device: str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype != "auto":
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be auto, float32 (float), float16 (half) or bfloat16, got {dtype!r}")
        return _DTYPES[dtype]
    if device == "cpu":
        return torch.float32  # CPU half-precision matmuls are slow and lossy
    cfg = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    cfg = _DTYPES.get(cfg, cfg) if isinstance(cfg, str) else cfg
    return cfg if cfg in (torch.float16, torch.bfloat16) else torch.bfloat16


def read_generation_eos(source: ModelSource) -> list[int]:
    path = os.path.join(source.directory, "generation_config.json")
    if source.gguf_file or not os.path.exists(path):
        return []
    with open(path) as f:
        eos = json.load(f).get("eos_token_id")
    return [eos] if isinstance(eos, int) else list(eos or [])
