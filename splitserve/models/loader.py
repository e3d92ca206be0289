"""Builds a model and streams a checkpoint into it: HF safetensors directories and GGUF files."""
from __future__ import annotations

import functools
import json
import logging
import os
from typing import Iterator

import torch

from splitserve.distributed.parallel_state import pp_group, tp_group
from splitserve.layers.linear import Linear, process_weights_after_loading
from splitserve.layers.quantization.base import QuantConfig
from splitserve.models.registry import get_model_class
from splitserve.models.resolve import ModelSource
from splitserve.models.safetensors_io import iter_safetensors
from splitserve.models.text_config import ARCH_BY_MODEL_TYPE, read_text_config, text_config_from_dict

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16,
           "half": torch.float16, "float": torch.float32}  # vLLM's (and torch's) spellings


@functools.lru_cache(maxsize=2)
def gguf_reader(path: str):
    """One parsed (memory-mapped) reader per file, shared by the config and the weight loader."""
    import gguf
    return gguf.GGUFReader(path)


def gguf_hf_config(path: str):
    """An HF config from a GGUF file's metadata. Reading the few keys directly is much faster than
    transformers' converter, which parses the whole file (vocabulary included) to get them."""
    reader = gguf_reader(path)
    meta = {k: f.contents() for k, f in reader.fields.items()
            if not k.startswith("tokenizer.ggml.") or k.endswith("_token_id")}
    arch = meta["general.architecture"]
    if arch not in ARCH_BY_MODEL_TYPE:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(ARCH_BY_MODEL_TYPE)}")
    names = {t.name for t in reader.tensors}
    heads = meta[f"{arch}.attention.head_count"]
    hidden = meta[f"{arch}.embedding_length"]
    kw = dict(
        hidden_size=hidden, intermediate_size=meta[f"{arch}.feed_forward_length"],
        num_hidden_layers=meta[f"{arch}.block_count"], num_attention_heads=heads,
        num_key_value_heads=meta.get(f"{arch}.attention.head_count_kv", heads),
        max_position_embeddings=meta[f"{arch}.context_length"],
        rms_norm_eps=meta[f"{arch}.attention.layer_norm_rms_epsilon"],
        rope_theta=meta.get(f"{arch}.rope.freq_base", 10000.0),
        head_dim=meta.get(f"{arch}.attention.key_length", hidden // heads),
        vocab_size=meta.get(f"{arch}.vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data),
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"), eos_token_id=meta.get("tokenizer.ggml.eos_token_id"))
    return text_config_from_dict({"model_type": arch, **kw})


def load_hf_config(source: ModelSource):
    from splitserve.models.vila import is_vila_dir, load_vila_config
    if source.gguf_file:
        return gguf_hf_config(source.path)
    if is_vila_dir(source.directory):
        config = load_vila_config(source.directory)
    else:
        config = read_text_config(source.directory)
        if config is not None:
            return config
        from transformers import AutoConfig
        config = AutoConfig.from_pretrained(source.directory)
    expose_text_config(config)
    if not getattr(config, "architectures", None):
        arch = ARCH_BY_MODEL_TYPE.get(config.model_type)
        config.architectures = [arch] if arch else [f"<model_type {config.model_type}>"]
    return config


_TEXT_KEYS = ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_size",
              "vocab_size", "max_position_embeddings", "eos_token_id", "bos_token_id")


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


# -- checkpoint readers: yield (HF name, tensor); safetensors directories in safetensors_io.py ----------
_GGUF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _unpermute_rope(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp stores Llama Q/K rows with each head's two rotary halves interleaved; undo that so
    the half-split (NeoX) rotary of the HF layout applies."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def iter_gguf(path: str, hf_config) -> Iterator[tuple[str, torch.Tensor]]:
    from gguf.quants import dequantize
    reader = gguf_reader(path)
    arch = reader.fields["general.architecture"].contents()
    n_head, n_kv = hf_config.num_attention_heads, hf_config.num_key_value_heads
    for t in reader.tensors:
        if t.name in _GGUF_NAMES:
            name = _GGUF_NAMES[t.name]
        else:
            parts = t.name.split(".")  # blk.N.kind.weight|bias
            if parts[0] != "blk" or parts[2] not in _GGUF_LAYER_NAMES:
                continue
            name = f"model.layers.{parts[1]}.{_GGUF_LAYER_NAMES[parts[2]]}.{parts[3]}"
        data = dequantize(t.data, t.tensor_type)
        tensor = torch.from_numpy(data.copy()).float()
        if arch == "llama" and ".q_proj." in name:
            tensor = _unpermute_rope(tensor, n_head)
        elif arch == "llama" and ".k_proj." in name:
            tensor = _unpermute_rope(tensor, n_kv)
        yield name, tensor


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
               quant_config: QuantConfig | None = None):
    arch, cls = get_model_class(hf_config.architectures)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = cls(hf_config, quant_config)
    finally:
        torch.set_default_dtype(prev)
    model.eval()
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
