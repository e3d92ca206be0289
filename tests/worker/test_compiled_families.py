"""Each family's layer halves trace as one full graph (no graph break: the family choices are Python
attributes fixed at build time, nothing depends on the step's data), every layer and token count
reuse it (one compilation per half, as the runner relies on), and the traced code equals eager."""
import pytest
import torch
from transformers import CONFIG_MAPPING

from splitserve.models.decoder import DecoderForCausalLM

TINY = dict(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64)
FAMILIES = {
    "gemma2": dict(head_dim=16, sliding_window=8),
    "qwen3": dict(head_dim=16),
    "granite": dict(residual_multiplier=0.3, embedding_multiplier=4.0),
    "persimmon": dict(qk_layernorm=True, num_key_value_heads=None),
    "stablelm": dict(qk_layernorm=True),
    "opt": dict(ffn_dim=96, num_key_value_heads=None),
    "mixtral": dict(num_local_experts=4),
    "qwen2_moe": dict(num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=48),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_layer_halves_compile_once(family):
    from torch._dynamo.testing import CompileCounter
    torch._dynamo.reset()
    kw = {k: v for k, v in {**TINY, **FAMILIES[family]}.items() if v is not None}
    model = DecoderForCausalLM(CONFIG_MAPPING[family](**kw))
    gen = torch.Generator().manual_seed(0)
    for p in model.parameters():
        p.data.normal_(0, 0.2, generator=gen)
    attn = model.layers[0].self_attn
    q_size = attn.num_heads * attn.head_dim
    counter = CompileCounter()
    with torch.inference_mode():
        for num_tokens in (5, 9, 33):
            for layer in model.layers:
                x, residual = (torch.randn(num_tokens, 64, generator=gen) for _ in range(2))
                attn_out = torch.randn(num_tokens, q_size, generator=gen)
                for half, args in ((layer.attn_inputs, (x, residual)), (layer.attn_outputs, (attn_out, residual))):
                    got = torch.compile(half, backend=counter, dynamic=True, fullgraph=True)(*args)
                    for g, w in zip(got, half(*args)):
                        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    assert counter.frame_count == 2
