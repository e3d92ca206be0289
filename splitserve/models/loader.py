"""Builds a model and streams a checkpoint into it: HF safetensors directories and GGUF files."""
from __future__ import annotations

import json
import logging
import os

import torch

from splitserve.parallel.parallel_state import pp_group, tp_group
from splitserve.layers.linear import Linear, process_weights_after_loading
from splitserve.layers.quantization.base import QuantConfig
from splitserve.layers.rotary import RotaryEmbedding
from splitserve.models.registry import get_model_class, own_config_reader
from splitserve.models.families import ARCHITECTURES
from splitserve.models.gguf_io import gguf_hf_config, iter_gguf
from splitserve.models.resolve import ModelSource
from splitserve.models.safetensors_io import iter_safetensors
from splitserve.models.text_config import read_text_config

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16,
           "half": torch.float16, "float": torch.float32}  # vLLM's (and torch's) spellings


def load_hf_config(source: ModelSource):
    from splitserve.models.vila import is_vila_dir, load_vila_config
    if source.gguf_file:
        return gguf_hf_config(source.path)
    own_reader = own_config_reader(*_config_model_type(source.directory))
    if own_reader is not None:
        config = own_reader(source.directory)
    elif is_vila_dir(source.directory):
        config = load_vila_config(source.directory)
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


def _config_model_type(directory: str) -> tuple[str | None, list[str] | None]:
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


# Checkpoint readers yield (HF name, tensor): safetensors directories in safetensors_io.py, GGUF files
# in gguf_io.py.


def init_random_weights(model: torch.nn.Module, seed: int = 0) -> None:
    """Random weights for performance runs of full-size configs (no checkpoint needed): N(0, 0.02)
    drawn where the weights live (8B values on the GPU take milliseconds; on the host, seconds).
    Quantized layers fill their own storage and scales (their method's `init_random`)."""
    gen = None
    for name, param in model.named_parameters():
        if "norm" in name:
            param.data.fill_(1.0)
            continue
        if not param.dtype.is_floating_point or param.element_size() < 2:
            continue  # int8 / fp8 storage: its method draws it below
        if gen is None:
            gen = torch.Generator(device=param.device).manual_seed(seed)
        param.data.normal_(0.0, 0.02, generator=gen)
    for module in model.modules():
        if isinstance(module, Linear) and module.is_quantized:
            if gen is None:
                gen = torch.Generator(device=module.weight.device).manual_seed(seed)
            module.method.init_random(module, gen)


def load_model(source: ModelSource, hf_config, dtype: torch.dtype, device: str, random_weights: bool = False,
               quant_config: QuantConfig | None = None, max_model_len: int | None = None):
    """The model on `device` with its weights. max_model_len: the longest context the engine serves,
    which picks longrope's frequency set (layers/rotary.py); None: max_position_embeddings."""
    arch, cls = get_model_class(hf_config.architectures, hf_config)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = cls(hf_config, quant_config)
    finally:
        torch.set_default_dtype(prev)
    model.eval()
    if max_model_len is not None:
        for module in model.modules():
            if isinstance(module, RotaryEmbedding):
                module.fit_context(max_model_len)
    if random_weights:
        init_random_weights(model)
    else:
        # A family with its own layout (VILA's part folders) says how to read it. With tensor or
        # pipeline parallelism safetensors are read lazily: each layer reads its rank's part only.
        # (GGUF tensors are read and dequantized whole, then cut: its block formats are not sliceable.)
        reader = getattr(cls, "iter_weights", iter_safetensors)
        lazy = tp_group().world_size > 1 or pp_group().world_size > 1
        weights = iter_gguf(source.path, hf_config) if source.gguf_file else reader(source.directory, lazy=lazy)
        loaded = model.load_weights(weights)
        missing = {n for n, _ in model.named_parameters()} - loaded
        if missing:
            raise ValueError(f"checkpoint {source.path} is missing weights: {sorted(missing)[:8]}")
    process_weights_after_loading(model)
    if quant_config is not None:
        logger.info("quantization: %s", quant_config.describe())
    return arch, model


def read_generation_eos(source: ModelSource) -> list[int]:
    path = os.path.join(source.directory, "generation_config.json")
    if source.gguf_file or not os.path.exists(path):
        return []
    with open(path) as f:
        eos = json.load(f).get("eos_token_id")
    return [eos] if isinstance(eos, int) else list(eos or [])
