"""Quantized layers keep compilation intact: a decoder layer half with FP8 (or INT8) linears traces
as one full graph (no graph break, nothing data-dependent), every layer and every token count reuse
it (one compilation, as the runner relies on), and Inductor's code equals the eager layer."""
import pytest
import torch
import transformers

from tests.quant_reference import random_quantized_weights

from splitserve.layers.quantization.compressed_tensors import CompressedTensorsConfig
from splitserve.layers.quantization.fp8 import Fp8Config
from splitserve.layers.rotary import RotaryEmbedding, rope_parameters
from splitserve.models.decoder import DecoderLayer
from splitserve.models.families import decoder_spec


def int8_config():
    args = {"type": "int", "num_bits": 8, "symmetric": True}
    return CompressedTensorsConfig({"config_groups": {"g": {
        "targets": ["Linear"], "weights": {**args, "strategy": "channel"},
        "input_activations": {**args, "strategy": "token", "dynamic": True}}}, "format": "int-quantized"})


def layers(quant_config, n=2):
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                   num_key_value_heads=2, num_hidden_layers=n, vocab_size=100)
    rotary = RotaryEmbedding(16, 64, rope_parameters(cfg))
    out = torch.nn.ModuleList(DecoderLayer(decoder_spec(cfg), i, rotary, quant_config, f"model.layers.{i}.")
                              for i in range(n))
    random_quantized_weights(out, torch.Generator().manual_seed(0))
    return out


@pytest.mark.parametrize("name, quant_config", [("fp8", Fp8Config.online()), ("int8", int8_config())])
def test_quantized_layer_half_compiles_once_for_all_layers_and_sizes(name, quant_config):
    from torch._dynamo.testing import CompileCounter
    torch._dynamo.reset()
    model = layers(quant_config)
    assert model[0].mlp.down_proj.is_quantized
    counter = CompileCounter()
    gen = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        for num_tokens in (5, 9, 33):
            for layer in model:
                attn_out, residual = (torch.randn(num_tokens, 64, generator=gen) for _ in range(2))
                eager = layer.attn_outputs(attn_out, residual)
                compiled = torch.compile(layer.attn_outputs, backend=counter, dynamic=True, fullgraph=True)
                got = compiled(attn_out, residual)
                torch.testing.assert_close(got, eager, rtol=0, atol=0)
    assert counter.frame_count == 1


def test_inductor_code_equals_eager_fp8_layer():
    torch._dynamo.reset()
    layer = layers(Fp8Config.online(), n=1)[0]
    gen = torch.Generator().manual_seed(2)
    attn_out, residual = (torch.randn(7, 64, generator=gen) for _ in range(2))
    with torch.inference_mode():
        eager = layer.attn_outputs(attn_out, residual)
        compiled = torch.compile(layer.attn_outputs, dynamic=True, fullgraph=True)(attn_out, residual)
    torch.testing.assert_close(compiled[1], eager[1], rtol=0, atol=0)
    torch.testing.assert_close(compiled[0], eager[0], rtol=1e-4, atol=1e-4)
