"""Linear layers that load Hugging Face checkpoints, including merged projections.

Merged layers (QKV, gate+up) run one matmul over the flat token stream instead of several; their
weight loader places each checkpoint tensor in its shard of the merged weight.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# On CPU, MKL's fp32 GEMM with few rows (a decode step: one row per sequence) runs a wide weight
# slower than the same weight in blocks of ~1k output columns (measured on the CI's 2-core AVX2 EPYC,
# one thread, 16 rows: the 3072-wide gate_up 13% faster, the 49k-wide LM head 27%). Each output is
# the same dot product either way (the results were bit-identical there). With one row MKL takes its
# matrix-vector path, which blocks only slow down; with hundreds of rows (prefill) blocks gain nothing.
CPU_COLUMN_BLOCK = 1024
CPU_BLOCKED_ROWS = (2, 128)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, on CPU in column blocks where that is faster (see above)."""
    n = weight.shape[0]
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if (x.device.type != "cpu" or n < 2 * CPU_COLUMN_BLOCK or not CPU_BLOCKED_ROWS[0] <= rows <= CPU_BLOCKED_ROWS[1]
            or torch.compiler.is_compiling()):
        return F.linear(x, weight, bias)
    x2 = x.reshape(rows, x.shape[-1])
    out = x2.new_empty(rows, n)
    for start in range(0, n, CPU_COLUMN_BLOCK):
        end = min(start + CPU_COLUMN_BLOCK, n)
        out[:, start:end] = F.linear(x2, weight[start:end], None if bias is None else bias[start:end])
    return out.view(*x.shape[:-1], n)


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)

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
