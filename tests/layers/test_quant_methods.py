"""Quantized linear methods, one layer at a time, against compressed-tensors' own fake quantization
(an independent implementation of the same formats), plus the seam's loading rules."""
import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from splitserve.layers.linear import Linear, MergedLinear
from splitserve.layers.quantization.base import LinearMethod, ParamLayout, UnclaimedTensorError, register_param
from splitserve.layers.quantization.compressed_tensors import CompressedTensorsConfig
from splitserve.layers.quantization.config import resolve_quant_config
from splitserve.layers.quantization.fp8 import Fp8Config
from tests import triton_interpreter_shims

triton_interpreter_shims.install()  # W8A8's gpu_matmul runs Triton kernels (the interpreter on CPU)


SHARDS = {"q": 256, "k": 128, "v": 128}
PRESETS = ("FP8", "FP8_DYNAMIC", "FP8_BLOCK", "W8A8")


class Projections(nn.Module):
    """Three nn.Linear of one input, as a checkpoint holds q/k/v before splitserve merges them."""

    def __init__(self, gen):
        super().__init__()
        for name, size in SHARDS.items():
            lin = nn.Linear(256, size, bias=False)
            lin.weight.data = torch.randn(size, 256, generator=gen) * (0.02 * (1 + list(SHARDS).index(name)))
            setattr(self, f"{name}_proj", lin)


def quantized_reference(preset: str, seed: int):
    """(compressed-tensors config dict, compressed state dict, fake-quantizing float module)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationConfig, apply_quantization_config,
                                                 preset_name_to_scheme)
    from tests.quant_reference import _half_range, _weight_scale
    gen = torch.Generator().manual_seed(seed)
    model = Projections(gen)
    config = QuantizationConfig(config_groups={"g": preset_name_to_scheme(preset, ["Linear"])})
    apply_quantization_config(model, config, show_progress=False)
    for i, (name, _) in enumerate(SHARDS.items()):
        mod = getattr(model, f"{name}_proj")
        mod.weight_scale.data.copy_(_weight_scale(mod.weight.data, mod.quantization_scheme.weights))
        act = mod.quantization_scheme.input_activations
        if not act.dynamic:
            mod.input_scale.data.fill_(3.0 / _half_range(act))  # the same input: the same calibrated scale
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    cfg = json.loads(compressor.quantization_config.model_dump_json())
    state = {k: v.clone() for k, v in model.state_dict().items()}
    compressor.decompress_model(model)
    return cfg, state, model


def build_merged(cfg: dict, state: dict) -> MergedLinear:
    method = CompressedTensorsConfig(cfg).linear_method([f"{n}_proj" for n in SHARDS])
    layer = MergedLinear(256, SHARDS, method=method)
    for key, value in state.items():
        module, _, param = key.rpartition(".")
        layer.load(param, value, module[:-len("_proj")])
    layer.process_weights_after_loading()
    return layer


@pytest.mark.parametrize("preset", PRESETS)
def test_merged_layer_equals_compressed_tensors_fake_quantization(preset):
    cfg, state, ref = quantized_reference(preset, seed=PRESETS.index(preset))
    layer = build_merged(cfg, state)
    x = torch.randn(1, 9, 256, generator=torch.Generator().manual_seed(5)) * 2  # [batch, tokens, K]: per token
    with torch.no_grad():
        want = torch.cat([getattr(ref, f"{n}_proj")(x) for n in SHARDS], dim=-1)
        got = layer(x[0])
    torch.testing.assert_close(got, want[0], rtol=1e-5, atol=1e-5)
    if preset == "FP8":  # per-tensor scales differ per shard: each kept (no requantization)
        scales = [state[f"{n}_proj.weight_scale"].item() for n in SHARDS]
        assert len(set(scales)) == 3
        assert [s.unique().tolist() for s in layer.split(layer.weight_scale)] == [[s] for s in scales]


@pytest.mark.parametrize("preset", ("FP8", "FP8_DYNAMIC", "W8A8"))
def test_gpu_matmul_equals_the_emulation(preset):
    """The GPU path (torch._scaled_mm, also on CPU; W8A8's Triton kernels, in the interpreter on CPU)
    computes what the CPU emulation does, up to accumulation order and the bf16 output of _scaled_mm."""
    cfg, state, _ = quantized_reference(preset, seed=11)
    layer = build_merged(cfg, state)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(3))
    emulated = layer.method.emulated_matmul(layer, x)
    gpu = layer.method.gpu_matmul(layer, x).float()
    torch.testing.assert_close(gpu, emulated, rtol=1e-2, atol=1e-2 * emulated.abs().max().item())


def test_online_fp8_quantizes_per_channel_and_tokens():
    """--quantization fp8: float weights in, FP8 per output channel after loading; the layer equals
    compressed-tensors' FP8_DYNAMIC fake quantization of the same float weights."""
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config, preset_name_to_scheme
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(192, 128, generator=gen) * 0.05
    layer = MergedLinear(128, {"gate": 96, "up": 96}, method=Fp8Config.online().linear_method(["gate", "up"]))
    layer.load("weight", w[:96], "gate")
    layer.load("weight", w[96:], "up")
    layer.process_weights_after_loading()
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight_scale.shape == (192,)
    ref = nn.Linear(128, 192, bias=False)
    ref.weight.data = w.clone()
    apply_quantization_config(ref, QuantizationConfig(config_groups={"g": preset_name_to_scheme("FP8_DYNAMIC", ["Linear"])}),
                              show_progress=False)
    ref.weight_scale.data.copy_(w.abs().amax(1, keepdim=True) / 448.0)
    x = torch.randn(1, 7, 128, generator=gen)
    with torch.no_grad():
        torch.testing.assert_close(layer(x[0]), ref(x)[0], rtol=1e-5, atol=1e-5)
    assert Fp8Config.online().linear_method(["lm_head"]).quantization is None  # the head stays float


def test_unquantized_layer_is_plain_f_linear():
    gen = torch.Generator().manual_seed(0)
    layer = MergedLinear(16, {"a": 8, "b": 24}, bias=True)
    assert [n for n, _ in layer.named_parameters()] == ["weight", "bias"]
    w, b = torch.randn(32, 16, generator=gen), torch.randn(32, generator=gen)
    layer.load("weight", w[:8], "a"), layer.load("weight", w[8:], "b")
    layer.load("bias", b)
    x = torch.randn(5, 16, generator=gen)
    assert torch.equal(layer(x), F.linear(x, w, b))
    with pytest.raises(UnclaimedTensorError, match="weight_scale"):
        layer.load("weight_scale", torch.ones(1), "a")


class PackedInt4Method(LinearMethod):
    """A W4A16-shaped method written against the seam alone: int4 packed 8 per int32 along the
    output features (AWQ's layout), group scales [K / g, N], packed zero points, a g_idx every shard
    shares. It only declares layouts; the generic loader does the shard arithmetic."""
    quantization = "test-int4"

    def create_weights(self, layer):
        n, k, g = layer.out_features, layer.in_features, 4
        register_param(layer, "qweight", torch.zeros(k, n // 8, dtype=torch.int32), ParamLayout(output_dim=1, pack_factor=8))
        register_param(layer, "scales", torch.zeros(k // g, n), ParamLayout(output_dim=1))
        register_param(layer, "qzeros", torch.zeros(k // g, n // 8, dtype=torch.int32), ParamLayout(output_dim=1, pack_factor=8))
        register_param(layer, "g_idx", torch.zeros(k, dtype=torch.int32), ParamLayout(output_dim=None))

    def apply(self, layer, x):
        raise NotImplementedError


def test_packed_shards_load_at_packed_offsets():
    layer = MergedLinear(16, {"gate": 32, "up": 16}, method=PackedInt4Method())
    gen = torch.Generator().manual_seed(1)
    parts = {s: {"qweight": torch.randint(0, 2**31 - 1, (16, size // 8), generator=gen, dtype=torch.int32),
                 "scales": torch.randn(4, size, generator=gen),
                 "qzeros": torch.randint(0, 2**31 - 1, (4, size // 8), generator=gen, dtype=torch.int32)}
             for s, size in (("gate", 32), ("up", 16))}
    for shard, tensors in parts.items():
        for name, t in tensors.items():
            layer.load(name, t, shard)
        layer.load("g_idx", torch.arange(16, dtype=torch.int32) // 4, shard)
    for name in ("qweight", "scales", "qzeros"):
        assert torch.equal(getattr(layer, name), torch.cat([parts["gate"][name], parts["up"][name]], dim=1))
    assert torch.equal(layer.g_idx, torch.arange(16, dtype=torch.int32) // 4)
    with pytest.raises(ValueError, match="does not match"):
        layer.load("scales", torch.randn(4, 8), "up")


def test_block_scales_follow_their_shards():
    """128x128 blocks: a shard's block rows start at offset / 128; a shard not on a block edge is refused."""
    method = Fp8Config.from_checkpoint({"quant_method": "fp8", "weight_block_size": [128, 128]}).linear_method(["a", "b"])
    layer = MergedLinear(256, {"a": 256, "b": 128}, method=method)
    layer.load("weight_scale_inv", torch.full((2, 2), 2.0), "a")
    layer.load("weight_scale_inv", torch.full((1, 2), 3.0), "b")
    assert layer.weight_scale_inv.tolist() == [[2.0, 2.0], [2.0, 2.0], [3.0, 3.0]]
    odd = MergedLinear(256, {"a": 64, "b": 192}, method=method)
    with pytest.raises(ValueError, match="not a multiple of 128"):
        odd.load("weight_scale_inv", torch.ones(2, 2), "b")


# -- which config, and the errors -------------------------------------------------------------------
class Cfg:
    def __init__(self, qc=None):
        if qc is not None:
            self.quantization_config = qc


FP8_GROUP = {"targets": ["Linear"], "format": "float-quantized",
             "weights": {"type": "float", "num_bits": 8, "strategy": "channel", "symmetric": True, "dynamic": False},
             "input_activations": {"type": "float", "num_bits": 8, "strategy": "token", "symmetric": True,
                                   "dynamic": True}}


def ct(**groups):
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head", "re:.*gate_proj$"],
            "config_groups": groups or {"group_0": FP8_GROUP}}


def test_resolution():
    assert resolve_quant_config(None, Cfg(), None) is None
    assert resolve_quant_config("fp8", Cfg(), None).describe().startswith("fp8: FP8 per-channel weights")
    config = resolve_quant_config(None, Cfg(ct()), None)
    assert config.name == "compressed-tensors"
    assert config.linear_method(["model.layers.0.self_attn.q_proj"]).quantization == "compressed-tensors"
    assert config.linear_method(["lm_head"]).quantization is None
    assert config.linear_method(["model.layers.0.mlp.down_proj"]).quantization == "compressed-tensors"
    with pytest.raises(ValueError, match="quantized differently"):  # gate ignored, up not: one matmul cannot
        config.linear_method(["model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"])


@pytest.mark.parametrize("requested, qc, message", [
    ("gptq_marlin", None, "'gptq_marlin' is not supported yet"),
    ("gptq", None, "needs a checkpoint quantized in that format"),
    ("int3", None, "'int3' is unknown"),
    ("modelopt", None, "needs a checkpoint quantized in that format"),
    (None, {"quant_method": "awq", "bits": 4, "version": "gemv"}, "only the GEMM packing"),
    (None, {"quant_method": "gptq", "bits": 4, "group_size": 100}, "group size 100 is not supported"),
    ("modelopt", ct(), "quantized with 'compressed-tensors'"),
    (None, ct(g={**FP8_GROUP, "format": "pack-quantized", "input_activations": None,
                 "weights": {"type": "int", "num_bits": 4, "strategy": "tensor"}}),
     "weight-only integer quantization"),
    (None, ct(g={**FP8_GROUP, "weights": {**FP8_GROUP["weights"], "symmetric": False}}), "asymmetric"),
    (None, {"quant_method": "modelopt", "quant_algo": "NVFP4"}, "quant_algo 'NVFP4' is not supported"),
    (None, {"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]},
     "block-wise weights need activation_scheme 'dynamic'"),
])
def test_unsupported_quantization_is_a_clear_error(requested, qc, message):
    with pytest.raises(ValueError, match=message):
        resolve_quant_config(requested, Cfg(qc), None)


def test_weight_only_int_configs_resolve():
    gptq = resolve_quant_config(None, Cfg({"quant_method": "gptq", "bits": 8, "group_size": 64, "desc_act": True}), None)
    assert gptq.describe() == "gptq: W8A16 (group 64)"
    assert gptq.linear_method(["lm_head"]).quantization is None
    awq = resolve_quant_config("awq", Cfg({"quant_method": "awq", "w_bit": 4, "q_group_size": 32,
                                           "modules_to_not_convert": ["down_proj"]}), None)
    assert awq.describe() == "awq: W4A16 (group 32)"
    assert awq.linear_method(["model.layers.0.mlp.down_proj"]).quantization is None
    assert awq.linear_method(["model.layers.0.mlp.up_proj"]).quantization == "awq"
    w = {"type": "int", "num_bits": 4, "strategy": "group", "group_size": 128, "symmetric": False, "actorder": "group"}
    ct_cfg = resolve_quant_config(None, Cfg(ct(g={**FP8_GROUP, "format": "pack-quantized", "input_activations": None,
                                                  "weights": w})), None)
    assert ct_cfg.describe() == "compressed-tensors: W4A16 (group 128, asymmetric, act-order)"


def test_modelopt_is_found_beside_the_weights(tmp_path):
    (tmp_path / "hf_quant_config.json").write_text(json.dumps(
        {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "FP8", "exclude_modules": ["lm_head"]}}))
    config = resolve_quant_config(None, Cfg(), str(tmp_path))
    assert config.name == "modelopt"
    assert config.linear_method(["lm_head"]).quantization is None
    assert config.skip_tensor("model.layers.0.self_attn.k_proj.k_scale")


def test_ignore_lists_match_every_spelling_of_a_module_name():
    """compressed-tensors writes a VLM's ignore list as `language_model.lm_head`,
    `vision_tower.encoder...`; transformers names the modules `lm_head`, `model.vision_tower...`."""
    config = resolve_quant_config(None, Cfg({**ct(), "ignore": ["language_model.lm_head", "vision_tower.encoder.layers.0.mlp.fc1",
                                                                "re:layers.1.mlp"]}), None)
    method = config.linear_method
    assert method(["lm_head"]).quantization is None
    assert method(["model.vision_tower.encoder.layers.0.mlp.fc1"]).quantization is None
    assert method(["model.language_model.layers.1.mlp.down_proj"]).quantization is None
    assert method(["model.language_model.layers.0.mlp.down_proj"]).quantization == "compressed-tensors"
    assert method(["model.language_model.layers.10.mlp.down_proj"]).quantization == "compressed-tensors"


def test_wna16_custom_op_is_opaque_and_matches_the_reference():
    """splitserve::wna16_linear (what CUDA layers call) passes torch.library's checks, incl. its
    fake (shape-only) implementation used by torch.compile; on CPU it is the torch reference."""
    from splitserve.kernels.gemm.reference import wna16_gemm_ref
    from splitserve.kernels.gemm.wna16.wna16_layout import quantize_rtn
    from splitserve.kernels.ops import wna16_linear_op
    torch.manual_seed(0)
    w = quantize_rtn(torch.randn(64, 128), bits=4, group_size=32, symmetric=False)
    x, bias = torch.randn(3, 128), torch.randn(64)
    perm = torch.randperm(128).to(torch.int32)
    args = (x, w.qweight, w.scales, w.zeros, perm, bias, 4, 32)
    torch.library.opcheck(wna16_linear_op, args)
    expected = wna16_gemm_ref(x, w.qweight, w.scales, w.zeros, bits=4, group_size=32, perm=perm, bias=bias)
    torch.testing.assert_close(wna16_linear_op(*args), expected)
