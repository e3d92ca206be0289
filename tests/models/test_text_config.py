"""The native config reader against transformers' config classes on the same config.json files: every
field the engine reads must come out the same, and files it cannot read exactly go to transformers."""
from __future__ import annotations

import json
import os

import pytest
import torch

from splitserve.layers.rotary import rope_parameters
from splitserve.loading.hf_config import resolve_dtype
from splitserve.models.loader import load_hf_config
from splitserve.loading.resolve import ModelSource
from splitserve.loading.text_config import TextConfig, layer_sliding_windows, read_text_config

CONFIG_8B = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "configs", "llama3-8b")

BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=100,
            max_position_embeddings=512, rms_norm_eps=1e-5, eos_token_id=2)
CASES = {
    "llama-minimal-v4": dict(BASE, model_type="llama", rope_theta=500000.0),
    "llama-gqa-tied-bf16": dict(BASE, model_type="llama", num_key_value_heads=2, tie_word_embeddings=True,
                                rope_theta=10000.0, torch_dtype="bfloat16", bos_token_id=1),
    "llama3-rope-scaling-v4": dict(BASE, model_type="llama", num_key_value_heads=1, rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}),
    "linear-rope-old-key": dict(BASE, model_type="llama", rope_theta=10000.0, rope_scaling={"type": "linear", "factor": 2.0}),
    "llama-v5-rope-parameters": dict(BASE, model_type="llama", head_dim=32, attention_bias=True, mlp_bias=True,
                                     rope_parameters={"rope_type": "default", "rope_theta": 1e6}, dtype="float16"),
    "mistral": dict(BASE, model_type="mistral", num_key_value_heads=2, rope_theta=1e6, sliding_window=None),
    "mistral-window": dict(BASE, model_type="mistral", num_key_value_heads=2, rope_theta=1e6, sliding_window=16),
    "mistral-default-window": dict(BASE, model_type="mistral", num_key_value_heads=2, rope_theta=1e6),
    "qwen2-window-from-layer-1": dict(BASE, model_type="qwen2", num_key_value_heads=2, rope_theta=1e6, use_sliding_window=True,
                                      sliding_window=8, max_window_layers=1),
    "qwen2-window-off": dict(BASE, model_type="qwen2", num_key_value_heads=2, rope_theta=1e6, sliding_window=8),
    "qwen2-eos-null": dict(BASE, model_type="qwen2", num_key_value_heads=2, rope_theta=1e6, eos_token_id=None,
                           tie_word_embeddings=True),
}


def _engine_view(config) -> dict:
    """Everything the engine and the text models read from a config."""
    heads = config.num_attention_heads
    view = {key: getattr(config, key, None) for key in (
        "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
        "max_position_embeddings", "rms_norm_eps", "eos_token_id", "architectures", "model_type")}
    view["num_key_value_heads"] = getattr(config, "num_key_value_heads", None) or heads
    view["head_dim"] = getattr(config, "head_dim", None) or config.hidden_size // heads
    view["tie_word_embeddings"] = bool(getattr(config, "tie_word_embeddings", False))
    for key in ("attention_bias", "mlp_bias"):
        view[key] = bool(getattr(config, key, False))
    view["dtype"] = resolve_dtype("auto", config, "cuda")
    view["sliding_windows"] = layer_sliding_windows(config)
    rope = rope_parameters(config)
    rope.pop("type", None)  # the old spelling of rope_type, which transformers renames
    view["rope"] = rope
    return view


def _write(tmp_path, cfg: dict) -> str:
    with open(tmp_path / "config.json", "w") as f:
        json.dump(cfg, f)
    return str(tmp_path)


@pytest.mark.parametrize("name", sorted(CASES))
def test_native_config_matches_transformers(name, tmp_path):
    from transformers import AutoConfig
    directory = _write(tmp_path, CASES[name])
    native = read_text_config(directory)
    assert isinstance(native, TextConfig)
    reference = AutoConfig.from_pretrained(directory)
    if not getattr(reference, "architectures", None):
        reference.architectures = native.architectures  # the loader names it from model_type as well
    assert _engine_view(native) == _engine_view(reference)


def test_benchmark_8b_config_is_read_natively():
    from transformers import AutoConfig
    native = load_hf_config(ModelSource(os.path.abspath(CONFIG_8B), os.path.abspath(CONFIG_8B)))
    assert isinstance(native, TextConfig)
    assert _engine_view(native) == _engine_view(AutoConfig.from_pretrained(CONFIG_8B))
    assert native.num_key_value_heads == 8 and native.rms_norm_eps == 1e-5


@pytest.mark.parametrize("change", ["drop eos_token_id", "drop rms_norm_eps", "no rope", "vlm model_type",
                                    "not json"])
def test_configs_it_cannot_read_exactly_go_to_transformers(change, tmp_path):
    cfg = dict(CASES["mistral"])
    if change == "drop eos_token_id":
        del cfg["eos_token_id"]  # class defaults differ: Llama and Mistral 2, Qwen2 none
    elif change == "drop rms_norm_eps":
        del cfg["rms_norm_eps"]
    elif change == "no rope":
        del cfg["rope_theta"]
    elif change == "vlm model_type":
        cfg["model_type"] = "llava"
    directory = _write(tmp_path, cfg)
    if change == "not json":
        (tmp_path / "config.json").write_text("{not json")
    assert read_text_config(directory) is None
    if change in ("drop eos_token_id", "drop rms_norm_eps", "no rope"):
        config = load_hf_config(ModelSource(directory, directory))  # the loader's fallback
        assert not isinstance(config, TextConfig) and config.model_type == "mistral"


def test_quantization_config_is_read_as_transformers_keeps_it(tmp_path):
    """A quantized checkpoint's config is read natively too; its quantization_config stays the dict
    it is in the file, as in transformers' config (layers/quantization/config.py reads it)."""
    from transformers import AutoConfig
    qc = {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
          "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"type": "float", "num_bits": 8}}}}
    directory = _write(tmp_path, {**CASES["mistral"], "quantization_config": qc})
    native = read_text_config(directory)
    assert isinstance(native, TextConfig) and native.quantization_config == qc
    assert AutoConfig.from_pretrained(directory).quantization_config == qc


def test_loader_builds_the_same_model_from_either_config(tmp_path):
    """Same parameter names and shapes from the native config as from transformers' one."""
    from transformers import AutoConfig
    from splitserve.models.decoder import LlamaForCausalLM
    directory = _write(tmp_path, CASES["llama-gqa-tied-bf16"])
    shapes = []
    for config in (read_text_config(directory), AutoConfig.from_pretrained(directory)):
        with torch.device("meta"):
            model = LlamaForCausalLM(config)
        shapes.append({n: tuple(p.shape) for n, p in model.named_parameters()})
    assert shapes[0] == shapes[1] and len(shapes[0]) > 10
