"""Collectives of the tensor-parallel group, and the hand-over between pipeline stages.

`tp_all_reduce` / `tp_all_gather` are what the parallel layers call. With a group of one they return
their input without a call of any kind (the branch is on a Python int, decided when torch.compile
traces, so the single-device graph holds no collective at all). Otherwise they call the custom ops
`splitserve::all_reduce` / `splitserve::all_gather`: opaque to torch.compile (one node in the
compiled region, with a fake implementation for tracing) and plain NCCL/gloo calls underneath, which
CUDA graphs capture. The ops name the group ("tp", "pp") rather than take it, since a custom op's
arguments must be tensors or plain values.

Pipeline stages hand (hidden, residual) to the next stage with point-to-point send/recv over the
pipeline group: `send_intermediate` / `recv_intermediate`, plain functions the worker calls between
its stage's forward and the next stage's.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from splitserve.distributed.parallel_state import ParallelGroup, pp_group, tp_group

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
@dataclass
class Intermediate:
    """What a pipeline stage that is not the last hands to the next: the decoder's stream after its
    last layer, [T, hidden] each (the residual is kept apart, as the next layer's norm adds it)."""
    hidden: torch.Tensor
    residual: torch.Tensor


def send_intermediate(inter: Intermediate) -> None:
    """Sends this stage's output to the next stage (the same tensor-parallel rank there)."""
    pp = pp_group()
    if pp.is_last:
        raise ValueError("the last pipeline stage has no next stage to send to")
    dst = pp.ranks[pp.rank + 1]
    dist.send(inter.hidden.contiguous(), dst=dst, group=pp.group)
    dist.send(inter.residual.contiguous(), dst=dst, group=pp.group)


def recv_intermediate(num_tokens: int, hidden_size: int, dtype: torch.dtype,
                      device: torch.device | str) -> Intermediate:
    """Receives the previous stage's output for a step of num_tokens tokens (every stage knows the
    step's token count from the step message, so no shape travels)."""
    pp = pp_group()
    if pp.is_first:
        raise ValueError("the first pipeline stage has no previous stage to receive from")
    src = pp.ranks[pp.rank - 1]
    hidden = torch.empty(num_tokens, hidden_size, dtype=dtype, device=device)
    residual = torch.empty_like(hidden)
    dist.recv(hidden, src=src, group=pp.group)
    dist.recv(residual, src=src, group=pp.group)
    return Intermediate(hidden, residual)
