"""The LoRA delta of one linear layer over the flat token stream, and the step's token -> slot layout.

The layout lives in one static int32 device buffer (`LoRALayout`), allocated once at its largest and
rewritten in place before every step that has adapters (lora/worker.py), so CUDA graphs captured
with the delta read each step's layout at replay:

    num_tiles   [1]                    tiles in use this step
    token_slots [max_tokens]           each flat token's slot, -1: no adapter (every row past the step's
                                       tokens too: a graph's padding rows have no adapter)
    tile_slots  [max_tiles]            the slot of each tile
    token_rows  [max_tiles * TILE]     the flat rows of the tokens that have an adapter, grouped by slot,
                                       each slot's group padded with -1 to a whole number of TILE rows

A tile is TILE consecutive entries of token_rows, all of one slot: the kernels (kernels/lora/shrink_expand.py) run
one program per (tile, output block) on a grid fixed by the padded token count, and programs past
num_tiles return at once. So a replayed graph needs no host value of the step, and a step whose
layout is empty costs only those empty launches.

The delta is the custom op `splitserve::lora_add_` (kernels/ops.py; opaque to torch.compile, like the
attention op),
which adds (x A[slot]^T) B[slot]^T into the base layer's output in place. On CUDA it runs the Triton
kernels; elsewhere the torch reference below (per slot, on the host's view of token_slots), which is
also what the kernel tests compare with.
"""
from __future__ import annotations

import numpy as np
import torch

TILE = 16  # tokens per tile: the kernels' BLOCK_M


def max_tiles(num_tokens: int, max_loras: int) -> int:
    """Most tiles T tokens can need: each used slot's group rounds up to whole tiles, so at most
    (T + (TILE - 1) * slots) / TILE of them, and never more than T (a tile holds at least one token)."""
    return min(num_tokens, (num_tokens + (TILE - 1) * min(max_loras, num_tokens)) // TILE)


class LoRALayout:
    """The packed layout buffer and its four views (see the module docstring). The same class holds
    the device buffer and the host staging copies it is filled from."""

    def __init__(self, max_tokens: int, max_loras: int, device, pin: bool = False):
        self.max_tokens = max_tokens
        self.max_loras = max_loras
        self.max_tiles = max_tiles(max_tokens, max_loras)
        n = 1 + max_tokens + self.max_tiles * (1 + TILE)
        self.buffer = torch.full((n,), -1, dtype=torch.int32, device=device, pin_memory=pin)
        self.buffer[0] = 0
        b, t = self.buffer, self.max_tiles
        self.num_tiles = b[0:1]
        self.token_slots = b[1:1 + max_tokens]
        self.tile_slots = b[1 + max_tokens:1 + max_tokens + t]
        self.token_rows = b[1 + max_tokens + t:]

    def used_len(self, num_tiles: int) -> int:
        """Length of the prefix of `buffer` that a step with num_tiles tiles uses."""
        return 1 + self.max_tokens + self.max_tiles + num_tiles * TILE


def fill_layout(host: LoRALayout, token_slots: np.ndarray) -> int:
    """Writes the layout of a step whose tokens have these slots (-1: none) into `host` (a CPU
    LoRALayout); returns the number of tiles. Entries past the step's tokens become -1."""
    T = len(token_slots)
    if T > host.max_tokens:
        raise ValueError(f"a step of {T} tokens is larger than the LoRA layout's {host.max_tokens}")
    slots_np = host.token_slots.numpy()
    slots_np[:T] = token_slots
    slots_np[T:] = -1
    has = np.flatnonzero(token_slots >= 0)
    if not len(has):
        host.num_tiles.numpy()[0] = 0
        return 0
    order = np.argsort(token_slots[has], kind="stable")
    rows = has[order]
    seg_slots, counts = np.unique(token_slots[rows], return_counts=True)
    tiles_per = -(-counts // TILE)
    num_tiles = int(tiles_per.sum())
    # each token's entry: its slot group's first tile * TILE + its place in the group
    first_tile = np.zeros(len(counts), dtype=np.int64)
    np.cumsum(tiles_per[:-1], out=first_tile[1:])
    seg_start = np.zeros(len(counts), dtype=np.int64)
    np.cumsum(counts[:-1], out=seg_start[1:])
    seg_of = np.repeat(np.arange(len(counts)), counts)
    entry = first_tile[seg_of] * TILE + (np.arange(len(rows)) - seg_start[seg_of])
    token_rows = host.token_rows.numpy()
    token_rows[:num_tiles * TILE] = -1
    token_rows[entry] = rows
    host.tile_slots.numpy()[:num_tiles] = np.repeat(seg_slots, tiles_per)
    host.num_tiles.numpy()[0] = num_tiles
    return num_tiles


# -- torch reference ---------------------------------------------------------------------------------
def lora_add_ref(out: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                 shard_sizes: list[int], rank: int, token_slots: torch.Tensor) -> None:
    """out[t] += (x[t] A[s]^T) B[s]^T for every token t whose slot s = token_slots[t] >= 0, in fp32
    with one rounding. A merged layer (shards along out) has its shards' A stacked along the rank
    ([S, shards * rank, in]) and one B [S, out, rank]: shard i reads y[:, i*rank:(i+1)*rank] and
    writes its own output columns. Reads slots on the host: not for CUDA graphs."""
    slots = token_slots[:x.shape[0]]
    for s in torch.unique(slots).tolist():
        if s < 0:
            continue
        idx = torch.nonzero(slots == s).squeeze(1).to(x.device)
        y = x[idx].float() @ lora_a[s].float().t()
        col = 0
        for i, n in enumerate(shard_sizes):
            delta = y[:, i * rank:(i + 1) * rank] @ lora_b[s, col:col + n].float().t()
            out[idx, col:col + n] = (out[idx, col:col + n].float() + delta).to(out.dtype)
            col += n


def lora_add_impl(out: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                  num_tiles: torch.Tensor, token_slots: torch.Tensor, tile_slots: torch.Tensor,
                  token_rows: torch.Tensor, shard_sizes: list[int], rank: int,
                  use_kernels: bool | None = None) -> None:
    """out += delta, through the Triton kernels (CUDA by default) or the torch reference."""
    if use_kernels is None:
        use_kernels = use_kernels_for(out)
    if not use_kernels:
        lora_add_ref(out, x, lora_a, lora_b, shard_sizes, rank, token_slots)
        return
    from splitserve.kernels.lora import shrink_expand as kernels
    grid_tiles = max_tiles(x.shape[0], lora_a.shape[0])
    if grid_tiles == 0:
        return
    part = kernels.lora_shrink(x, lora_a, num_tiles, tile_slots, token_rows, grid_tiles, TILE)
    kernels.lora_expand_(out, part, lora_b, num_tiles, tile_slots, token_rows, grid_tiles, shard_sizes, rank, TILE)


def use_kernels_for(out: torch.Tensor) -> bool:
    """The Triton kernels on CUDA, the torch reference elsewhere (benchmarks/lora_gpu_check.py swaps
    this to run the reference on the GPU)."""
    return out.is_cuda
