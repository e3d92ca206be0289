"""FP8 per-token activations quantized inside a compiled graph (`Fp8LinearMethod.gpu_matmul` under
torch.compile writes the quantization in torch ops before the opaque `splitserve::fp8_linear_quantized`,
so Inductor can fuse it into the producer of the activations). On CPU the op runs the torch reference:
the compiled path must compute what the format defines (compressed-tensors' FP8_DYNAMIC scheme, the
independent reference), with a norm in front as in a decoder layer, at several token counts of one
dynamic graph; and the quantizing op must stand in the graph (no fallback to the unfused op)."""
import pytest
import torch
from torch import nn

from splitserve.layers.linear import MergedLinear
from splitserve.layers.quant_kernels import reference
from splitserve.layers.quantization.fp8 import Fp8Config


def _layer_and_reference(gen):
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config, preset_name_to_scheme
    w = torch.randn(192, 128, generator=gen) * 0.05
    layer = MergedLinear(128, {"gate": 96, "up": 96}, method=Fp8Config.online().linear_method(["gate", "up"]))
    layer.load("weight", w[:96], "gate")
    layer.load("weight", w[96:], "up")
    layer.process_weights_after_loading()
    ref = nn.Linear(128, 192, bias=False)
    ref.weight.data = w.clone()
    apply_quantization_config(ref, QuantizationConfig(config_groups={"g": preset_name_to_scheme("FP8_DYNAMIC", ["Linear"])}),
                              show_progress=False)
    ref.weight_scale.data.copy_(w.abs().amax(1, keepdim=True) / 448.0)
    return layer, ref


def test_compiled_gpu_matmul_quantizes_in_the_graph_and_matches_fp8_dynamic():
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(3)
    layer, ref = _layer_and_reference(gen)
    norm_weight = torch.rand(128, generator=gen) + 0.5
    seen = []

    def block(x):  # an RMSNorm, then the FP8 layer through the GPU method
        normed = x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype) * norm_weight.to(x.dtype)
        return layer.method.gpu_matmul(layer, normed)

    def backend(gm, inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes)
        return gm

    compiled = torch.compile(block, backend=backend, dynamic=True, fullgraph=True)
    for tokens in (1, 5, 33):
        x = (torch.randn(tokens, 128, generator=gen) * 2).to(torch.bfloat16)
        with torch.no_grad():
            out = compiled(x)
            normed = x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype) * norm_weight.to(x.dtype)
            expected = ref(normed.float()[None])[0].to(torch.bfloat16)  # 3-D: its per-token observer
        assert out.dtype == torch.bfloat16 and out.shape == (tokens, 192)
        # compressed-tensors divides by the scale where the kernels multiply by its reciprocal: an
        # element at a rounding boundary may land one FP8 step apart (one element of 33 rows here)
        close = torch.isclose(out.float(), expected.float(), rtol=1.6e-2, atol=1e-3)
        assert close.float().mean() >= 0.98 and (out.float() - expected.float()).abs().max() < 0.1
        # and exactly what the unfused op computes for per-token activations
        torch.testing.assert_close(out, reference.fp8_linear_ref(normed, layer.weight, layer.weight_scale, act="token"),
                                   rtol=0, atol=0)
    assert any("fp8_linear_quantized" in t for t in seen)
    assert not any(t.endswith("fp8_linear.default") for t in seen)


@pytest.mark.parametrize("bias", (False, True))
def test_quantized_op_off_cuda_is_the_reference_gemm(bias):
    from splitserve.layers.quantization.fp8 import fp8_linear_quantized_op
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(7, 64, generator=gen).to(torch.bfloat16)
    w, w_scale = reference.quantize_fp8_weight_ref(torch.randn(48, 64, generator=gen))
    b = torch.randn(48, generator=gen) if bias else None
    q, s = reference.fp8_quantize_ref(x)
    out = fp8_linear_quantized_op(q, s, w, w_scale, b, torch.bfloat16)
    # the unquantized-input op on the same x computes the same function (per-token activations)
    torch.testing.assert_close(out, reference.fp8_linear_ref(x, w, w_scale, b, act="token"), rtol=0, atol=0)
