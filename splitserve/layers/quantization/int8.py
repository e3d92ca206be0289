"""W8A8 INT8 linear layers (SmoothQuant-style, as llm-compressor writes them with compressed-tensors):
symmetric int8 weights with a scale per output channel (or per tensor, one per merged shard) and
int8 activations with a dynamic scale per token (or one static per-tensor scale). The smoothing
itself is already folded into the weights and the preceding norms, so serving needs nothing else.

On CPU the layer is emulated (activations quantized as on the GPU, both sides dequantized, float32
matmul). On CUDA `Int8LinearMethod.gpu_matmul` calls kernels.gemm.int8_linear (a one-launch
per-token quantization, then a Triton int8 GEMM with the scales, bias and cast in its epilogue) as the
custom op `splitserve::int8_linear`, which torch.compile treats as one opaque call. A gated MLP's
down projection with dynamic activations takes gate_up instead (`apply_silu_mul`, the op
`splitserve::silu_mul_int8_linear`): one kernel computes silu(gate) * up and its per-token quantization.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from splitserve.kernels.ops import int8_linear_op, silu_mul_int8_linear_op
from splitserve.layers.quantization import ops
from splitserve.layers.quantization.base import LinearMethod, ParamLayout, register_param, replace_param

@dataclass(frozen=True)
class Int8Scheme:
    weights: str        # "channel" | "tensor"
    activations: str    # "token" (dynamic) | "static"
    zero_points: bool = False

    def __post_init__(self):
        if self.weights not in ("channel", "tensor") or self.activations not in ("token", "static"):
            raise ValueError(f"unsupported W8A8 INT8 scheme: weights {self.weights!r}, activations {self.activations!r}")

    def describe(self) -> str:
        a = "dynamic per-token" if self.activations == "token" else "static per-tensor"
        return f"W8A8 INT8, per-{self.weights} weights, {a} activations"


class Int8LinearMethod(LinearMethod):
    def __init__(self, quantization: str, scheme: Int8Scheme):
        self.quantization = quantization
        self.scheme = scheme

    def describe(self) -> str:
        return f"{self.quantization}: {self.scheme.describe()}"

    def create_weights(self, layer: nn.Module) -> None:
        n, k = layer.out_features, layer.in_features
        num_shards = max(1, len(layer.shard_offsets))
        register_param(layer, "weight", torch.empty(n, k, dtype=torch.int8), ParamLayout(output_dim=0, input_dim=1))
        if self.scheme.weights == "channel":
            register_param(layer, "weight_scale", torch.ones(n, 1, dtype=torch.float32), ParamLayout(output_dim=0))
        else:
            register_param(layer, "weight_scale", torch.ones(num_shards, dtype=torch.float32), ParamLayout(per_shard=True))
        if self.scheme.activations == "static":
            register_param(layer, "input_scale", torch.ones(num_shards, dtype=torch.float32), ParamLayout(per_shard=True))

    def load(self, layer: nn.Module, name: str, tensor: torch.Tensor, shard: str | None) -> None:
        if self.scheme.zero_points and name in ("weight_zero_point", "input_zero_point"):
            if torch.count_nonzero(tensor):
                raise ValueError(f"{name}: nonzero zero points (asymmetric INT8) are not supported")
            return
        super().load(layer, name, tensor, shard)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if self.scheme.weights == "tensor":
            scale = ops.per_shard_to_per_channel(layer.weight_scale.data, layer.shard_offsets, layer.out_features)
        else:
            scale = layer.weight_scale.data.reshape(-1).float().contiguous()
        replace_param(layer, "weight_scale", scale)
        if self.scheme.activations == "static":
            replace_param(layer, "input_scale", layer.input_scale.data.max().reshape(1))
        device = layer.weight.device
        layer.quant_compute_dtype = torch.float32 if device.type == "cpu" else layer.params_dtype
        # the weight stays [N, K] (K contiguous): the kernels read it as the K-major operand int8 MMAs want
        layer.int8_triton = device.type == "cuda"

    def init_random(self, layer: nn.Module, generator: torch.Generator) -> None:
        w = torch.empty(layer.out_features, layer.in_features, device=layer.weight.device)
        w.normal_(0.0, 0.02, generator=generator)
        q, scale = ops.int8_quantize_weight_per_channel(w)
        if self.scheme.weights == "tensor":
            scale = scale.max().expand(layer.weight_scale.shape)
            q = ops.int8_quantize(w, scale[0])
        layer.weight.data.copy_(q)
        layer.weight_scale.data.copy_(scale.reshape(layer.weight_scale.shape))
        if self.scheme.activations == "static":
            layer.input_scale.data.fill_(4.0 / ops.INT8_HALF_RANGE)

    def quantize_input(self, layer: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.scheme.activations == "static":
            return ops.int8_quantize(x, layer.input_scale), layer.input_scale
        return ops.int8_quantize_per_token(x)

    def emulated_matmul(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        dt = layer.quant_compute_dtype
        q, scale = self.quantize_input(layer, x)
        w = layer.weight.float() * layer.weight_scale.unsqueeze(1)
        bias = None if layer.bias is None else layer.bias.to(dt)
        return F.linear((q.float() * scale).to(dt), w.to(dt), bias)

    def gpu_matmul(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """KERNEL PLUG-IN POINT (W8A8 INT8 on the GPU): [M, K] activations -> [M, N] in x's dtype.

        One op for every token count (no branch on M in the traced graph): the activations are
        quantized per token (or with the static scale) in one launch, then the Triton GEMM
        accumulates in int32 and applies both scales and the bias before writing bf16/fp16
        (kernels/gemm/int8/int8_gemm.py; its tile table splits K for few tokens)."""
        input_scale = layer.input_scale if self.scheme.activations == "static" else None
        return int8_linear_op(x, layer.weight, layer.weight_scale, layer.bias, input_scale)

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        out = self.gpu_matmul(layer, x2) if layer.int8_triton else self.emulated_matmul(layer, x2)
        return out.to(x.dtype).reshape(*x.shape[:-1], layer.out_features)

    def apply_silu_mul(self, layer: nn.Module, gate_up: torch.Tensor) -> torch.Tensor:
        """On the GPU with dynamic per-token activations: the custom op that fuses silu·mul into the
        per-token quantization (act_quant.py) before the Triton GEMM. Otherwise silu_and_mul, then apply."""
        if layer.int8_triton and self.scheme.activations == "token":
            out = silu_mul_int8_linear_op(gate_up.reshape(-1, gate_up.shape[-1]), layer.weight, layer.weight_scale,
                                          layer.bias)
            return out.reshape(*gate_up.shape[:-1], layer.out_features)
        return super().apply_silu_mul(layer, gate_up)


