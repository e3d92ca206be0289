"""Builds a model and streams a checkpoint into it: HF safetensors directories and GGUF files."""
from __future__ import annotations

import glob
import json
import os
from typing import Iterator

import torch
from tqdm import tqdm

from splitserve.models.registry import get_model_class
from splitserve.models.resolve import ModelSource

# model_type -> architecture, for configs derived from GGUF metadata (they name no architecture).
_ARCH_BY_MODEL_TYPE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def load_hf_config(source: ModelSource):
    from transformers import AutoConfig
    if source.gguf_file:
        config = AutoConfig.from_pretrained(source.directory, gguf_file=source.gguf_file)
    else:
        config = AutoConfig.from_pretrained(source.directory)
    if not getattr(config, "architectures", None):
        arch = _ARCH_BY_MODEL_TYPE.get(config.model_type)
        config.architectures = [arch] if arch else [f"<model_type {config.model_type}>"]
    return config


def resolve_dtype(dtype: str | torch.dtype, hf_config, device: str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype != "auto":
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be auto, float32, float16 or bfloat16, got {dtype!r}")
        return _DTYPES[dtype]
    if device == "cpu":
        return torch.float32  # CPU half-precision matmuls are slow and lossy
    cfg = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    cfg = _DTYPES.get(cfg, cfg) if isinstance(cfg, str) else cfg
    return cfg if cfg in (torch.float16, torch.bfloat16) else torch.bfloat16


# -- checkpoint readers: yield (HF name, tensor) ------------------------------------------------------
def iter_safetensors(directory: str) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors.torch import safe_open
    files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {directory}")
    for path in tqdm(files, desc="loading safetensors", disable=len(files) < 2):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


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
    import gguf
    from gguf.quants import dequantize
    reader = gguf.GGUFReader(path)
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
    """Random weights for performance runs of full-size configs (no checkpoint needed)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    for name, param in model.named_parameters():
        if "norm" in name:
            param.data.fill_(1.0)
        else:
            # Fill on the host in chunks would be slow for 8B; draw one small pattern and tile it.
            pattern = torch.randn(1 << 20, generator=gen) * 0.02
            flat = param.data.view(-1)
            reps = -(-flat.numel() // pattern.numel())
            flat.copy_(pattern.to(param.device, param.dtype).repeat(reps)[:flat.numel()])


def load_model(source: ModelSource, hf_config, dtype: torch.dtype, device: str, random_weights: bool = False):
    arch, cls = get_model_class(hf_config.architectures)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = cls(hf_config)
    finally:
        torch.set_default_dtype(prev)
    model.eval()
    if random_weights:
        init_random_weights(model)
        return arch, model
    weights = iter_gguf(source.path, hf_config) if source.gguf_file else iter_safetensors(source.directory)
    loaded = model.load_weights(weights)
    missing = {n for n, _ in model.named_parameters()} - loaded
    if missing:
        raise ValueError(f"checkpoint {source.path} is missing weights: {sorted(missing)[:8]}")
    return arch, model


def read_generation_eos(source: ModelSource) -> list[int]:
    path = os.path.join(source.directory, "generation_config.json")
    if source.gguf_file or not os.path.exists(path):
        return []
    with open(path) as f:
        eos = json.load(f).get("eos_token_id")
    return [eos] if isinstance(eos, int) else list(eos or [])
