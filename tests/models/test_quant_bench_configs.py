"""The quantized benchmark configs (benchmarks/configs/llama3-8b-gptq-int4, llama3-8b-w8a8-int8,
llama3-70b-fp8): the Llama-3 shapes with a checkpoint's `quantization_config`, loaded with random weights by
benchmarks/gpu_suite.py --config. At full size on the meta device every linear layer must hold the
format's storage (so the device figures measure the format named); a tiny copy of each config (same
quantization_config, small shapes) serves greedy tokens on the CPU."""
import json
import os

import pytest
import torch

from splitserve import LLM, SamplingParams
from splitserve.layers.linear import Linear
from splitserve.layers.quantization.config import resolve_quant_config
from splitserve.models.loader import load_hf_config
from splitserve.models.registry import get_model_class
from splitserve.loading.resolve import ModelSource

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "configs")
# name -> (the bytes of a [N, K] layer's quantized weight storage, its parameter names, the engine's description)
FORMATS = {
    "llama3-8b-gptq-int4": (lambda n, k: n * k // 2, {"qweight", "scales"}, "gptq: W4A16 (group 128)"),
    "llama3-8b-w8a8-int8": (lambda n, k: n * k, {"weight", "weight_scale"},
                            "compressed-tensors: W8A8 INT8, per-channel weights, dynamic per-token activations"),
    # FP8 storage from the start: online --quantization fp8 would hold the 70B's 140 GB of bf16 first
    "llama3-70b-fp8": (lambda n, k: n * k, {"weight", "weight_scale"},
                       "compressed-tensors: FP8 per-channel weights, dynamic per-token activations"),
}
TINY = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512, max_position_embeddings=512)


def _source(path: str) -> ModelSource:
    path = os.path.abspath(path)
    return ModelSource(path, path)


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_full_size_layers_hold_the_quantized_storage(name):
    path = os.path.join(CONFIGS, name)
    config = load_hf_config(_source(path))
    quant = resolve_quant_config(None, config, path)
    _, cls = get_model_class(config.architectures, config)
    with torch.device("meta"):
        model = cls(config, quant)
    weight_bytes, names, _ = FORMATS[name]
    linears = [m for n, m in model.named_modules() if isinstance(m, Linear) and "lm_head" not in n]
    assert len(linears) == config.num_hidden_layers * 4  # qkv, o, gate_up, down per layer (merged projections)
    for layer in linears:
        params = dict(layer.named_parameters(recurse=False))
        assert names <= set(params), (type(layer.method).__name__, sorted(params))
        storage = params["qweight" if "qweight" in params else "weight"]
        assert storage.numel() * storage.element_size() == weight_bytes(layer.out_features, layer.in_features)


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_tiny_copy_serves_greedy_tokens(name, tmp_path):
    with open(os.path.join(CONFIGS, name, "config.json")) as f:
        cfg = dict(json.load(f), **TINY)
    with open(tmp_path / "config.json", "w") as f:
        json.dump(cfg, f)
    llm = LLM(str(tmp_path), random_weights=True, dtype="float32", num_blocks=64, block_size=16, tokenizer=None)
    assert llm.engine.config.model.quantization == FORMATS[name][2]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}, {"prompt_token_ids": [9, 10]}], params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [6, 6]
    assert llm.engine.kv_manager.pool.is_whole()
