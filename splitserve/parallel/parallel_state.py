"""Which ranks a process shares its work with: the tensor-parallel and pipeline-parallel groups.

One process per device. Ranks are numbered pipeline-stage-major: global rank = pp_rank * tp_size +
tp_rank, so a tensor-parallel group is tp_size consecutive ranks (one host, fast links) and the
pipeline stages follow one another (across hosts). Before `init_model_parallel`, and always in a
single-process engine, both groups have size 1: layers ask the group and skip all communication, so the
one-device path pays nothing for the existence of this module.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class ParallelGroup:
    rank: int = 0                # this process's rank inside the group
    world_size: int = 1
    group: object | None = None  # the torch.distributed process group; None for size 1
    ranks: tuple[int, ...] = (0,)  # the global ranks of the group, in group-rank order

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.world_size - 1


_TP = ParallelGroup()
_PP = ParallelGroup()


def tp_group() -> ParallelGroup:
    return _TP


def pp_group() -> ParallelGroup:
    return _PP


def init_model_parallel(*, tp_size: int, pp_size: int, rank: int, backend: str, init_method: str,
                        timeout_s: float = 600.0) -> None:
    """Joins the default process group (world size tp_size * pp_size) and builds this rank's groups.
    Every rank calls it with the same sizes and init_method (e.g. "tcp://host:port")."""
    global _TP, _PP
    import datetime
    world = tp_size * pp_size
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside a world of {world} (tp {tp_size} x pp {pp_size})")
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend, init_method=init_method, world_size=world, rank=rank,
                                timeout=datetime.timedelta(seconds=timeout_s))
    pp_rank, tp_rank = divmod(rank, tp_size)
    tp, pp = None, None
    # new_group is collective: every rank creates every group, in the same order.
    for stage in range(pp_size):
        ranks = tuple(range(stage * tp_size, (stage + 1) * tp_size))
        g = dist.new_group(list(ranks)) if world > 1 else None
        if stage == pp_rank:
            tp = ParallelGroup(tp_rank, tp_size, g if tp_size > 1 else None, ranks)
    for column in range(tp_size):
        ranks = tuple(range(column, world, tp_size))
        g = dist.new_group(list(ranks)) if world > 1 else None
        if column == tp_rank:
            pp = ParallelGroup(pp_rank, pp_size, g if pp_size > 1 else None, ranks)
    _TP, _PP = tp, pp


def destroy_model_parallel() -> None:
    global _TP, _PP
    _TP, _PP = ParallelGroup(), ParallelGroup()
    if dist.is_initialized():
        dist.destroy_process_group()


def stage_layers(num_layers: int, stage: int, num_stages: int) -> tuple[int, int]:
    """[start, end) of the decoder layers pipeline stage `stage` builds: an even split, and the
    layers left over go one each to the stages before the last, from the second-to-last backwards
    (the last stage also runs the final norm and the LM head; the first only adds the embedding)."""
    if num_layers < num_stages:
        raise ValueError(f"pipeline parallelism: {num_layers} decoder layers cannot fill {num_stages} stages")
    sizes = [num_layers // num_stages] * num_stages
    for i in range(num_layers % num_stages):
        sizes[(num_stages - 2 - i) % num_stages] += 1
    start = sum(sizes[:stage])
    return start, start + sizes[stage]
