"""The LoRA delta of one linear layer over the flat token stream, and the step's token -> slot layout.

`LoRABatch` is built once per step on the host from each token's slot (-1: no adapter): the tokens
that have one, grouped by slot. The delta is the custom op `splitserve::lora_add_` (opaque to
torch.compile, like the attention op), which adds scale * (x A[slot]^T) B[slot]^T into the base
layer's output in place; it reads the step's layout from the one module-level `current batch` here,
set by the runner before the forward (the custom-op boundary is why it is a global: the layout has
host-side ints that a compiled graph must not specialise on). With no batch set it adds nothing, but
the layers do not even call it then (lora/layers.py: the choice is made on the host per step).

On CUDA the op runs the Triton kernels (lora/kernels.py); elsewhere the torch reference below, which
is also what the kernel tests compare with.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class LoRABatch:
    sorted_tokens: torch.Tensor   # [n] int64: flat rows of the tokens that have an adapter, grouped by slot
    seg_starts: torch.Tensor      # [segs + 1] int32: where each slot's group starts in sorted_tokens
    seg_slots: torch.Tensor       # [segs] int32: the slot of each group
    seg_bounds: list[tuple[int, int, int]]  # host copy: (slot, start, end) per group
    max_seg_len: int


def build_lora_batch(token_slots: np.ndarray, device) -> LoRABatch | None:
    """From each token's slot (-1: none), the grouped layout; None when no token has an adapter."""
    has = np.flatnonzero(token_slots >= 0)
    if not len(has):
        return None
    slots = token_slots[has]
    order = np.argsort(slots, kind="stable")
    sorted_tokens = has[order]
    seg_slots, counts = np.unique(slots[order], return_counts=True)
    starts = np.zeros(len(counts) + 1, dtype=np.int32)
    np.cumsum(counts, out=starts[1:])
    bounds = [(int(s), int(a), int(b)) for s, a, b in zip(seg_slots, starts[:-1], starts[1:])]
    pin = torch.device(device).type == "cuda"

    def dev(a, dtype):
        t = torch.from_numpy(np.ascontiguousarray(a)).to(dtype)
        return (t.pin_memory() if pin else t).to(device, non_blocking=True)
    return LoRABatch(dev(sorted_tokens, torch.int64), dev(starts, torch.int32), dev(seg_slots, torch.int32),
                     bounds, int(counts.max()))


_current: LoRABatch | None = None


def set_lora_batch(batch: LoRABatch | None) -> None:
    global _current
    _current = batch


def current_lora_batch() -> LoRABatch | None:
    return _current


# -- torch reference ---------------------------------------------------------------------------------
def lora_shrink_ref(x: torch.Tensor, lora_a: torch.Tensor, batch: LoRABatch) -> torch.Tensor:
    """y [T, R] fp32: x[t] @ A[slot(t)]^T for tokens with an adapter, zero rows for the others."""
    y = torch.zeros(x.shape[0], lora_a.shape[1], dtype=torch.float32, device=x.device)
    for slot, start, end in batch.seg_bounds:
        idx = batch.sorted_tokens[start:end]
        y[idx] = x[idx].float() @ lora_a[slot].float().t()
    return y


def lora_expand_ref_(out: torch.Tensor, y: torch.Tensor, lora_b: torch.Tensor, batch: LoRABatch) -> None:
    """out[t] += y[t] @ B[slot(t)]^T for tokens with an adapter (fp32 accumulation, one rounding)."""
    for slot, start, end in batch.seg_bounds:
        idx = batch.sorted_tokens[start:end]
        out[idx] = (out[idx].float() + y[idx] @ lora_b[slot].float().t()).to(out.dtype)


def lora_add_impl(out: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                  shard_sizes: list[int], rank: int, batch: LoRABatch, use_kernels: bool | None = None) -> None:
    """out += delta. A merged layer (shards along out) has its shards' A stacked along the rank
    ([S, shards * rank, in]) and one B [S, out, rank]: shard i reads y[:, i*rank:(i+1)*rank] and
    writes its own output columns."""
    use_kernels = out.is_cuda if use_kernels is None else use_kernels
    if use_kernels:
        from splitserve.lora import kernels
        args = (batch.sorted_tokens, batch.seg_starts, batch.seg_slots, len(batch.seg_bounds), batch.max_seg_len)
        y = kernels.lora_shrink(x, lora_a, *args)
    else:
        y = lora_shrink_ref(x, lora_a, batch)
    col = 0
    for i, n in enumerate(shard_sizes):
        ys, bs, outs = y[:, i * rank:(i + 1) * rank], lora_b[:, col:col + n], out[:, col:col + n]
        if use_kernels:
            kernels.lora_expand_(outs, ys, bs, *args)
        else:
            lora_expand_ref_(outs, ys, bs, batch)
        col += n


@torch.library.custom_op("splitserve::lora_add_", mutates_args=("out",))
def lora_add_(out: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
              shard_sizes: list[int], rank: int) -> None:
    batch = _current
    if batch is not None:
        lora_add_impl(out, x, lora_a, lora_b, shard_sizes, rank, batch)


@lora_add_.register_fake
def _(out, x, lora_a, lora_b, shard_sizes, rank) -> None:
    return None
