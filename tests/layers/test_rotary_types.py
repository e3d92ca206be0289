"""Every rope scaling type's table against transformers' rotary embedding on the same config:
cos and sin (attention factor included) at each position the engine can run."""
import pytest
import torch

from splitserve.layers.rotary import RotaryEmbedding, rope_parameters

HEAD_DIM, MAX_POS = 32, 256


def _hf_cos_sin(config, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    cos, sin = LlamaRotaryEmbedding(config)(torch.zeros(1, 1, HEAD_DIM), positions[None])
    half = cos.shape[-1] // 2
    return cos[0, :, :half], sin[0, :, :half]


def _config(rope: dict):
    from transformers import LlamaConfig
    return LlamaConfig(hidden_size=HEAD_DIM * 2, num_attention_heads=2, max_position_embeddings=MAX_POS,
                       rope_parameters={"rope_theta": 10000.0, **rope})


CASES = {
    "default": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    "yarn-mscale": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32, "mscale": 0.7,
                    "mscale_all_dim": 1.0, "beta_fast": 16, "beta_slow": 2},
    "yarn-no-truncate": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                         "truncate": False},
    "yarn-attention-factor": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 128,
                              "attention_factor": 0.8},
}


@pytest.mark.parametrize("case", list(CASES))
def test_table_matches_transformers(case):
    config = _config(CASES[case])
    ours = RotaryEmbedding(HEAD_DIM, MAX_POS, rope_parameters(config)).cos_sin
    positions = torch.arange(MAX_POS)
    cos, sin = _hf_cos_sin(config, positions)
    torch.testing.assert_close(ours[:, :HEAD_DIM // 2], cos, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(ours[:, HEAD_DIM // 2:], sin, atol=2e-6, rtol=1e-5)


def test_scaling_types_differ_from_default():
    """Else the comparison above would prove nothing for them."""
    default = RotaryEmbedding(HEAD_DIM, MAX_POS, rope_parameters(_config(CASES["default"]))).cos_sin
    for case in ("linear", "llama3", "yarn", "yarn-mscale"):
        table = RotaryEmbedding(HEAD_DIM, MAX_POS, rope_parameters(_config(CASES[case]))).cos_sin
        assert not torch.allclose(table, default, atol=1e-3), case


def test_longrope_short_and_long_sets():
    """Short factors for an engine whose contexts fit original_max_position_embeddings, long ones
    (for every position) otherwise: transformers' sets for a sequence that fits / does not fit."""
    from transformers import Phi3Config
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding
    original = 64
    config = Phi3Config(hidden_size=HEAD_DIM * 2, num_attention_heads=2, max_position_embeddings=MAX_POS,
                        original_max_position_embeddings=original, rope_parameters={
                            "rope_type": "longrope", "rope_theta": 10000.0,
                            "short_factor": [1.0 + 0.05 * i for i in range(HEAD_DIM // 2)],
                            "long_factor": [2.0 + 0.5 * i for i in range(HEAD_DIM // 2)]})
    rotary = RotaryEmbedding(HEAD_DIM, MAX_POS, rope_parameters(config))
    for fits, positions in ((True, torch.arange(original)), (False, torch.arange(MAX_POS))):
        rotary.fit_context(original if fits else MAX_POS)
        cos, sin = Phi3RotaryEmbedding(config)(torch.zeros(1, 1, HEAD_DIM), positions[None])
        half = HEAD_DIM // 2
        torch.testing.assert_close(rotary.cos_sin[positions, :half], cos[0, :, :half], atol=2e-6, rtol=1e-5)
        torch.testing.assert_close(rotary.cos_sin[positions, half:], sin[0, :, :half], atol=2e-6, rtol=1e-5)


def test_unknown_rope_type_is_refused():
    with pytest.raises(ValueError, match="rope type 'mrope' is not supported"):
        RotaryEmbedding(HEAD_DIM, MAX_POS, {"rope_type": "mrope", "rope_theta": 10000.0})
