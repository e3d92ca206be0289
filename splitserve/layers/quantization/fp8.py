"""FP8 (E4M3) linear layers, W8A8 or weight-only, and the `fp8` quantization config.

One method serves every FP8 layout the supported formats write:

    weights      tensor   one scale per tensor; a merged layer holds one per shard (they differ)
                 channel  one scale per output feature
                 block    one scale per [bn, bk] block (`weight_scale_inv` in DeepSeek-style files)
    activations  static   one calibrated per-tensor scale (`input_scale`; a merged layer uses the
                          largest of its shards', as the input is the same)
                 token    dynamic, one scale per token
                 group    dynamic, one scale per token and bk input features (with block weights)
                 none     weight-only: the weights are dequantized and the matmul runs in float

Online quantization (`--quantization fp8` on a float checkpoint) loads float weights and quantizes
them per output channel once loading is done; activations are per token.

On CPU the layer is emulated: activations are quantized exactly as on the GPU, then both sides are
dequantized and multiplied in float32 (what the checkpoint's own library computes as reference).
`Fp8LinearMethod.gpu_matmul` is where the GPU matmul is chosen: dynamic per-token activations with
per-channel (or per-shard) weight scales go to `kernels.gemm.fp8_linear` (our split-K Triton kernel
for few tokens, torch._scaled_mm for many), as a custom op so that torch.compile treats it as one
opaque call; static activation scales use torch._scaled_mm directly. A gated MLP's down projection
with those activations takes gate_up instead (`apply_silu_mul`, the op `splitserve::silu_mul_fp8_linear`):
one kernel computes silu(gate) * up and its per-token quantization (kernels/gemm/act_quant.py).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from splitserve.kernels.gemm.fp8.fp8_gemm import fp8_route, scaled_mm_linear
from splitserve.kernels.ops import fp8_linear_op, silu_mul_fp8_linear_op
from splitserve.layers.quantization import ops
from splitserve.layers.quantization.base import (UNQUANTIZED, LinearMethod, ParamLayout, QuantConfig, name_variants,
                                                 register_param, replace_param, same_method)

WEIGHT_STRATEGIES = ("tensor", "channel", "block")
ACTIVATION_STRATEGIES = ("static", "token", "group", "none")


@dataclass(frozen=True)
class Fp8Scheme:
    weights: str
    activations: str
    block: tuple[int, int] | None = None
    online: bool = False
    scale_name: str = "weight_scale"
    # compressed-tensors may write all-zero zero points beside symmetric scales
    zero_points: bool = False

    def __post_init__(self):
        if self.weights not in WEIGHT_STRATEGIES or self.activations not in ACTIVATION_STRATEGIES:
            raise ValueError(f"unsupported FP8 scheme: weights {self.weights!r}, activations {self.activations!r}")
        if (self.weights == "block") != (self.block is not None):
            raise ValueError("block-wise FP8 weights need a block shape, and only they have one")
        if self.activations == "group" and self.weights != "block":
            raise ValueError("per-group FP8 activations come only with block-wise weights")
        if self.weights == "block" and self.activations not in ("group", "none"):
            raise ValueError(f"block-wise FP8 weights with {self.activations!r} activations are not supported "
                             f"(dynamic per-token-group activations are)")
        if self.online and (self.weights, self.activations) != ("channel", "token"):
            raise ValueError("online FP8 quantizes weights per channel and activations per token")

    def describe(self) -> str:
        w = f"{self.block[0]}x{self.block[1]}-block" if self.block else f"per-{self.weights}"
        a = {"static": "static per-tensor", "token": "dynamic per-token",
             "group": f"dynamic per-token-group ({self.block[1] if self.block else 0})",
             "none": "unquantized"}[self.activations]
        return f"FP8 {w} weights, {a} activations" + (" (quantized at load)" if self.online else "")


class Fp8LinearMethod(LinearMethod):
    def __init__(self, quantization: str, scheme: Fp8Scheme):
        self.quantization = quantization
        self.scheme = scheme

    def describe(self) -> str:
        return f"{self.quantization}: {self.scheme.describe()}"

    # -- weights ----------------------------------------------------------------------------------
    def create_weights(self, layer: nn.Module) -> None:
        s, n, k = self.scheme, layer.out_features, layer.in_features
        num_shards = max(1, len(layer.shard_offsets))
        if s.online:
            register_param(layer, "weight", torch.empty(n, k, dtype=layer.params_dtype), ParamLayout(output_dim=0, input_dim=1))
            return
        register_param(layer, "weight", torch.empty(n, k, dtype=ops.FP8), ParamLayout(output_dim=0, input_dim=1))
        if s.weights == "tensor":
            register_param(layer, s.scale_name, torch.ones(num_shards, dtype=torch.float32), ParamLayout(per_shard=True))
        elif s.weights == "channel":
            register_param(layer, s.scale_name, torch.ones(n, 1, dtype=torch.float32), ParamLayout(output_dim=0))
        else:
            bn, bk = s.block
            if s.activations == "group" and k % bk:
                raise ValueError(f"block-wise FP8 needs input features divisible by {bk}, got {k}")
            register_param(layer, s.scale_name, torch.ones(-(-n // bn), -(-k // bk), dtype=torch.float32),
                           ParamLayout(output_dim=0, pack_factor=bn, input_dim=1, input_pack_factor=bk))
        if s.activations == "static":
            register_param(layer, "input_scale", torch.ones(num_shards, dtype=torch.float32), ParamLayout(per_shard=True))

    def load(self, layer: nn.Module, name: str, tensor: torch.Tensor, shard: str | None) -> None:
        if self.scheme.zero_points and name in ("weight_zero_point", "input_zero_point"):
            if torch.count_nonzero(tensor.float()):
                raise ValueError(f"{name}: nonzero zero points (asymmetric FP8) are not supported")
            return  # symmetric: the zero point is zero and nothing stores it
        super().load(layer, name, tensor, shard)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        s = self.scheme
        if s.online:
            q, scale = ops.fp8_quantize_weight_per_channel(layer.weight.data)
            replace_param(layer, "weight", q)
            replace_param(layer, "weight_scale", scale)
        elif s.weights == "tensor":
            replace_param(layer, s.scale_name,
                          ops.per_shard_to_per_channel(layer.weight_scale.data, layer.shard_offsets, layer.out_features))
        elif s.weights == "channel":
            replace_param(layer, s.scale_name, getattr(layer, s.scale_name).data.reshape(-1).float().contiguous())
        if s.activations == "static":
            replace_param(layer, "input_scale", layer.input_scale.data.max().reshape(1))
        device = layer.weight.device
        # Decided once per layer (a constant for the compiler, never a per-step branch):
        # emulate on CPU; on the GPU torch._scaled_mm where it applies, else dequantize.
        layer.quant_compute_dtype = torch.float32 if device.type == "cpu" else layer.params_dtype
        layer.fp8_scaled_mm = (ops.has_fp8_matmul(device) and s.weights != "block" and s.activations != "none"
                               and layer.in_features % 16 == 0 and layer.out_features % 16 == 0)

    def init_random(self, layer: nn.Module, generator: torch.Generator) -> None:
        s = self.scheme
        if s.online:
            return  # float weights, drawn like any others, quantized after loading
        w = torch.empty(layer.out_features, layer.in_features, device=layer.weight.device)
        w.normal_(0.0, 0.02, generator=generator)
        if s.weights == "block":
            q, scale = ops.fp8_quantize_weight_blocks(w, s.block)
        else:
            q, scale = ops.fp8_quantize_weight_per_channel(w)
            if s.weights == "tensor":
                scale = scale.max().expand(getattr(layer, s.scale_name).shape)
                q = ops.fp8_quantize(w, scale[0])
        layer.weight.data.copy_(q)
        getattr(layer, s.scale_name).data.copy_(scale.reshape(getattr(layer, s.scale_name).shape))
        if s.activations == "static":
            layer.input_scale.data.fill_(4.0 / ops.FP8_MAX)  # activations up to about 4

    def cheaper_at_one_row(self, layer: nn.Module) -> bool:
        # With FP8_GEMV_MAX_M >= 1, one token takes the W8A16 GEMV (fp8_gemv.py), whose FFMAs grow with
        # each row; the tl.dot kernel pads x to 16 rows, so there one token costs what two do.
        s = self.scheme
        return (layer.fp8_scaled_mm and s.activations == "token" and s.weights in ("tensor", "channel")
                and fp8_route(1, 1, None) == "gemv")

    # -- compute ----------------------------------------------------------------------------------
    def quantize_input(self, layer: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a = self.scheme.activations
        if a == "static":
            return ops.fp8_quantize(x, layer.input_scale), layer.input_scale
        if a == "token":
            return ops.fp8_quantize_per_token(x)
        return ops.fp8_quantize_per_group(x, self.scheme.block[1])

    def dequantized_weight(self, layer: nn.Module) -> torch.Tensor:
        s = self.scheme
        scale = getattr(layer, s.scale_name)
        if s.weights == "block":
            return layer.weight.float() * ops.expand_block_scale(scale, s.block, layer.weight.shape)
        return layer.weight.float() * scale.unsqueeze(1)

    def dequantized_input(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if self.scheme.activations == "none":
            return x.float()
        q, scale = self.quantize_input(layer, x)
        if self.scheme.activations == "group":
            return ops.dequantize_per_group(q, scale)
        return q.float() * scale

    def emulated_matmul(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """Quantize the activations, dequantize both sides, multiply in `quant_compute_dtype`
        (float32 on CPU): the computation the checkpoint format defines, without FP8 hardware."""
        dt = layer.quant_compute_dtype
        bias = None if layer.bias is None else layer.bias.to(dt)
        return F.linear(self.dequantized_input(layer, x).to(dt), self.dequantized_weight(layer).to(dt), bias)

    def gpu_matmul(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """KERNEL PLUG-IN POINT (FP8 W8A8 on the GPU): [M, K] activations -> [M, N].

        torch._scaled_mm with row-wise scales: per-token (or a static scale spread over the tokens)
        for the activations, per output feature for the weights (per-shard scales were spread
        over their shards' features at load, exactly). Dynamic per-token activations go to our
        kernels (fp8_linear_op), which quantize few-token inputs per 128-input group inside the GEMM."""
        if self.scheme.activations == "token" and x.dtype in (torch.bfloat16, torch.float16):
            return fp8_linear_op(x, layer.weight, layer.weight_scale, layer.bias)
        q, scale = self.quantize_input(layer, x)
        return scaled_mm_linear(q, scale, layer.weight, layer.weight_scale, layer.bias, torch.bfloat16)

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        out = self.gpu_matmul(layer, x2) if layer.fp8_scaled_mm else self.emulated_matmul(layer, x2)
        return out.to(x.dtype).reshape(*x.shape[:-1], layer.out_features)

    def apply_silu_mul(self, layer: nn.Module, gate_up: torch.Tensor) -> torch.Tensor:
        """On the GPU with dynamic per-token activations (per-tensor or per-channel weight scales):
        the custom op that fuses silu·mul into the per-token quantization (act_quant.py). Elsewhere
        (CPU emulation, static or group activations) silu_and_mul, then apply."""
        if layer.fp8_scaled_mm and self.scheme.activations == "token" and gate_up.dtype in (torch.bfloat16, torch.float16):
            out = silu_mul_fp8_linear_op(gate_up.reshape(-1, gate_up.shape[-1]), layer.weight, layer.weight_scale,
                                         layer.bias)
            return out.reshape(*gate_up.shape[:-1], layer.out_features)
        return super().apply_silu_mul(layer, gate_up)




# -- the "fp8" quantization config ------------------------------------------------------------------
def name_matches(name: str, pattern: str) -> bool:
    """`pattern` names this module or one of its ancestors, as whole dotted components
    ("lm_head", "layers.0.mlp"; "layers.1" does not match "layers.10"), in any of the name's
    spellings (base.name_variants)."""
    return any(re.search(rf"(^|\.){re.escape(p)}($|\.)", n) is not None
               for n in name_variants(name) for p in name_variants(pattern))


class Fp8Config(QuantConfig):
    """`quant_method: fp8` checkpoints (vLLM/AutoFP8 per-tensor ones, DeepSeek-style 128x128 blocks
    with `weight_block_size`), and `--quantization fp8` on a float checkpoint (online)."""

    name = "fp8"

    def __init__(self, scheme: Fp8Scheme, ignored: list[str]):
        self.method = Fp8LinearMethod(self.name, scheme)
        self.ignored = list(ignored)

    @classmethod
    def online(cls) -> "Fp8Config":
        # As in vLLM, the LM head stays in the model's dtype.
        return cls(Fp8Scheme("channel", "token", online=True), ["lm_head"])

    @classmethod
    def from_checkpoint(cls, cfg: dict) -> "Fp8Config":
        act = cfg.get("activation_scheme", "dynamic")
        if act not in ("static", "dynamic"):
            raise ValueError(f"fp8 checkpoint: unknown activation_scheme {act!r} (static or dynamic)")
        fmt = cfg.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ValueError(f"fp8 checkpoint: only the e4m3 format is supported, got {fmt!r}")
        block = cfg.get("weight_block_size")
        ignored = list(cfg.get("ignored_layers") or []) + list(cfg.get("modules_to_not_convert") or [])
        if block is not None:
            if act != "dynamic":
                raise ValueError("fp8 checkpoint: block-wise weights need activation_scheme 'dynamic'")
            if len(block) != 2:
                raise ValueError(f"fp8 checkpoint: weight_block_size must be [rows, cols], got {block}")
            scheme = Fp8Scheme("block", "group", tuple(int(b) for b in block), scale_name="weight_scale_inv")
        else:
            scheme = Fp8Scheme("tensor", "static" if act == "static" else "token")
        return cls(scheme, ignored)

    def linear_method(self, names: list[str]) -> LinearMethod:
        methods = [UNQUANTIZED if any(name_matches(n, p) for p in self.ignored) else self.method for n in names]
        return same_method(methods, names)

    def describe(self) -> str:
        return self.method.describe()
