"""Linear layers that load Hugging Face checkpoints, including merged projections.

Merged layers (QKV, gate+up) run one matmul over the flat token stream instead of several; their
weight loader places each checkpoint tensor in its shard of the merged weight.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def load(self, param_name: str, tensor: torch.Tensor, shard: str | None = None) -> None:
        param = getattr(self, param_name)
        if param.shape != tensor.shape:
            raise ValueError(f"weight shape {tuple(tensor.shape)} does not match {tuple(param.shape)}")
        param.data.copy_(tensor)


class MergedLinear(Linear):
    """Several output projections of the same input stacked along the output dimension."""

    def __init__(self, in_features: int, shard_sizes: dict[str, int], bias: bool = False):
        super().__init__(in_features, sum(shard_sizes.values()), bias)
        self.shard_offsets = {}
        offset = 0
        for name, size in shard_sizes.items():
            self.shard_offsets[name] = (offset, size)
            offset += size

    def load(self, param_name: str, tensor: torch.Tensor, shard: str | None = None) -> None:
        if shard is None:
            return super().load(param_name, tensor)
        offset, size = self.shard_offsets[shard]
        dest = getattr(self, param_name).data.narrow(0, offset, size)
        if dest.shape != tensor.shape:
            raise ValueError(f"shard {shard!r}: weight shape {tuple(tensor.shape)} does not match {tuple(dest.shape)}")
        dest.copy_(tensor)

    def split(self, out: torch.Tensor) -> list[torch.Tensor]:
        return list(out.split([s for _, s in self.shard_offsets.values()], dim=-1))
