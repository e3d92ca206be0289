"""PEFT adapters read and checked against the base model (lora/adapter.py, lora/registry.py): the
weights and scaling match what peft computes, and every unsupported adapter is refused with a message
naming the problem. Adapters are made by peft on a tiny random Llama (no downloads)."""
import json

import pytest
import torch

from splitserve.lora.adapter import LoRATargets, load_adapter
from splitserve.lora.registry import parse_lora_modules
from tests.lora_reference import make_peft_adapter


@pytest.fixture(scope="module")
def base():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return cfg, LlamaForCausalLM(cfg).eval()


def targets(cfg):
    return LoRATargets.from_hf_config(cfg)


def test_weights_and_scaling_match_peft(base, tmp_path):
    """The delta x A^T (s B)^T per module equals peft's own delta (merged minus base weights)."""
    from tests.lora_reference import merged_reference
    cfg, model = base
    for rslora, (r, alpha) in ((False, (8, 24)), (True, (16, 8))):
        path = make_peft_adapter(model, tmp_path / f"a{rslora}", rank=r, alpha=alpha, seed=3, use_rslora=rslora,
                                 alpha_pattern={"down_proj": 4})
        adapter = load_adapter(1, "a", path, targets(cfg), 64)
        merged = merged_reference(model, path)
        for (layer, proj), (a, b) in adapter.weights.items():
            parent = "mlp" if proj in ("gate", "up", "down") else "self_attn"
            name = f"model.layers.{layer}.{parent}.{proj}_proj.weight"
            delta = merged.state_dict()[name] - model.state_dict()[name]
            torch.testing.assert_close(b @ a, delta, rtol=1e-4, atol=1e-6)
        a, b = adapter.weights[(0, "down")]
        assert adapter.rank == r and a.shape == (r, 96) and b.shape == (64, r)


def refusal(base, tmp_path, max_rank=64, **kwargs):
    cfg, model = base
    path = make_peft_adapter(model, tmp_path / "x", seed=1, **{"rank": 8, "alpha": 8, **kwargs})
    with pytest.raises(ValueError) as e:
        load_adapter(1, "x", path, targets(cfg), max_rank)
    return str(e.value)


def test_refuses_dora(base, tmp_path):
    assert "DoRA" in refusal(base, tmp_path, use_dora=True)


def test_refuses_modules_it_has_no_lora_for(base, tmp_path):
    assert "lm_head" in refusal(base, tmp_path, targets=["q_proj", "lm_head"])


def test_refuses_rank_above_max(base, tmp_path):
    assert "rank 32 is above --max-lora-rank 16" in refusal(base, tmp_path, max_rank=16, rank=32)


def test_refuses_biases_and_saved_modules(base, tmp_path):
    assert "biases" in refusal(base, tmp_path, bias="lora_only")
    assert "modules_to_save" in refusal(base, tmp_path / "m", modules_to_save=["lm_head"])


def test_refuses_an_adapter_of_another_model(base, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM
    other = LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=96, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2)).eval()
    path = make_peft_adapter(other, tmp_path / "other", rank=8, alpha=8, seed=1)
    with pytest.raises(ValueError, match="base model mismatch: layer 0 down_proj is 96 -> 64 features in the base model, the adapter's is 96 -> 32"):
        load_adapter(1, "o", path, targets(base[0]), 64)
    deeper = LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                                          num_attention_heads=4, num_key_value_heads=2)).eval()
    path = make_peft_adapter(deeper, tmp_path / "deeper", rank=8, alpha=8, seed=1)
    with pytest.raises(ValueError, match="base model has 2 layers"):
        load_adapter(1, "d", path, targets(base[0]), 64)


def test_refuses_missing_or_broken_files(base, tmp_path):
    with pytest.raises(ValueError, match="not a directory"):
        load_adapter(1, "m", str(tmp_path / "nope"), targets(base[0]), 64)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no adapter_config.json"):
        load_adapter(1, "m", str(tmp_path / "empty"), targets(base[0]), 64)
    (tmp_path / "empty" / "adapter_config.json").write_text(json.dumps({"r": 8}))
    with pytest.raises(ValueError, match="no adapter_model.safetensors"):
        load_adapter(1, "m", str(tmp_path / "empty"), targets(base[0]), 64)


def test_lora_modules_flag_forms():
    assert parse_lora_modules(["a=/x", '{"name": "b", "path": "/y", "base_model_name": "m"}']) == (("a", "/x"), ("b", "/y"))
    with pytest.raises(ValueError, match="NAME=PATH"):
        parse_lora_modules(["justaname"])
    with pytest.raises(ValueError, match="twice"):
        parse_lora_modules(["a=/x", "a=/y"])
