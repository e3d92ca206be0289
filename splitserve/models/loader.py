"""Builds a model and streams a checkpoint into it: HF safetensors directories and GGUF files. Reading
the config, dtype and tokenizer comes first and lives below, in loading/."""
from __future__ import annotations

import logging

import torch

from splitserve.parallel.parallel_state import pp_group, tp_group
from splitserve.layers.linear import Linear, process_weights_after_loading
from splitserve.layers.quantization.base import QuantConfig
from splitserve.layers.rotary import RotaryEmbedding
from splitserve.loading.gguf_io import iter_gguf
from splitserve.loading.hf_config import read_hf_config
from splitserve.loading.resolve import ModelSource
from splitserve.loading.safetensors_io import iter_safetensors
from splitserve.models.interfaces import capabilities_of
from splitserve.models.registry import config_reader, get_model_class

logger = logging.getLogger(__name__)

def load_hf_config(source: ModelSource):
    """The model's config, with the families that read their own (registry.config_reader) included."""
    return read_hf_config(source, config_reader)


# Checkpoint readers yield (HF name, tensor): safetensors directories in loading/safetensors_io.py, GGUF
# files in loading/gguf_io.py.


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
    caps = capabilities_of(model)  # the interface checked once, here (models/interfaces.py)
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
        reader = caps.weight_reader or iter_safetensors
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

