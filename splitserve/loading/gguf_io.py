"""GGUF files (llama.cpp's format) as an HF config and HF-named tensors.

The reader turns llama.cpp's names and conventions back into the Hugging Face checkpoint's, so a
GGUF file loads through the same family weight maps as a safetensors directory
(models/families.py, models/weights.py). What llama.cpp's converter changes, undone here:

- llama: Q/K rows of each head have their two rotary halves interleaved (undo the permutation);
  Llama 3.1's rope scaling is a `rope_freqs` tensor of per-frequency divisors, not metadata;
- gemma2: every RMSNorm weight is stored as 1 + w (Gemma's offset folded in);
- phi3: q/k/v and gate/up stay merged (`attn_qkv`, `ffn_up` holding [gate; up]), and longrope's
  factors are the `rope_factors_long` / `rope_factors_short` tensors.
"""
from __future__ import annotations

import functools
from typing import Iterator

import torch

from splitserve.loading.architectures import ARCHITECTURES
from splitserve.loading.text_config import TextConfig, text_config_from_dict

GGUF_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "phi3")

_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_ARCH_LAYER_NAMES = {
    "qwen3": {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"},
    "gemma2": {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"},
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
}
# Tensors the config takes (rotary factors), not the model.
_CONFIG_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


@functools.lru_cache(maxsize=2)
def gguf_reader(path: str):
    """One parsed (memory-mapped) reader per file, shared by the config and the weight loader."""
    import gguf
    return gguf.GGUFReader(path)


def _tensor(reader, name: str) -> torch.Tensor | None:
    from gguf.quants import dequantize
    for t in reader.tensors:
        if t.name == name:
            return torch.from_numpy(dequantize(t.data, t.tensor_type).copy()).float().reshape(-1)
    return None


def gguf_hf_config(path: str):
    """An HF config from a GGUF file's metadata. Reading the few keys directly is much faster than
    transformers' converter, which parses the whole file (vocabulary included) to get them."""
    reader = gguf_reader(path)
    meta = {k: f.contents() for k, f in reader.fields.items()
            if not k.startswith("tokenizer.ggml.") or k.endswith("_token_id")}
    arch = meta["general.architecture"]
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(GGUF_ARCHITECTURES)}")
    names = {t.name for t in reader.tensors}
    heads = meta[f"{arch}.attention.head_count"]
    hidden = meta[f"{arch}.embedding_length"]
    head_dim = meta.get(f"{arch}.attention.key_length", hidden // heads)
    kw = dict(
        hidden_size=hidden, intermediate_size=meta[f"{arch}.feed_forward_length"],
        num_hidden_layers=meta[f"{arch}.block_count"], num_attention_heads=heads,
        num_key_value_heads=meta.get(f"{arch}.attention.head_count_kv", heads),
        max_position_embeddings=meta[f"{arch}.context_length"],
        rms_norm_eps=meta[f"{arch}.attention.layer_norm_rms_epsilon"],
        rope_theta=meta.get(f"{arch}.rope.freq_base", 10000.0), head_dim=head_dim,
        vocab_size=meta.get(f"{arch}.vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data),
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"), eos_token_id=meta.get("tokenizer.ggml.eos_token_id"))
    rope = {"rope_type": "default", "rope_theta": kw["rope_theta"]}
    rot = meta.get(f"{arch}.rope.dimension_count")
    if rot and rot != head_dim:
        rope["partial_rotary_factor"] = rot / head_dim
    if meta.get(f"{arch}.rope.scaling.type") == "linear":
        rope.update(rope_type="linear", factor=meta[f"{arch}.rope.scaling.factor"])
    divisors = _tensor(reader, "rope_freqs.weight")
    if divisors is not None:  # Llama 3.1: per-frequency divisors of the default frequencies
        rope["freq_divisors"] = divisors.tolist()
    if arch in ("llama", "mistral", "qwen2"):
        config = text_config_from_dict({"model_type": arch, **kw})
        config.rope_parameters = rope
        return config
    kw.update(model_type=arch, architectures=[ARCHITECTURES[arch]], rope_parameters=rope, attention_bias=False,
              mlp_bias=False, hidden_act="silu")
    window = meta.get(f"{arch}.attention.sliding_window")
    if arch == "gemma2":
        n = kw["num_hidden_layers"]
        # llama.cpp's own rule: Gemma 2 27B (46 layers) scales by hidden / heads, the others by head_dim
        kw.update(hidden_activation="gelu_pytorch_tanh", sliding_window=window,
                  query_pre_attn_scalar=hidden // heads if n == 46 else head_dim,
                  attn_logit_softcapping=meta.get("gemma2.attn_logit_softcapping"),
                  final_logit_softcapping=meta.get("gemma2.final_logit_softcapping"),
                  layer_types=["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)])
    elif arch == "phi3":
        kw["sliding_window"] = window or None
        long, short = _tensor(reader, "rope_factors_long.weight"), _tensor(reader, "rope_factors_short.weight")
        original = meta.get("phi3.rope.scaling.original_context_length")
        if long is not None and short is not None:
            rope.update(rope_type="longrope", long_factor=long.tolist(), short_factor=short.tolist(),
                        original_max_position_embeddings=original)
            if meta.get("phi3.rope.scaling.attn_factor") is not None:
                rope["attention_factor"] = meta["phi3.rope.scaling.attn_factor"]
    return TextConfig(**kw)


def _unpermute_rope(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp stores Llama Q/K rows with each head's two rotary halves interleaved; undo that so
    the half-split (NeoX) rotary of the HF layout applies."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def iter_gguf(path: str, hf_config) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, HF-convention tensor) for every tensor of the file. A tensor this reader does not
    know is an error naming it (the model would be wrong without it)."""
    from gguf.quants import dequantize
    reader = gguf_reader(path)
    arch = reader.fields["general.architecture"].contents()
    layer_names = {**_LAYER_NAMES, **_ARCH_LAYER_NAMES.get(arch, {})}
    n_head, n_kv = hf_config.num_attention_heads, hf_config.num_key_value_heads
    for t in reader.tensors:
        if t.name in _CONFIG_TENSORS:
            continue
        module, _, param = t.name.rpartition(".")
        parts = module.split(".")  # blk.N.kind
        if module in _TOP_NAMES:
            name = f"{_TOP_NAMES[module]}.{param}"
        elif len(parts) == 3 and parts[0] == "blk" and parts[2] in layer_names:
            name = f"model.layers.{parts[1]}.{layer_names[parts[2]]}.{param}"
        else:
            raise ValueError(f"GGUF tensor {t.name!r} ({arch}) is not one this loader knows")
        tensor = torch.from_numpy(dequantize(t.data, t.tensor_type).copy()).float()
        if arch == "llama" and ".q_proj." in name:
            tensor = _unpermute_rope(tensor, n_head)
        elif arch == "llama" and ".k_proj." in name:
            tensor = _unpermute_rope(tensor, n_kv)
        elif arch == "gemma2" and name.endswith("norm.weight"):
            tensor = tensor - 1.0
        yield name, tensor
