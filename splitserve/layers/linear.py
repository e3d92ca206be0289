"""Linear layers that load Hugging Face checkpoints, including merged projections.

Merged layers (QKV, gate+up) run one matmul over the flat token stream instead of several; their
shards sit one after another along the output features, and loading places each checkpoint tensor
in its shard. What a layer stores and how it computes belong to its quantization method
(`layers/quantization/base.py`); the default one is the plain float `weight` and `F.linear`.
"""
from __future__ import annotations

import torch
from torch import nn

from splitserve.layers.quantization.base import (UNQUANTIZED, LinearMethod, ParamLayout, as_tensor, rank_part,
                                                 register_param)


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False, method: LinearMethod | None = None,
                 shard_sizes: dict[str, int] | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.params_dtype = torch.get_default_dtype()  # the activations' dtype, whatever the weights hold
        # shard name -> (first output feature, number of output features); empty for a plain layer
        self.shard_offsets: dict[str, tuple[int, int]] = {}
        offset = 0
        for name, size in (shard_sizes or {}).items():
            self.shard_offsets[name] = (offset, size)
            offset += size
        if shard_sizes and offset != out_features:
            raise ValueError(f"shard sizes add up to {offset}, not {out_features} output features")
        self.param_layouts: dict[str, ParamLayout] = {}
        self.method = method or UNQUANTIZED
        self.method.create_weights(self)
        if bias:
            register_param(self, "bias", torch.empty(out_features, dtype=self.params_dtype), ParamLayout(output_dim=0))
        else:
            self.bias = None

    @property
    def is_quantized(self) -> bool:
        return self.method.quantization is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x)

    def forward_silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """forward(silu(gate) * up) for gate_up = [gate | up]; the method may fuse the two."""
        return self.method.apply_silu_mul(self, gate_up)

    def load(self, param_name: str, tensor: torch.Tensor, shard: str | None = None) -> None:
        """One checkpoint tensor (`weight`, `bias`, or a method's own such as `weight_scale`), of
        the whole layer or, for a merged one, of the shard named. A tensor-parallel layer keeps its
        rank's part (cut before the tensor is read when it is a lazy checkpoint slice)."""
        if shard is not None and shard not in self.shard_offsets:
            raise ValueError(f"unknown shard {shard!r}; this layer has {list(self.shard_offsets) or 'none'}")
        self.method.load(self, param_name, as_tensor(rank_part(self, param_name, tensor, shard)), shard)

    def process_weights_after_loading(self) -> None:
        self.method.process_weights_after_loading(self)

    def extra_repr(self) -> str:
        quant = f", quantization={self.method.describe()}" if self.is_quantized else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}{quant}"


class MergedLinear(Linear):
    """Several output projections of the same input stacked along the output dimension."""

    def __init__(self, in_features: int, shard_sizes: dict[str, int], bias: bool = False,
                 method: LinearMethod | None = None):
        super().__init__(in_features, sum(shard_sizes.values()), bias, method, shard_sizes)

    def split(self, out: torch.Tensor) -> list[torch.Tensor]:
        return list(out.split([s for _, s in self.shard_offsets.values()], dim=-1))


def process_weights_after_loading(model: nn.Module) -> None:
    """Lets every linear layer's method finish its weights (online quantization, merged scales)."""
    for module in model.modules():
        if isinstance(module, Linear):
            module.process_weights_after_loading()


def cheaper_at_one_row(model: nn.Module) -> bool:
    """Some linear layer of the model costs less at one token than at two
    (LinearMethod.cheaper_at_one_row): a single decoding sequence should not be padded to two."""
    return any(module.method.cheaper_at_one_row(module) for module in model.modules() if isinstance(module, Linear))
