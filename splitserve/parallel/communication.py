"""Collectives of the tensor-parallel group, and the hand-over between pipeline stages.

`tp_all_reduce` / `tp_all_gather` are what the parallel layers call. With a group of one they return
their input without a call of any kind (the branch is on a Python int, decided when torch.compile
traces, so the single-device graph holds no collective at all). Otherwise they call the custom ops
`splitserve::all_reduce` / `splitserve::all_gather`: opaque to torch.compile (one node in the
compiled region, with a fake implementation for tracing) and plain NCCL/gloo calls underneath, which
CUDA graphs capture. The ops name the group ("tp", "pp") rather than take it, since a custom op's
arguments must be tensors or plain values.

Pipeline stages hand an `Intermediate` (hidden, residual) to the next stage; the transfer itself is
parallel/pipeline.py's.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from splitserve.parallel.parallel_state import ParallelGroup, pp_group, tp_group

_GROUPS = {"tp": tp_group, "pp": pp_group}


def _group(name: str) -> ParallelGroup:
    if name not in _GROUPS:
        raise ValueError(f"unknown process group {name!r} (tp or pp)")
    return _GROUPS[name]()


@torch.library.custom_op("splitserve::all_reduce", mutates_args=())
def all_reduce_op(x: torch.Tensor, group_name: str) -> torch.Tensor:
    out = x.clone()
    dist.all_reduce(out, group=_group(group_name).group)
    return out


@all_reduce_op.register_fake
def _(x, group_name):
    return torch.empty_like(x)


@torch.library.custom_op("splitserve::all_gather", mutates_args=())
def all_gather_op(x: torch.Tensor, group_name: str, world_size: int) -> torch.Tensor:
    """[..., n] on every rank -> [..., world_size * n], rank r's part at [r * n, (r + 1) * n)."""
    parts = [torch.empty_like(x) for _ in range(world_size)]
    dist.all_gather(parts, x.contiguous(), group=_group(group_name).group)
    return torch.cat(parts, dim=-1)


@all_gather_op.register_fake
def _(x, group_name, world_size):
    return x.new_empty((*x.shape[:-1], x.shape[-1] * world_size))


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of x over the tensor-parallel group (x itself for a group of one)."""
    if tp_group().world_size == 1:
        return x
    return all_reduce_op(x, "tp")


def tp_all_gather(x: torch.Tensor) -> torch.Tensor:
    """The ranks' x concatenated along the last dimension, in rank order (x for a group of one)."""
    size = tp_group().world_size
    if size == 1:
        return x
    return all_gather_op(x, "tp", size)


# -- pipeline stages --------------------------------------------------------------------------------
class Intermediate(NamedTuple):
    """What a pipeline stage that is not the last hands to the next: the decoder's stream after its
    last layer, [T, hidden] each (the residual is kept apart, as the next layer's norm adds it).
    A plain (hidden, residual) pair to the transfer code (parallel/pipeline.py)."""
    hidden: torch.Tensor
    residual: torch.Tensor
